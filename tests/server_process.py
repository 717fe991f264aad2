"""A server command (kvarn_mlx.server, apps.chat, either under mlx.launch) in a
subprocess for the end-to-end tests: a free port, the wait until it answers
/health, and the stop."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url):
    """Whether the server at url answers /health with status ok."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return json.loads(r.read()).get("status") == "ok"
    except (OSError, ValueError):  # not listening yet (URLError is an OSError), or half up
        return False


@contextlib.contextmanager
def running(cmd, url, log, what="the server", timeout=120, new_session=False, env=None):
    """Run cmd, a server that listens at url, from the repository's folder with its
    output in the open file log; yield the process once it answers /health. The test
    fails with the log if it exits or does not answer within timeout seconds. Stopped
    afterwards: its process group with new_session (mlx.launch leaves its ranks
    running when it is stopped alone)."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=new_session,
    )
    try:
        deadline = time.monotonic() + timeout
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"{what} did not start:\n{Path(log.name).read_text()}")
            time.sleep(0.2)
        yield proc
    finally:
        _stop(proc, signal.SIGTERM, new_session)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            _stop(proc, signal.SIGKILL, new_session)
            proc.wait(5)


def _stop(proc, sig, group):
    try:
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    except ProcessLookupError:  # already gone
        pass
