"""python -m kvarn_mlx.generate on bad input, interrupted runs and long prompts:
one line naming the problem and the fix, nothing lost, nothing overwritten."""

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvarn_mlx import generate, prompt_cache
from model_folder import tiny_model_folder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def no_model(monkeypatch):
    """Flag errors must come before the model is loaded."""

    def load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr("kvarn_mlx.loader.load", load)


def one_line_error(argv):
    """main(argv) must exit non-zero with exactly one line, 'error: ...'."""
    with pytest.raises(SystemExit) as e:
        generate.main(argv)
    msg = e.value.code
    assert isinstance(msg, str), f"exit code {msg!r} without a message"
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--kv-sink", "-5"], "--kv-sink -5"),
        (["--kv-tail-tokens", "100"], "--kv-tail-tokens 100: tail_tokens=100 must be 0 or a"),
        (["--kv-tail-tokens", "-128"], "multiple of the tile size group_size=128"),
        (["--max-tokens", "0"], "--max-tokens 0"),
        (["--prefill-step-size", "0"], "--prefill-step-size 0"),
        (["--seed", "-1"], "--seed -1"),
        (["--temp", "nan"], "--temp nan"),
        (["--temp", "inf"], "--temp inf"),
        (["--temp", "-0.5"], "--temp -0.5"),
        (["--top-p", "1.5"], "--top-p 1.5"),
        (["--top-p", "nan"], "--top-p nan"),
        (["--kv-preset", "k1v1"], "--kv-preset: unknown KVarN preset 'k1v1'"),
        (["--prompt", "", "--ignore-chat-template"], "empty prompt"),
        (["--prompt", "  \n", "--ignore-chat-template"], "empty prompt"),
    ],
)
def test_bad_flags_one_line_before_loading(no_model, argv, names):
    assert names in one_line_error(argv)


def test_invalid_utf8_on_stdin(no_model, monkeypatch):
    monkeypatch.setattr(
        "sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait"), encoding="utf-8")
    )
    msg = one_line_error(["--prompt", "-"])
    assert "stdin is not valid UTF-8" in msg and "byte 3" in msg


def test_cache_destination_checked_before_loading(no_model, tmp_path):
    msg = one_line_error(["--prompt-cache-file", str(tmp_path / "missing" / "chat")])
    assert "does not exist; create the folder" in msg


def test_never_overwrites_a_file_that_is_not_a_prompt_cache(no_model, tmp_path):
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")  # an empty safetensors file
    before = weights.read_bytes()
    msg = one_line_error(["--prompt-cache-file", str(tmp_path / "weights")])
    assert "is not a kvarn-mlx prompt-cache file" in msg
    assert weights.read_bytes() == before


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_model_weights(tmp_path, tiny, damage):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny.iterdir():
        data = f.read_bytes()
        if f.name == "model.safetensors":
            data = data[: len(data) // 2] if damage == "truncate" else b"garbage"
        (bad / f.name).write_bytes(data)
    msg = one_line_error(["--model", str(bad)])
    assert str(bad) in msg and "download or convert it again" in msg


def test_cache_name_without_extension_is_reused(capsys, tmp_path, tiny):
    name = tmp_path / "chat"
    generate.main(["--model", str(tiny), "--max-tokens", "3", "--prompt-cache-file", str(name)])
    assert "Saved the prompt cache" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["chat.safetensors"]
    generate.main(["--model", str(tiny), "--max-tokens", "3", "--prompt-cache-file", str(name)])
    assert "KV cache: loaded from" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_cache_file(capsys, tmp_path, tiny, damage):
    path = tmp_path / "c.safetensors"
    generate.main(["--model", str(tiny), "--max-tokens", "3", "--prompt-cache-file", str(path)])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100] if damage == "truncate" else b"garbage" * 10)
    msg = one_line_error(["--model", str(tiny), "--prompt-cache-file", str(path)])
    assert "truncated" in msg or "not a safetensors file" in msg


def test_cache_from_another_model_names_both(capsys, tmp_path, tiny):
    other = tiny_model_folder(tmp_path / "other", seed=1)  # same shapes, other weights
    heads = tiny_model_folder(tmp_path / "heads", num_key_value_heads=2)
    path = tmp_path / "c.safetensors"
    generate.main(["--model", str(tiny), "--max-tokens", "3", "--prompt-cache-file", str(path)])
    msg = one_line_error(["--model", str(other), "--prompt-cache-file", str(path)])
    assert (
        f"saved with model {tiny} (2 layers, 1 kv heads)" in msg
        and f"{other} (2 layers, 1 kv heads)" in msg
    )
    msg = one_line_error(["--model", str(heads), "--prompt-cache-file", str(path)])
    assert f"{tiny} (2 layers, 1 kv heads)" in msg and f"{heads} (2 layers, 2 kv heads)" in msg


