"""python -m apps.chat: a local web chat (or --cli) with a live view of KV-cache memory."""

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

from kvarn_mlx.config import DEFAULT_PRESET
from kvarn_mlx.loader import home

from .engine import PRESET_NAMES

API_KEY_ENV = "KVARN_CHAT_API_KEY"


def names(text):
    return [n.strip() for n in text.split(",") if n.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m apps.chat", description=__doc__)
    p.add_argument("--model", action="append", default=None,
                   help="MLX model folder or Hugging Face repo id; repeat to offer several in the picker "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--kv-preset", default=DEFAULT_PRESET, choices=PRESET_NAMES,
                   help=f"KV cache preset (default {DEFAULT_PRESET}; fp16 = mlx-lm's plain cache)")
    p.add_argument("--port", type=int, default=8321, help="port (default 8321; 0 = any free port)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1). Anything else makes the API reachable from the "
                        "network: set --api-key")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require `Authorization: Bearer KEY` on every endpoint (default: ${API_KEY_ENV}, which keeps "
                        "the key out of the process list). The page asks for it and keeps it for the browser tab")
    p.add_argument("--allowed-hosts", type=names, default=[],
                   help="comma-separated Host names to answer besides localhost names and the bound address "
                        "(a LAN name, a reverse proxy's name; * for any)")
    p.add_argument("--allowed-origins", type=names, default=[],
                   help="comma-separated web origins (scheme://host:port) allowed to call the API besides "
                        "the page itself")
    p.add_argument("--max-tokens", type=int, default=512, help="default reply length limit (tokens)")
    p.add_argument("--temp", type=float, default=0.0, help="default sampling temperature")
    p.add_argument("--save-dir", default=None, help="where the page saves chats (default $KVARN_MLX_HOME/chats)")
    p.add_argument("--cli", action="store_true", help="chat in the terminal instead of a browser")
    p.add_argument("--resume", default=None, help="--cli: resume a conversation saved with /save")
    return p.parse_args(argv)


def is_loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def network_warning(host, api_key):
    """The warning for a bind beyond loopback (None on loopback)."""
    if is_loopback(host):
        return None
    if api_key:
        who = "Clients need the API key; it travels unencrypted (plain HTTP)."
    else:
        who = ("There is no API key: anyone who can reach this machine can use the model and\n"
               "read and overwrite saved chats. Set --api-key (or $" + API_KEY_ENV + ").")
    bar = "!" * 72
    return f"{bar}\nWARNING: binding {host}: the API is reachable from the network.\n{who}\n{bar}"


def main(argv=None):
    args = parse_args(argv)
    models = args.model or [None]
    engine_kwargs = dict(models=models, preset=args.kv_preset, max_tokens=args.max_tokens, temp=args.temp)
    if args.cli:
        from .cli import run_cli

        return run_cli(engine_kwargs, resume=args.resume)
    try:
        import uvicorn

        from .server import create_app
        from .worker import Worker
    except ImportError as e:
        sys.exit(f"error: the web app needs the 'app' extra ({e.name} is missing): "
                 "pip install -e '.[app]'  (or use --cli)")
    warning = network_warning(args.host, args.api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print("loading the model...", file=sys.stderr, flush=True)
    worker = Worker(engine_kwargs)
    worker.ready.wait()
    if worker.engine is None:
        sys.exit(f"error: {worker.error}")
    app = create_app(worker, Path(args.save_dir) if args.save_dir else home() / "chats",
                     allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins, api_key=args.api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=3)
    server = uvicorn.Server(config)
    # Print the URL once the socket is bound (port 0 picks a free one).
    orig_startup = server.startup

    async def startup(sockets=None):
        await orig_startup(sockets=sockets)
        for s in server.servers:
            for sock in s.sockets:
                host, port = sock.getsockname()[:2]
                shown = f"[{host}]" if ":" in host else host
                print(f"kvarn chat: http://{shown}:{port}/  (model {worker.engine.name}, "
                      f"KV preset {worker.engine.preset}; Ctrl-C stops)", flush=True)

    server.startup = startup
    try:
        server.run()
    finally:
        worker.stop()


if __name__ == "__main__":
    sys.exit(main())
