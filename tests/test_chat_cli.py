"""python -m apps.chat --cli: /save never loses the session or another file, Ctrl-C
stops a reply and keeps the conversation."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apps.chat import cli
from kvarn_mlx import prompt_cache
from model_folder import tiny_model_folder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("models") / "tiny")


def script(lines):
    it = iter(lines)

    def inp(prompt):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return inp


def chat(tiny, lines, out=None, max_tokens=6):
    out = out or io.StringIO()
    rc = cli.run_cli({"models": [str(tiny)], "max_tokens": max_tokens}, inp=script(lines), out=out)
    return rc, out.getvalue()


def saved_messages(path):
    return json.loads(prompt_cache.read_metadata(path)["messages"])


def test_save_naming_and_never_overwriting_another_file(tiny, tmp_path):
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    before = weights.read_bytes()
    rc, out = chat(
        tiny, ["Hi", f"/save {tmp_path / 'chat'}", f"/save {tmp_path / 'weights'}", "Still there?"]
    )
    assert rc == 0
    assert f"saved to {tmp_path / 'chat.safetensors'}" in out
    assert "not a kvarn-mlx prompt-cache file" in out and "/save! FILE" in out
    assert weights.read_bytes() == before
    assert out.count(" ctx tokens") == 2  # the session went on after the refused save
    # asked explicitly, it is replaced
    rc, out = chat(tiny, ["Hi", f"/save! {tmp_path / 'weights'}"])
    assert (
        f"saved to {weights}" in out and [m["content"] for m in saved_messages(weights)][0] == "Hi"
    )


def test_failed_save_keeps_the_session(tiny, tmp_path, monkeypatch):
    from apps.chat.engine import Engine

    def disk_full(self, path, **kw):
        raise RuntimeError("[save_safetensors] Failed to open file")

    rc, out = chat(tiny, ["Hi", f"/save {tmp_path / 'missing' / 'chat'}", "Again"])
    assert rc == 0 and "does not exist" in out and out.count(" ctx tokens") == 2
    monkeypatch.setattr(Engine, "save", disk_full)
    rc, out = chat(tiny, ["Hi", f"/save {tmp_path / 'chat'}", "Again"])
    assert rc == 0 and "error: could not save: [save_safetensors] Failed to open file" in out
    assert out.count(" ctx tokens") == 2


class CtrlCAfter(io.StringIO):
    """Output that presses Ctrl-C (a real SIGINT) once `n` pieces of the armed reply are written."""

    def __init__(self, n):
        super().__init__()
        self.n, self.armed = n, False

    def write(self, s):
        if self.armed and s:
            self.n -= 1
            if self.n == 0:
                self.armed = False
                signal.raise_signal(signal.SIGINT)
        return super().write(s)


def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(tiny, tmp_path):
    out = CtrlCAfter(3)
    lines = iter(["Hi", f"/save {tmp_path / 'c'}", "Again", "/quit"])

    def inp(prompt):
        line = next(lines)
        out.armed = line == "Hi"
        return line

    assert cli.run_cli({"models": [str(tiny)], "max_tokens": 500}, inp=inp, out=out) == 0
    text = out.getvalue()
    assert "(stopped)" in text and text.count(" ctx tokens") == 2
    messages = saved_messages(tmp_path / "c.safetensors")
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "Hi"
    assert 0 < len(messages[1]["content"]) < 500


def test_ctrl_c_in_a_terminal_session(tiny, tmp_path):
    """A real process and a real SIGINT mid-reply: no abort, no traceback, the session goes on."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [sys.executable, "-m", "apps.chat", "--cli", "--model", str(tiny), "--max-tokens", "4000"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.set_blocking(p.stdout.fileno(), False)

    def read_until(pred, timeout=120):
        buf, deadline = b"", time.monotonic() + timeout
        while not pred(buf) and p.poll() is None and time.monotonic() < deadline:
            buf += p.stdout.read() or b""
            time.sleep(0.02)
        return buf

    head = read_until(lambda b: b"/quit" in b)
    p.stdin.write(b"Hi\n")
    p.stdin.flush()
    reply = read_until(lambda b: len(b) > 60)
    p.send_signal(signal.SIGINT)
    p.stdin.write(f"/save {tmp_path / 'c'}\n/quit\n".encode())
    p.stdin.flush()
    os.set_blocking(p.stdout.fileno(), True)
    rest, err = p.communicate(timeout=120)
    text = (head + reply + rest).decode()
    assert p.returncode == 0, err.decode()
    assert "Traceback" not in err.decode() and "(stopped)" in text and "saved to" in text
    messages = saved_messages(tmp_path / "c.safetensors")
    assert messages[0]["content"] == "Hi" and messages[1]["role"] == "assistant"


def test_model_that_cannot_load_is_one_line(tiny, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny.iterdir():
        (bad / f.name).write_bytes(b"garbage" if f.name == "model.safetensors" else f.read_bytes())
    out = io.StringIO()
    assert cli.run_cli({"models": [str(bad)]}, inp=script(["Hi"]), out=out) == 1
    lines = out.getvalue().splitlines()
    assert lines[0] == "loading the model..." and len(lines) == 2
    assert (
        lines[1].startswith("error: cannot load the model")
        and "download or convert it again" in lines[1]
    )


def test_invalid_utf8_input_line_is_reported_and_skipped(tiny):
    lines = iter([UnicodeDecodeError("utf-8", b"caf\xe9", 3, 4, "invalid continuation byte"), "Hi"])

    def inp(prompt):
        line = next(lines, None)
        if line is None:
            raise EOFError
        if isinstance(line, Exception):
            raise line
        return line

    out = io.StringIO()
    assert cli.run_cli({"models": [str(tiny)], "max_tokens": 3}, inp=inp, out=out) == 0
    assert (
        "error: that line is not valid UTF-8" in out.getvalue()
        and out.getvalue().count(" ctx tokens") == 1
    )
