"""Convert a GGUF file (llama, gemma3 or qwen2 architecture) into an MLX model
folder.

`mx.load` reads GGUF directly: Q4_0, Q4_1 and Q8_0 tensors come back as MLX
affine group-32 (weight, scales, biases) triples, which `mx.dequantize` turns
back into the stored values (rounded to float16, the scales' type). Other
types it dequantizes itself to float16, and not always right: MLX 0.32.4's
Q4_K gives errors as large as the weights (Qwen2.5-Coder's attn_q). Files with
such tensors are read with the `gguf` package (llama.cpp's Python reader),
which dequantizes every type as llama.cpp does.

The tokenizer is rebuilt from the GGUF metadata with the `tokenizers` library
(transformers' own GGUF tokenizer path imports torch).
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

# Bump when the conversion output changes, so cached folders are redone.
# 2: K-quant and Q5_0 files always through the gguf package (MLX's Q4_K is wrong).
CONVERTER_VERSION = 2

_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# GGUF tensor name -> mlx-lm parameter name, per layer and per model type.
_LAYER_NAMES = {
    "llama": _LLAMA_LAYER,
    # Same layout; q/k/v carry biases (found by name in model_weights).
    "qwen2": _LLAMA_LAYER,
    "gemma3_text": {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

def _value(v):
    """GGUF metadata scalars arrive as 0-d mx.arrays; make them Python values."""
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def _f32(v):
    """Shortest decimal of a float32 metadata value (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(v)))


def read(path):
    """Return (tensors, metadata) of a GGUF file, metadata as Python values.

    Tensors are named as `mx.load` names them: `<name>.weight`, plus
    `<name>.scales` and `<name>.biases` for the Q4_0/Q4_1/Q8_0 blocks it reads
    (MLX affine group-32). Files that only the `gguf` package reads arrive
    dequantized to float32.
    """
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
        # float16 is either an F16 tensor or one mx.load dequantized itself
        # (K-quants, Q5_0), which it may get wrong: the gguf package reads both.
        if not any(t.dtype == mx.float16 for t in tensors.values()):
            return tensors, {k: _value(v) for k, v in metadata.items()}
        mlx_error = "K-quant, Q5_0 or F16 tensors"
    except Exception as e:
        mlx_error = e
    try:
        import gguf
    except ImportError:
        raise ValueError(
            f"mx.load cannot read {path} ({mlx_error}; it reads only "
            "F32/Q4_0/Q4_1/Q8_0 tensors reliably). Install the gguf package for the "
            "other types: pip install 'kvarn-mlx[gguf]'"
        ) from None
    try:
        return _read_with_gguf(gguf, path)
    except Exception as e:
        raise ValueError(f"could not read GGUF file {path}: {e} (mx.load: {mlx_error})") from e


