"""Tiny random-weight models of the architectures people run on Macs, built from
mlx-lm's own model classes (the cache sees what the real model would hand it:
head dims, kv heads, biases, q/k norms, sliding-window and recurrent layers).

Each family keeps its real model's attention shape where that is the point
(gemma3's head dim 256, phi3's 96, gpt-oss's sinks) and is otherwise as small
as mlx-lm allows: hidden 64-192, 2-4 layers, vocab 256 (tests/models.py's byte
tokenizer). Weights are float32, like tests/models.py.
"""

import functools
import importlib

import mlx.core as mx
from mlx.utils import tree_map

from models import VOCAB

_COMMON = dict(vocab_size=VOCAB, max_position_embeddings=4096)

FAMILIES = {
    # Llama 3: GQA 2, head dim 64.
    "llama": dict(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # Mistral 3 (Ministral 3): mlx-lm's mistral3 wrapper around the ministral3 text model.
    "mistral3": dict(
        model_type="mistral3",
        text_config=dict(
            model_type="ministral3",
            hidden_size=128,
            num_hidden_layers=2,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=128,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=1e6,
                llama_4_scaling_beta=0.1,
                original_max_position_embeddings=4096,
            ),
            **_COMMON,
        ),
    ),
    # Qwen2: q/k/v projections with biases (large per-channel key offsets), head dim 64.
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # Qwen3: RMS norms on q and k per head, head dim 128 (wider than hidden / heads).
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    # Qwen3 MoE: q/k norms and switch-MLP experts.
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        rope_theta=1e6,
        tie_word_embeddings=True,
        norm_topk_prob=True,
    ),
    # Gemma 3 text: head dim 256, 1 kv head; layers 0, 2 sliding-window, 1, 3 global.
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        rms_norm_eps=1e-6,
        sliding_window=32,
        sliding_window_pattern=2,
        query_pre_attn_scalar=256,
    ),
    # Phi-3: fused qkv projection, head dim 96 (192 / 2 heads).
    "phi3": dict(
        model_type="phi3",
        hidden_size=192,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
    ),
    # gpt-oss: learned attention sinks, alternating sliding-window / full layers, MoE.
    "gpt_oss": dict(
        model_type="gpt_oss",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=32,
        rms_norm_eps=1e-5,
    ),
    # Qwen3-Next: three gated-delta (linear-attention, ArraysCache) layers per full-attention layer.
    "qwen3_next": dict(
        model_type="qwen3_next",
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        rms_norm_eps=1e-6,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        rope_theta=1e6,
        partial_rotary_factor=0.25,
        full_attention_interval=4,
    ),
    # Falcon-H1: every layer runs Mamba-2 and attention side by side
    # (CacheList(ArraysCache, KVCache)).
    "falcon_h1": dict(
        model_type="falcon_h1",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        mamba_d_ssm=128,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=32,
        mamba_n_groups=1,
        mamba_expand=1,
    ),
    # LFM2: short-convolution layers (ArraysCache) with full-attention layers 1 and 3.
    "lfm2": dict(
        model_type="lfm2",
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=128,
        block_multiple_of=64,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        block_ff_dim=256,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
    ),
    # Nemotron-H: Mamba-2 layers (ArraysCache), an attention layer, an MLP layer (no cache).
    "nemotron_h": dict(
        model_type="nemotron_h",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        attention_bias=False,
        mamba_num_heads=8,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=16,
        conv_kernel=4,
        n_groups=1,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        hybrid_override_pattern=["M", "*", "M", "-"],
    ),
    # PLaMo 2: Mamba layers and attention layers that call mx.fast.scaled_dot_product_attention
    # themselves, so KVarN can only serve them dequantized keys and values.
    "plamo2": dict(
        model_type="plamo2",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_size_per_head=64,
        mamba_d_state=16,
        mamba_num_heads=4,
        mamba_step=2,
        mamba_chunk_size=32,
        rms_norm_eps=1e-6,
    ),
}


def _llama(head_dim):
    return dict(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )


_MLA = dict(
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=64,
    q_lora_rank=None,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=None,
)

# Attention shapes KVarN must not raise on (tests/test_architectures.py, "shapes").
SHAPES = {
    # Head dims: 40 and 72 are not multiples of 16 (2-bit codes pack 16 to a uint32 word);
    # 72 and 120 have no Hadamard transform in MLX.
    **{f"llama_d{d}": _llama(d) for d in (40, 72, 120)},
    # Multi-head latent attention caching K and V of different head dims
    # (K = nope 64 + rope 32, V 64).
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        rope_scaling=dict(
            type="yarn", factor=1.0, mscale_all_dim=0, original_max_position_embeddings=4096
        ),
        **_MLA,
    ),
    "minicpm3": dict(
        model_type="minicpm3",
        hidden_size=128,
        dim_model_base=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=64,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        kv_lora_rank=64,
        scale_depth=1.4,
        scale_emb=12,
        rms_norm_eps=1e-6,
        rope_scaling=dict(original_max_position_embeddings=4096),
    ),
    # Multi-head latent attention caching the latent (as "keys", 64) and the rope key
    # (as "values", 32): the model attends over K/V it derives from them, not over the cache's
    # arrays.
    "deepseek_v3": dict(model_type="deepseek_v3", **_MLA),
}

for _cfg in (*FAMILIES.values(), *SHAPES.values()):
    if "text_config" not in _cfg:
        for _k, _v in _COMMON.items():
            _cfg.setdefault(_k, _v)


@functools.cache
def tiny_model(family, dtype=mx.float32, seed=0):
    """An mlx-lm model of FAMILIES[family] (or SHAPES[family]) with random weights
    (cached: tests only read it)."""
    cfg = FAMILIES.get(family) or SHAPES[family]
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    # Spread the weights a little so attention is not near-uniform and K/V have structure.
    model.update(tree_map(lambda w: w * 2.0 if w.ndim >= 2 else w, model.parameters()))
    if family == "gpt_oss":  # zero-initialized sinks would hide a sink that is ignored
        for layer in model.model.layers:
            layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model
