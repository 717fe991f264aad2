"""python -m apps.chat: a local web chat with a live view of KV-cache memory, served
by python -m kvarn_mlx.server (all of its flags, and mlx_lm.server's, work), or
--cli: a chat in the terminal."""

import argparse
import sys
from pathlib import Path

from kvarn_mlx import guard, server
from kvarn_mlx import profile as profiles
from kvarn_mlx.cli_support import add_kv_flags, flag
from kvarn_mlx.config import DEFAULT_PRESET, tail_error
from kvarn_mlx.loader import home

PORT = 8321


def cli_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m apps.chat --cli", description="chat in the terminal"
    )
    p.add_argument("--cli", action="store_true")
    p.add_argument(
        "--model",
        default=None,
        help=(
            "MLX model folder or Hugging Face repo id (default: the embedded SmolLM2-135M-Instruct)"
        ),
    )
    add_kv_flags(p, sink=False)
    p.add_argument("--max-tokens", type=int, default=512, help="reply length limit (tokens)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--resume", default=None, help="resume a conversation saved with /save")
    return p.parse_args(argv)


def arg_parser():
    """kvarn_mlx.server's flags plus the page's."""
    p = server.arg_parser()
    p.prog = "python -m apps.chat"
    p.description = __doc__
    g = p.add_argument_group("chat app")
    g.add_argument(
        "--save-dir",
        type=Path,
        default=home() / "chats",
        help="where the page saves chats (default $KVARN_MLX_HOME/chats)",
    )
    g.add_argument(
        "--cli", action="store_true", help="chat in the terminal instead (flags: --cli --help)"
    )
    return p


def network_warning(host, api_key):
    """The warning for a bind beyond loopback (None on loopback)."""
    if guard.is_local_name(host):
        return None
    if api_key:
        who = "Clients need the API key; it travels unencrypted (plain HTTP)."
    else:
        who = (
            "There is no API key: anyone who can reach this machine can use the model and\n"
            "read and overwrite saved chats. Set --api-key (or $" + server.API_KEY_ENV + ")."
        )
    bar = "!" * 72
    return f"{bar}\nWARNING: binding {host}: the API is reachable from the network.\n{who}\n{bar}"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--cli" in argv:
        from .cli import run_cli

        args = cli_args(argv)
        try:
            profile = profiles.from_settings(args, DEFAULT_PRESET)
        except ValueError as e:
            sys.exit(f"error: {e}")
        if profile[0] is None and tail_error(args.kv_preset, args.kv_tail_tokens):
            sys.exit(f"error: --kv-tail-tokens: {tail_error(args.kv_preset, args.kv_tail_tokens)}")
        return run_cli(
            dict(
                models=[args.model],
                preset=args.kv_preset,
                max_tokens=args.max_tokens,
                temp=args.temp,
                profile=profile,
                tail_tokens=args.kv_tail_tokens,
            ),
            resume=args.resume,
        )
    parser = arg_parser()
    ours, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        return server.main(argv, parser=parser)
    if flag(rest, "--port") is None:
        argv += ["--port", str(PORT)]
    host, port = flag(rest, "--host", "127.0.0.1"), flag(argv, "--port")
    warning = network_warning(host, ours.api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    from .server import ChatHandler

    shown = f"[{host}]" if ":" in host else host
    print(
        f"kvarn chat: http://{shown}:{port}/  (loading the model; Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    return server.main(argv, handler=ChatHandler, parser=parser)


if __name__ == "__main__":
    sys.exit(main())
