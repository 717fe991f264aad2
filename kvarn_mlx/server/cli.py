"""kvarn-server, python -m kvarn_mlx.server: mlx-lm's server command with the
KVarN flags. Its own flags are read here; the rest go to mlx_lm.server's
main(), which hooks.install() has pointed at KVarN caches and our handler."""

import argparse
import os
import sys

import mlx_lm.server as mlx_server

from .. import budget
from ..cli_support import add_kv_flags
from ..config import DEFAULT_PRESET, FP16, preset_error, tail_error
from ..profile import from_settings
from .handler import APIHandler
from .hooks import install

API_KEY_ENV = "KVARN_API_KEY"


def arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m kvarn_mlx.server",
        add_help=False,
        description="mlx-lm's server (all of mlx_lm.server's flags work) on KVarN KV caches.",
    )
    # mlx-lm's --model, read here too: embedded names become their folder for mlx-lm
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("KVarN")
    add_kv_flags(g, fp16="mlx-lm's own cache (then mlx-lm's --kv-bits applies)")
    g.add_argument(
        "--max-kv-bytes",
        type=size_flag,
        default=None,
        metavar="SIZE",
        help=(
            "the most KV bytes one request's cache may hold (e.g. 2GB): a longer prompt is "
            "refused, and a request stops (finish_reason length) before its cache could grow past "
            "it"
        ),
    )
    g.add_argument(
        "--allowed-hosts",
        type=lambda x: [h.strip().lower() for h in x.split(",") if h.strip()],
        default=[],
        help="Host names this server answers to besides localhost and its own "
        "address, comma-separated ('*': any)",
    )
    g.add_argument(
        "--allowed-origins",
        type=lambda x: [o.strip().lower().rstrip("/") for o in x.split(",")],
        default=[],
        help="web page origins allowed to send requests, comma-separated "
        "('*': any; default: none besides this server's own)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require `Authorization: Bearer KEY` (default: ${API_KEY_ENV})",
    )
    return p


def profile_error(settings):
    """What is wrong with --kv-profile, --kv-bytes-like, --kv-max-kl (None if they work)."""
    try:
        from_settings(settings, DEFAULT_PRESET)
    except ValueError as e:
        return str(e)
    return None


def size_flag(text):
    try:
        return budget.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None, handler=APIHandler, parser=None):
    """handler: an APIHandler subclass to serve with (apps/chat's adds its page);
    parser: arg_parser() with more flags, which reach the handler as its settings."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = parser or arg_parser()
    ours, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print("\nmlx_lm.server's flags:\n")
    elif preset_error(ours.kv_preset):
        parser.error(f"--kv-preset: {preset_error(ours.kv_preset)}")
    elif ours.kv_sink is not None and ours.kv_sink < 0:
        parser.error(f"--kv-sink {ours.kv_sink}: must be >= 0")
    elif ours.kv_profile is None and tail_error(ours.kv_preset, ours.kv_tail_tokens):
        parser.error(f"--kv-tail-tokens: {tail_error(ours.kv_preset, ours.kv_tail_tokens)}")
    elif profile_error(ours):
        parser.error(profile_error(ours))
    elif ours.kv_preset != FP16 and any(
        a == "--kv-bits" or a.startswith("--kv-bits=") for a in rest
    ):
        parser.error(
            "--kv-bits is mlx-lm's own quantized cache (one request at a time); this server "
            f"quantizes with KVarN: use --kv-preset (or --kv-preset {FP16} --kv-bits N for "
            "mlx-lm's)"
        )
    if "-h" not in rest and "--help" not in rest:
        rest += ["--model", resolve_model(ours.model)]  # ours.model as given: /v1/models lists it
    # mlx-lm's --allowed-origins sets its CORS headers: the same list as ours.
    rest += ["--allowed-origins", ",".join(ours.allowed_origins)]
    install(ours, handler)
    sys.argv = [parser.prog, *rest]
    mlx_server.main()


def resolve_model(spec):
    """The --model mlx-lm loads: the folder of the embedded model spec names
    (embedded:<key>, the key alone, or None: the default one), else spec as given."""
    from .. import loader

    try:
        path = loader.embedded_path(spec)
    except loader.ModelLoadError as e:
        sys.exit(f"error: --model: {e}")
    return spec if path is None else str(path)
