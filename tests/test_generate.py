"""python -m kvarn_mlx.generate on the embedded model."""

import io
from pydoc_data.topics import topics

import pytest

from kvarn_mlx import generate

QUESTION = "What is the capital of France?"
# A long system prompt with no sink puts the prompt into quantized tiles before the answer
# (prose from CPython's own documentation, present in every Python install).
LONG_SYSTEM = "You are a helpful assistant. " + " ".join(topics["naming"].split()[:230])


def run(capsys, *argv):
    generate.main(["--max-tokens", "20", *argv])
    return capsys.readouterr()


pytestmark = pytest.mark.e2e


# k2v2_g128 by default; k4v2_g128 with -m slow (the default preset's answer over
# quantized tiles: test_compare_runs_the_plain_cache_too).
@pytest.mark.parametrize("preset", [pytest.param("k4v2_g128", marks=pytest.mark.slow), "k2v2_g128"])
def test_answers_with_quantized_tiles(capsys, smollm, preset):
    out = run(
        capsys,
        "--prompt",
        QUESTION,
        "--system-prompt",
        LONG_SYSTEM,
        "--kv-preset",
        preset,
        "--kv-sink",
        "0",
    ).out
    assert "Paris" in out
    assert f"KV cache: {preset}" in out
    tiles = int(out.split("Tiles quantized: ")[1].split()[0])
    assert tiles >= 2  # the answer was decoded over quantized tiles
    assert "tokens-per-sec" in out and "Peak memory" in out and "2-byte (fp16) equivalent" in out


def test_compare_runs_the_plain_cache_too(capsys, smollm):
    out = run(
        capsys, "--prompt", QUESTION, "--system-prompt", LONG_SYSTEM, "--kv-sink", "0", "--compare"
    ).out
    assert out.count("Paris") >= 2
    assert "KV cache: fp16" in out and "Measured, held: plain" in out
    assert "Measured, per token without preallocated room: plain" in out


def test_prompt_from_stdin(capsys, smollm, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(QUESTION))
    assert "Paris" in run(capsys, "--prompt", "-").out


def test_prompt_cache_file_saved_then_reused(capsys, smollm, tmp_path):
    path = tmp_path / "chat.safetensors"
    first = run(
        capsys,
        "--prompt",
        QUESTION,
        "--system-prompt",
        LONG_SYSTEM,
        "--kv-sink",
        "0",
        "--prompt-cache-file",
        str(path),
    )
    assert path.exists() and "Saved the prompt cache" in first.err
    again = run(
        capsys,
        "--prompt",
        "And of Italy?",
        "--ignore-chat-template",
        "--prompt-cache-file",
        str(path),
    ).out
    assert "KV cache: loaded from chat.safetensors" in again
    assert int(again.split("Tiles quantized: ")[1].split()[0]) >= 2


def test_bad_input_exits_with_the_fix(capsys, smollm, tmp_path):
    with pytest.raises(
        SystemExit, match="--kv-preset: unknown KVarN preset 'k1v1'; valid presets: .*k4v2_g128"
    ):
        generate.main(["--kv-preset", "k1v1"])
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(
        SystemExit, match="broken.safetensors is not a safetensors file .*delete it"
    ):
        generate.main(["--prompt-cache-file", str(bad)])
    with pytest.raises(SystemExit, match="no such model folder"):
        generate.main(["--model", str(tmp_path / "missing")])


def test_quiet_run_prints_just_the_text(capsys, smollm):
    out = run(capsys, "--prompt", QUESTION, "--verbose", "false").out
    assert "Paris" in out and "KV cache:" not in out


def test_max_kl_holds_at_the_context_the_run_reaches(capsys, smollm):
    # The committed SmolLM2 profile measured how the KL grows to 4,096 tokens: by default
    # --kv-max-kl is predicted at the prompt plus --max-tokens; --kv-context sets another.
    import re
    from pathlib import Path

    profile = Path(__file__).parents[1] / "benchmarks" / "results" / "profile_smollm2_1024.json"
    base = ["--prompt", QUESTION, "--kv-profile", str(profile), "--kv-max-kl", "0.02"]
    widths = {}
    for context in (None, 65536):
        err = run(capsys, *base, *(["--kv-context", str(context)] if context else [])).err
        line = next(l for l in err.splitlines() if l.startswith("KV widths from the profile"))
        at = int(re.search(r"predicted KL <= 0.02 at ([\d,]+) tokens", line)[1].replace(",", ""))
        kl = float(re.search(r"\(([\d.e-]+) at [\d,]+ tokens\)", line)[1])
        assert kl <= 0.02
        widths[context] = float(re.search(r"([\d,.]+) tile bytes/token", line)[1].replace(",", ""))
        if context is None:
            assert 20 < at <= 20 + 64  # the prompt's tokens and --max-tokens 20
        else:
            assert at == context
    assert widths[65536] > widths[None]  # the KL grows with the context: wider layers
