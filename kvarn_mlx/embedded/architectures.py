"""What differs between the GGUF architectures we convert (llama, gemma3,
qwen2): the mlx-lm config.json built from GGUF metadata, the GGUF -> mlx-lm
tensor names, and the fix each architecture's tensors need (llama.cpp's
q/k row permutation, gemma's 1 + w norms)."""

import numpy as np

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
LAYER_NAMES = {
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
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _float32_decimal(v):
    """Shortest decimal of a float32 metadata value (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(v)))


def _required_metadata(metadata, arch):
    def get(key, default=None):
        v = metadata.get(f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"GGUF metadata has no {arch}.{key}")
        return v

    return get


def _common_config(metadata, arch, tied):
    get = _required_metadata(metadata, arch)
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
        "rms_norm_eps": _float32_decimal(get("attention.layer_norm_rms_epsilon")),
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
        "rope_theta": _float32_decimal(metadata.get("llama.rope.freq_base", 10000.0)),
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
        "rope_theta": _float32_decimal(metadata.get("gemma3.rope.freq_base", 1e6)),
        "sliding_window": _required_metadata(metadata, arch)("attention.sliding_window"),
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
            "factor": _float32_decimal(metadata["gemma3.rope.scaling.factor"]),
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
        "rope_theta": _float32_decimal(metadata.get("qwen2.rope.freq_base", 1e6)),
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


CONFIG_BUILDERS = {"llama": llama_config, "gemma3": gemma3_config, "qwen2": qwen2_config}


def model_config(metadata, tied):
    """The mlx-lm config.json dict of a GGUF file, by its architecture."""
    arch = metadata.get("general.architecture")
    if arch not in CONFIG_BUILDERS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(CONFIG_BUILDERS)})"
        )
    return CONFIG_BUILDERS[arch](metadata, tied)


def _unpermute(w, n_heads):
    """Undo llama.cpp's q/k row permutation (it interleaves each head's halves
    for its GPT-J style RoPE; mlx-lm llama uses the split-halves RoPE)."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _fix_llama_tensor(part, w, config):
    if part == "attn_q":
        return _unpermute(w, config["num_attention_heads"])
    if part == "attn_k":
        return _unpermute(w, config["num_key_value_heads"])
    return w


def _fix_gemma3_tensor(part, w, config):
    # llama.cpp stores gemma norms as 1 + w; mlx-lm's gemma RMSNorm scales
    # by 1 + w itself. Its gemma RoPE is the split-halves one: no permutation.
    if part.endswith("norm"):
        return w - 1
    return w


def _fix_qwen2_tensor(part, w, config):
    # llama.cpp converts qwen2 q/k rows unpermuted (its NEOX RoPE is mlx-lm's
    # split-halves one): nothing to undo.
    return w


# By mlx-lm model type, as LAYER_NAMES.
TENSOR_FIXES = {
    "llama": _fix_llama_tensor,
    "gemma3_text": _fix_gemma3_tensor,
    "qwen2": _fix_qwen2_tensor,
}
