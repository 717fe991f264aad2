"""The generate CLI's stats block: KV bytes held against mlx-lm's plain cache in
the model's dtype and, separately, the 2-byte equivalent; honest before the
first tile and per token in --compare."""

import re

import mlx.core as mx
import pytest

from kvarn_mlx import generate
from model_folder import CONFIG, tiny_model_folder

WORDS = " ".join(["word"] * 300)  # 300 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def caches(monkeypatch):
    """The caches the CLI made, in order."""
    made = []

    def make_cache(*a, **k):
        made.append(generate_make_cache(*a, **k))
        return made[-1]

    generate_make_cache = generate.make_cache
    monkeypatch.setattr(generate, "make_cache", make_cache)
    return made


def stats(capsys, *argv):
    generate.main(["--max-tokens", "5", *argv])
    return capsys.readouterr().out


def mib(x):
    return f"{x / 2**20:.2f} MiB"


def plain_bytes_per_token(dtype_bytes):
    c = CONFIG
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * dtype_bytes


def test_before_the_first_tile_it_says_so(capsys, tiny):
    out = stats(capsys, "--model", str(tiny))
    assert "no tile quantized yet" in out
    start = int(re.search(r"KVarN starts saving memory from token (\d+)", out).group(1))
    assert start > int(out.split("Prompt: ")[1].split()[0]) + 5
    assert "Key rotation" not in out and "x less" not in out and "0.50x" not in out


def test_saving_starts_where_it_says(capsys, tiny):
    out = stats(capsys, "--model", str(tiny))
    start = int(re.search(r"from token (\d+)", out).group(1))
    words = " ".join(["word"] * start)
    out = stats(
        capsys,
        "--model",
        str(tiny),
        "--prompt",
        words,
        "--ignore-chat-template",
        "--max-tokens",
        "1",
    )
    per_token = re.search(r"KV bytes held: .* for (\d+) tokens", out)
    assert int(per_token.group(1)) >= start and "no tile quantized yet" not in out
    assert (
        float(re.search(r"plain cache, float32: .* \(KVarN holds ([\d.]+)x less\)", out).group(1))
        > 1
    )


@pytest.mark.parametrize(
    "dtype, name, nbytes", [(mx.float32, "float32", 4), (mx.float16, "float16", 2)]
)
def test_held_against_plain_cache_in_the_model_dtype(capsys, caches, tmp_path, dtype, name, nbytes):
    folder = tiny_model_folder(tmp_path / name, dtype=dtype)
    out = stats(
        capsys,
        "--model",
        str(folder),
        "--prompt",
        WORDS,
        "--ignore-chat-template",
        "--kv-sink",
        "0",
    )
    held = sum(c.nbytes for c in caches[0])
    tokens = caches[0][0].offset
    assert f"KV bytes held: {mib(held)} for {tokens} tokens" in out
    assert f"mlx-lm's plain cache, {name}: " in out
    assert f"2-byte (fp16) equivalent: {mib(plain_bytes_per_token(2) * tokens)}" in out
    assert "Tiles quantized: 2 per layer" in out and "Key rotation (auto): " in out


def test_compare_reports_bytes_per_token(capsys, tiny):
    # 41 tokens: the plain cache holds 256 tokens of room, KVarN its tokens only
    out = stats(
        capsys,
        "--model",
        str(tiny),
        "--prompt",
        " ".join(["word"] * 41),
        "--ignore-chat-template",
        "--compare",
    )
    per = plain_bytes_per_token(4)
    assert (
        f"per token without preallocated room: plain {per} bytes, KVarN {per} bytes; plain/KVarN "
        "1.00x" in out
    )
    assert re.search(r"held: plain [\d.]+ MiB, KVarN [\d.]+ MiB; plain/KVarN [\d.]+x", out)
