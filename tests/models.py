"""Tiny random-weight mlx-lm models for tests (the cache's behaviour does not
depend on the weights), plus a minimal tokenizer for mlx_lm.generate.

Weights are float32 (fastest on CPU, and keeps model-level comparisons tight).
Random weights give near-uniform logits; `sharpen` scales the output head so
greedy decoding is not decided by float noise.
"""

import importlib

import mlx.core as mx
from mlx.utils import tree_map

VOCAB = 256

CONFIGS = {
    # llama-style, head_dim 64, GQA 3 (6 query heads over 2 kv heads)
    "llama64": dict(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    ),
    # llama-style, head_dim 128, MQA (4 query heads over 1 kv head)
    "llama128": dict(
        model_type="llama",
        hidden_size=256,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=128,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    ),
    # Gemma-3 text: head_dim 256; layers 0 and 2 sliding-window (RotatingKVCache), 1 and 3
    # global (KVCache)
    "gemma3": dict(
        model_type="gemma3_text",
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        sliding_window=32,
        sliding_window_pattern=2,
        query_pre_attn_scalar=256,
        max_position_embeddings=4096,
    ),
    # Qwen2: q/k/v projections with biases, head_dim 64 (128 / 2 heads), 1 kv head
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    ),
}


def tiny_model(name, seed=0, **overrides):
    """A float32 mlx-lm model with random weights for CONFIGS[name] (with overrides)."""
    cfg = {**CONFIGS[name], **overrides}
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    # Spread the weights a little so attention is not near-uniform and K/V have structure.
    model.update(tree_map(lambda w: w * 2.0 if w.ndim == 2 else w, model.parameters()))
    mx.eval(model.parameters())
    return model


def tokens(n, seed=0):
    return mx.random.randint(0, VOCAB, (n,), key=mx.random.key(seed)).tolist()


class ByteTokenizer:
    """Just enough of a Hugging Face tokenizer for mlx_lm's TokenizerWrapper and
    stream_generate: ids are bytes; no special tokens except an EOS that random
    models essentially never pick (id VOCAB - 1 is kept out of the prompts)."""

    eos_token_id = VOCAB - 1
    bos_token = None
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("latin-1"))

    def decode(self, ids, **kwargs):
        return bytes(int(i) % 256 for i in ids).decode("latin-1")

    def get_vocab(self):
        return {chr(i): i for i in range(VOCAB)}

    def apply_chat_template(self, messages, **kwargs):
        return "".join(m["content"] for m in messages)


def tokenizer():
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(ByteTokenizer())