# -- context length ------------------------------------------------------------------

PROMPT_40 = " ".join(["word"] * 40)  # 40 tokens in SmolLM2's tokenizer


def generated(out):
    return int(out.split("Generation: ")[1].split()[0])


def test_generation_stops_at_the_context_limit(capsys, tmp_path):
    short = tiny_model_folder(tmp_path / "short", max_position_embeddings=64)
    argv = ["--model", str(short), "--prompt", PROMPT_40, "--ignore-chat-template"]
    generate.main([*argv, "--max-tokens", "100"])
    r = capsys.readouterr()
    assert "40-token prompt + --max-tokens 100 go beyond the model's 64-token context" in r.err
    assert generated(r.out) == 24
    generate.main([*argv, "--max-tokens", "100", "--allow-beyond-context"])
    r = capsys.readouterr()
    assert "beyond the model's 64-token context" in r.err and generated(r.out) == 100


def test_prompt_longer_than_the_context(capsys, tmp_path):
    short = tiny_model_folder(tmp_path / "short", max_position_embeddings=32)
    argv = ["--model", str(short), "--prompt", PROMPT_40, "--ignore-chat-template"]
    msg = one_line_error(argv)
    assert (
        "40-token prompt" in msg and "32-token context" in msg and "--allow-beyond-context" in msg
    )
    generate.main([*argv, "--max-tokens", "5", "--allow-beyond-context"])
    r = capsys.readouterr()
    assert "40-token prompt" in r.err and "32-token context" in r.err and generated(r.out) == 5


# -- Ctrl-C ----------------------------------------------------------------------------


def interrupt(argv, after_bytes=40, timeout=120):
    """Run the CLI, send SIGINT once `after_bytes` of the answer are out; (rc, stdout, stderr)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [sys.executable, "-m", "kvarn_mlx.generate", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.set_blocking(p.stdout.fileno(), False)
    out, deadline = b"", time.monotonic() + timeout
    while len(out) < after_bytes and p.poll() is None and time.monotonic() < deadline:
        out += p.stdout.read() or b""
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=timeout)
    return p.returncode, (out + rest).decode(), err.decode()


def test_ctrl_c_stops_cleanly_prints_stats_and_saves(tmp_path, tiny):
    path = tmp_path / "c.safetensors"
    rc, out, err = interrupt(
        ["--model", str(tiny), "--max-tokens", "6000", "--prompt-cache-file", str(path)]
    )
    assert rc == 130, err
    assert "Traceback" not in err and "interrupted" in err
    assert "KV cache: auto4v2" in out and "Generation: " in out
    n = generated(out)
    assert 0 < n < 6000
    assert "Saved the prompt cache" in err
    # the saved cache holds the prompt and what was generated before the interrupt
    from kvarn_mlx.loader import load

    model, tok = load(str(tiny))
    cache, _ = prompt_cache.load(path, prompt_cache.model_identity(str(tiny), model, tok))
    prompt_len = len(generate.build_prompt(tok, generate.DEFAULT_PROMPT))
    assert prompt_len + n - 1 <= cache[0].offset <= prompt_len + n


def test_ctrl_c_during_the_prompt_saves_no_partial_cache(tmp_path, tiny):
    path = tmp_path / "c.safetensors"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvarn_mlx.generate",
            "--model",
            str(tiny),
            "--prompt",
            "-",
            "--ignore-chat-template",
            "--prefill-step-size",
            "8",
            "--prompt-cache-file",
            str(path),
        ],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    p.stdin.write(" ".join(["word"] * 8000).encode())
    p.stdin.close()
    p.stdin = None  # sent; communicate() must not flush it
    os.set_blocking(p.stderr.fileno(), False)
    err, deadline = b"", time.monotonic() + 120
    while b"prefill 8/" not in err and p.poll() is None and time.monotonic() < deadline:
        err += p.stderr.read() or b""
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    os.set_blocking(p.stderr.fileno(), True)
    out, rest = p.communicate(timeout=120)
    err = (err + rest).decode()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "the prompt was not fully processed" in err
    assert "KV bytes held" in out.decode() and not path.exists()