def _read_with_gguf(gguf, path):
    reader = gguf.GGUFReader(str(path))
    metadata = {
        k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")
    }
    tensors = {
        t.name: mx.array(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        for t in reader.tensors
    }
    return tensors, metadata


def _metadata_getter(metadata, arch):
    def get(key, default=None):
        v = metadata.get(f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"GGUF metadata has no {arch}.{key}")
        return v

    return get


def _common_config(metadata, arch, tied):
    get = _metadata_getter(metadata, arch)
    hidden = get("embedding_length")
    n_heads = get("attention.head_count")
    tokens = metadata.get("tokenizer.ggml.tokens")
    config = {
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("attention.head_count_kv", n_heads),
        "head_dim": metadata.get(
            f"{arch}.attention.key_length",
            metadata.get(f"{arch}.rope.dimension_count", hidden // n_heads),
        ),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": get("context_length"),
        "vocab_size": get("vocab_size", len(tokens) if tokens else None),
        "tie_word_embeddings": tied,
    }
    for key in ("bos", "eos", "padding"):
        tid = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = tid
    return config


def llama_config(metadata, tied):
    """An HF/mlx-lm llama config.json dict from GGUF metadata."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUF files are supported here, got {arch!r}")
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"rope scaling {scaling!r} is not supported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_common_config(metadata, arch, tied),
        "rope_theta": _f32(metadata.get("llama.rope.freq_base", 10000.0)),
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
    }


def gemma3_config(metadata, tied):
    """An HF/mlx-lm gemma3_text config.json dict from GGUF metadata."""
    arch = metadata.get("general.architecture")
    if arch != "gemma3":
        raise ValueError(f"only gemma3 GGUF files are supported here, got {arch!r}")
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **_common_config(metadata, arch, tied),
        "rope_theta": _f32(metadata.get("gemma3.rope.freq_base", 1e6)),
        "sliding_window": _metadata_getter(metadata, arch)("attention.sliding_window"),
        # llama.cpp hard-codes these three for gemma3 instead of storing them:
        # local rope base 1e4, one global layer in six, and 1/sqrt(head_dim)
        # attention scale (hidden/heads for the 62-layer 27B).
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 6,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    if config["num_hidden_layers"] == 62:
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    else:
        config["query_pre_attn_scalar"] = config["head_dim"]
    scaling = metadata.get("gemma3.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": _f32(metadata["gemma3.rope.scaling.factor"]),
        }
    elif scaling not in ("none", None):
        raise ValueError(f"rope scaling {scaling!r} is not supported")
    # llama.cpp also ends generation at <end_of_turn>, found by its text.
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    eos = config.get("eos_token_id")
    if "<end_of_turn>" in tokens and eos is not None:
        config["eos_token_id"] = [eos, tokens.index("<end_of_turn>")]
    return config


def qwen2_config(metadata, tied):
    """An HF/mlx-lm qwen2 config.json dict from GGUF metadata."""
    arch = metadata.get("general.architecture")
    if arch != "qwen2":
        raise ValueError(f"only qwen2 GGUF files are supported here, got {arch!r}")
    scaling = metadata.get("qwen2.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"rope scaling {scaling!r} is not supported")
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **_common_config(metadata, arch, tied),
        "rope_theta": _f32(metadata.get("qwen2.rope.freq_base", 1e6)),
        "hidden_act": "silu",
    }
    # mlx-lm's qwen2 derives head_dim from hidden_size / heads.
    if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
        raise ValueError("qwen2 GGUF with head_dim != hidden_size / heads is not supported")
    # Qwen's instruct models end a turn with <|im_end|> (the GGUF's eos) and
    # a completion with <|endoftext|>; stop at either, as llama.cpp does.
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    eos = config.get("eos_token_id")
    if "<|endoftext|>" in tokens and eos is not None:
        end = tokens.index("<|endoftext|>")
        if end != eos:
            config["eos_token_id"] = [eos, end]
    return config


_CONFIGS = {"llama": llama_config, "gemma3": gemma3_config, "qwen2": qwen2_config}


def model_config(metadata, tied):
    """The mlx-lm config.json dict of a GGUF file, by its architecture."""
    arch = metadata.get("general.architecture")
    if arch not in _CONFIGS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_CONFIGS)})"
        )
    return _CONFIGS[arch](metadata, tied)


def _dequantize(tensors, name):
    w = tensors[f"{name}.weight"]
    if f"{name}.scales" not in tensors:
        return w
    scales, biases = tensors[f"{name}.scales"], tensors[f"{name}.biases"]
    # GGUF quant blocks are 32 wide; bits follow from the packed width.
    bits = w.shape[-1] // scales.shape[-1]
    return mx.dequantize(w, scales, biases, group_size=32, bits=bits)


def _unpermute(w, n_heads):
    """Undo llama.cpp's q/k row permutation (it interleaves each head's halves
    for its GPT-J style RoPE; mlx-lm llama uses the split-halves RoPE)."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _llama_tensor(part, w, config):
    if part == "attn_q":
        return _unpermute(w, config["num_attention_heads"])
    if part == "attn_k":
        return _unpermute(w, config["num_key_value_heads"])
    return w


def _gemma3_tensor(part, w, config):
    # llama.cpp stores gemma norms as 1 + w; mlx-lm's gemma RMSNorm scales
    # by 1 + w itself. Its gemma RoPE is the split-halves one: no permutation.
    if part.endswith("norm"):
        return w - 1
    return w


def _qwen2_tensor(part, w, config):
    # llama.cpp converts qwen2 q/k rows unpermuted (its NEOX RoPE is mlx-lm's
    # split-halves one): nothing to undo.
    return w


_TENSOR_FIXES = {"llama": _llama_tensor, "gemma3_text": _gemma3_tensor, "qwen2": _qwen2_tensor}


def model_weights(tensors, config, dtype=mx.float32):
    """Dequantized weights in mlx-lm naming, cast to `dtype`."""
    model_type = config["model_type"]
    layer_names, fix = _LAYER_NAMES[model_type], _TENSOR_FIXES[model_type]
    weights = {}
    # "<name>.bias" is a float bias (qwen2's q/k/v); "<name>.scales" and
    # "<name>.biases" belong to a quantized "<name>.weight".
    bases = {k.rsplit(".", 1)[0] for k in tensors}
    for base in sorted(bases):
        if base.startswith("blk."):
            _, layer, part = base.split(".", 2)
            if part not in layer_names:
                raise ValueError(f"unexpected GGUF tensor {base}")
            name = f"model.layers.{layer}.{layer_names[part]}"
        elif base in _GLOBAL_NAMES:
            part, name = base, _GLOBAL_NAMES[base]
        else:
            raise ValueError(f"unexpected GGUF tensor {base}")
        w = fix(part, _dequantize(tensors, base), config)
        weights[f"{name}.weight"] = w.astype(dtype)
        if f"{base}.bias" in tensors:
            weights[f"{name}.bias"] = tensors[f"{base}.bias"].astype(dtype)
    return weights


def _special_tokens(metadata, tokens):
    from tokenizers import AddedToken

    # Token type 3 is control (special), 4 is user-defined (added, not
    # special). Both are always matched whole in the text, never split.
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    return [
        AddedToken(tokens[i], special=(t == 3), normalized=False)
        for i, t in enumerate(types)
        if t in (3, 4)
    ]


_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_bpe(metadata):
    """llama.cpp "gpt2" vocabularies: byte-level BPE with merges."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # llama.cpp "smollm": each digit alone, then the GPT-2 regex. This is
        # HF SmolLM2's tokenizer.json: Sequence[Digits(individual), ByteLevel].
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre == "qwen2":
        # llama.cpp "qwen2": digits one by one, letters with one leading
        # non-letter, punctuation runs, then byte-level without its own regex.
        # This is HF Qwen2's tokenizer.json (with its NFC normalizer).
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in ("gpt2", "default"):
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def sentencepiece_merges(tokens, scores, types):
    """BPE merges equivalent to sentencepiece's BPE encoding: every split of a
    normal token into two vocabulary tokens, best token score first.
    Sentencepiece merges the adjacent pair whose concatenation scores highest;
    ranking each pair by the score of what it makes gives the same order."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty != 1:
            continue
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                ranked.append((-scores[i], i, k))
    ranked.sort()
    return [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]


def _sentencepiece_bpe(metadata):
    """llama.cpp "llama" vocabularies: sentencepiece BPE (tokens with scores,
    no merges), spaces written as U+2581, byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        # llama.cpp prepends the space to the first text fragment only, which
        # a tokenizers normalizer cannot express.
        raise ValueError("sentencepiece GGUF tokenizers with add_space_prefix are not supported")
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=sentencepiece_merges(tokens, metadata["tokenizer.ggml.scores"], types),
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


_TOKENIZERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def build_tokenizer(metadata):
    """A transformers fast tokenizer from GGUF tokenizer metadata."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind not in _TOKENIZERS:
        raise ValueError(
            f"GGUF tokenizer {kind!r} is not supported (supported: gpt2 byte-level "
            "BPE, llama sentencepiece BPE)"
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    tok = _TOKENIZERS[kind](metadata)
    tok.add_tokens(_special_tokens(metadata, tokens))

    def token(key):
        tid = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return None if tid is None else tokens[tid]

    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    if add_bos:
        bos = token("bos")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))],
        )
    arch = metadata.get("general.architecture")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
        add_bos_token=add_bos,
        clean_up_tokenization_spaces=False,
        model_max_length=metadata.get(f"{arch}.context_length", 8192),
    )


def convert(gguf_path, out_dir, dtype="float32"):
    """Write an mlx-lm loadable folder (config.json, model.safetensors,
    tokenizer files) for a llama, gemma3 or qwen2 GGUF file. `out_dir` must exist.
    Every weight is dequantized: on CPU, MLX's quantized matmul is far slower
    than float32 BLAS for prompts."""
    out_dir = Path(out_dir)
    tensors, metadata = read(gguf_path)
    config = model_config(metadata, tied="output.weight" not in tensors)
    config["torch_dtype"] = dtype
    weights = model_weights(tensors, config, getattr(mx, dtype))
    mx.eval(weights)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, {"format": "mlx"})
    with open(out_dir / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    build_tokenizer(metadata).save_pretrained(str(out_dir))
    # transformers 5 writes tokenizer_class "TokenizersBackend" and the chat
    # template only to chat_template.jinja; older versions know neither.
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["add_bos_token"] = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    if metadata.get("tokenizer.chat_template"):
        tc["chat_template"] = metadata["tokenizer.chat_template"]
    tc_path.write_text(json.dumps(tc, indent=2))
    return config
