"""The chat app's server for tests.

`serve(save_dir, ...)` runs apps.chat's request handler (kvarn_mlx.server's,
plus the page and saved chats) in this process, in front of a stub response
generator that loads no model and records what reached it: for the guard, the
page, saved chats and request validation. `chat_app(...)` runs the real
`python -m apps.chat` in a subprocess. Waits are on conditions, with generous timeouts.
"""

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

from apps.chat.server import ChatHandler  # noqa: E402
from kvarn_mlx.server.stats import KVStats  # noqa: E402
from server_process import free_port, running  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
TIMEOUT = 120  # seconds; only ever hit when something is broken


def wait_for(condition, what, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


class StubGenerator:
    """Stands in for mlx-lm's ResponseGenerator: no model; every request that
    reaches it is recorded and answered with an error (mlx-lm's 404)."""

    def __init__(self):
        self.cli_args = argparse.Namespace(
            model="stub-model",
            allowed_origins=[],
            num_draft_tokens=3,
            max_tokens=4,
            temp=0.0,
            top_p=1.0,
            top_k=0,
            min_p=0.0,
        )
        self.requests = []
        self.is_healthy = True

    def generate(self, request, args, progress_callback=None):
        self.requests.append((request, args))
        raise RuntimeError("the stub generates nothing")


@contextlib.contextmanager
def serve(save_dir, allowed_hosts=(), allowed_origins=(), api_key=None):
    """ChatHandler on 127.0.0.1:<free port> with a StubGenerator; yields (base URL, the stub)."""
    stub = StubGenerator()
    settings = argparse.Namespace(
        allowed_hosts=list(allowed_hosts),
        allowed_origins=list(allowed_origins),
        api_key=api_key,
        kv_preset="k4v2_g128",
        kv_sink=None,
        kv_tail_tokens=None,
        save_dir=Path(save_dir),
    )
    stats = KVStats()
    httpd = ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a, **k: ChatHandler(stub, stats, settings, *a, **k)
    )
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name="chat-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", stub
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(30)


@contextlib.contextmanager
def chat_app(save_dir, *flags):
    """python -m apps.chat on a free port (the embedded model unless flags name one); yields
    its URL."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if os.path.exists(BLAS) and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = BLAS
    env.pop("KVARN_API_KEY", None)
    cmd = [
        sys.executable,
        "-m",
        "apps.chat",
        "--port",
        str(port),
        "--save-dir",
        str(save_dir),
        *flags,
    ]
    url = f"http://127.0.0.1:{port}"
    with (
        open(Path(save_dir).parent / f"chat-{port}.log", "w+") as log,
        running(cmd, url, log, "the chat app", env=env),
    ):
        yield url


def port_of(url):
    return int(url.rsplit(":", 1)[1])


def post(url, body=None, content=None, headers=None, timeout=TIMEOUT):
    """POST JSON (body) or raw bytes (content) with a JSON Content-Type unless given."""
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    data = content if content is not None else json.dumps(body)
    return httpx.post(url, content=data, headers=h, timeout=timeout)


def user(text):
    return [{"role": "user", "content": text}]


def read_response(s):
    """Read until the server closes, or until a complete response with Content-Length arrived."""
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, BrokenPipeError, TimeoutError):
            break
        if not chunk:
            break
        data += chunk
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length" and len(rest) >= int(value):
                    return data
    return data
