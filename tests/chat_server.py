"""The chat server in this process, for tests that look at its state.

`serve(app)` runs a Starlette app under uvicorn on a free loopback port in a
thread; `chat_worker(smollm)` is a Worker around the session's model, so no
second model is loaded. Waits are on conditions, with generous timeouts.
"""

import contextlib
import threading
import time

import pytest

for _mod in ("starlette", "uvicorn", "sse_starlette", "httpx"):
    pytest.importorskip(_mod, reason="the web app needs the 'app' extra: pip install -e '.[app]'")

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from apps.chat.worker import Worker  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT = 120  # seconds; only ever hit when something is broken


def wait_for(condition, what, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def chat_worker(smollm, max_tokens=4, preset="fp16"):
    worker = Worker(dict(preset=preset, max_tokens=max_tokens, loaded=smollm))
    try:
        wait_for(worker.ready.is_set, "the engine")
        assert worker.engine is not None, worker.error
        yield worker
    finally:
        worker.stop()


@contextlib.contextmanager
def serve(app):
    """Run app on 127.0.0.1:<free port>; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), "uvicorn to start")
        assert server.started, "uvicorn did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def port_of(url):
    return int(url.rsplit(":", 1)[1])


def post(url, body=None, content=None, headers=None, timeout=TIMEOUT):
    """POST JSON (body) or raw bytes (content) with a JSON Content-Type unless given."""
    import json

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
