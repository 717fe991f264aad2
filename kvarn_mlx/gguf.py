"""Convert a llama-architecture GGUF file into an MLX model folder.

`mx.load` reads GGUF directly: Q4_0, Q4_1 and Q8_0 tensors come back as MLX
affine group-32 (weight, scales, biases) triples, so dequantizing them with
`mx.dequantize` is exact. K-quants and Q5_0 are not readable by `mx.load`.

The tokenizer is rebuilt from the GGUF metadata with the `tokenizers` library
(transformers' own GGUF tokenizer path imports torch).
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

# Bump when the conversion output changes, so cached folders are redone.
CONVERTER_VERSION = 1

# GGUF tensor name -> mlx-lm llama parameter name (per layer).
_LAYER_NAMES = {
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
    """Return (tensors, metadata) of a GGUF file, metadata as Python values."""
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise ValueError(
            f"could not read GGUF file {path}: {e} (mx.load reads only "
            "F32/F16/Q4_0/Q4_1/Q8_0 tensors)"
        ) from e
    return tensors, {k: _value(v) for k, v in metadata.items()}


def llama_config(metadata, tied):
    """An HF/mlx-lm llama config.json dict from GGUF metadata."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUF files are supported, got {arch!r}")

    def get(key, default=None):
        v = metadata.get(f"llama.{key}", default)
        if v is None:
            raise ValueError(f"GGUF metadata has no llama.{key}")
        return v

    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"rope scaling {scaling!r} is not supported")

    hidden = get("embedding_length")
    n_heads = get("attention.head_count")
    head_dim = metadata.get(
        "llama.attention.key_length",
        metadata.get("llama.rope.dimension_count", hidden // n_heads),
    )
    tokens = metadata.get("tokenizer.ggml.tokens")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length"),
        "vocab_size": get("vocab_size", len(tokens) if tokens else None),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
    }
    for key in ("bos", "eos", "padding"):
        tid = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = tid
    return config


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


def llama_weights(tensors, config, dtype=mx.float32):
    """Dequantized, renamed, un-permuted weights in mlx-lm llama naming."""
    weights = {}
    bases = {k.rsplit(".", 1)[0] for k in tensors}
    for base in sorted(bases):
        if base.startswith("blk."):
            _, layer, part = base.split(".", 2)
            if part not in _LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {base}")
            name = f"model.layers.{layer}.{_LAYER_NAMES[part]}"
        elif base in _GLOBAL_NAMES:
            part, name = base, _GLOBAL_NAMES[base]
        else:
            raise ValueError(f"unexpected GGUF tensor {base}")
        w = _dequantize(tensors, base)
        if part == "attn_q":
            w = _unpermute(w, config["num_attention_heads"])
        elif part == "attn_k":
            w = _unpermute(w, config["num_key_value_heads"])
        weights[f"{name}.weight"] = w.astype(dtype)
    return weights


def build_tokenizer(metadata):
    """A transformers fast tokenizer from GGUF gpt2-style BPE metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only gpt2 (byte-level BPE) GGUF tokenizers are supported, got {kind!r}")
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)

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
    elif pre in ("gpt2", "default"):
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    # Token type 3 is control (special), 4 is user-defined (added, not special).
    added = [
        AddedToken(tokens[i], special=(t == 3), normalized=False)
        for i, t in enumerate(types)
        if t in (3, 4)
    ]
    tok.add_tokens(added)

    def token(key):
        tid = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return None if tid is None else tokens[tid]

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        clean_up_tokenization_spaces=False,
        model_max_length=metadata.get("llama.context_length", 8192),
    )


def convert(gguf_path, out_dir, dtype="float32"):
    """Write an mlx-lm loadable folder (config.json, model.safetensors,
    tokenizer files) for a llama GGUF file. `out_dir` must exist."""
    out_dir = Path(out_dir)
    tensors, metadata = read(gguf_path)
    config = llama_config(metadata, tied="output.weight" not in tensors)
    config["torch_dtype"] = dtype
    weights = llama_weights(tensors, config, getattr(mx, dtype))
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
