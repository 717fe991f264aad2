"""The "auto" key rotation (issue 7): per kv head, rotated or plain keys,
decided once from the first quantized tiles and the queries of that step."""

import importlib
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from kvarn_mlx import KVarNCache, get_preset, make_cache, patch, rotation, unpatch, waiting_tiles
from kvarn_mlx.eval.runner import kl as kl_per_position
from kvarn_mlx.eval.runner import log_softmax
from models import tiny_model, tokens

BASE = get_preset("k2v2_g128", group_size=64, sink=64)
VARIANTS = {
    "kvarn": BASE,
    "plain_keys": replace(BASE, rotate_keys=False),
    "auto": replace(BASE, rotate_keys="auto"),
}


def outlier_model(kind, layers=2):
    """Tiny models whose keys carry strong per-channel structure on 3 channels."""
    if kind == "qwen3_knorm":  # large per-channel gains from k_norm
        mod = importlib.import_module("mlx_lm.models.qwen3")
        mx.random.seed(0)
        model = mod.Model(
            mod.ModelArgs.from_dict(
                dict(
                    model_type="qwen3",
                    hidden_size=128,
                    num_hidden_layers=2,
                    intermediate_size=256,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    head_dim=64,
                    rms_norm_eps=1e-6,
                    vocab_size=256,
                    tie_word_embeddings=True,
                    max_position_embeddings=4096,
                    rope_theta=10000,
                )
            )
        )
        for layer in model.layers:
            layer.self_attn.k_norm.weight = (
                mx.ones((64,)).at[mx.array([3, 17, 40])].add(mx.array([30.0, 20.0, 25.0]))
            )
        return model
    model = tiny_model("qwen2", num_hidden_layers=layers)  # per-channel offsets: k_proj bias
    for layer in model.layers:
        bias = (
            mx.zeros(layer.self_attn.k_proj.bias.shape)
            .at[mx.array([3, 17, 40])]
            .add(mx.array([40.0, -30.0, 25.0]))
        )
        layer.self_attn.k_proj.bias = bias
    return model


def logits(model, toks, cache, chunk=64):
    return mx.concatenate(
        [
            model(mx.array(toks[i : i + chunk])[None], cache=cache)[0]
            for i in range(0, len(toks), chunk)
        ]
    )


def mean_kl(model, toks, config, skip=64):
    """Teacher-forced KL(fp cache || KVarN cache) per position after the sink, and the cache."""
    ref = logits(model, toks, make_prompt_cache(model))
    cache = make_cache(model, config)
    out = logits(model, toks, cache)
    return float(kl_per_position(log_softmax(ref), log_softmax(out))[skip:].mean()), cache


def rotated_heads(cache):
    return [c.key_rotation_summary() for c in cache if isinstance(c, KVarNCache)]


@pytest.mark.parametrize("kind", ["qwen3_knorm", "qwen2_bias"])
def test_auto_drops_key_rotation_on_outlier_channels(kind):
    model, toks = outlier_model(kind), tokens(640)
    kl = {name: mean_kl(model, toks, cfg) for name, cfg in VARIANTS.items()}
    assert all(r == 0 for r, _ in rotated_heads(kl["auto"][1])), rotated_heads(kl["auto"][1])
    best = min(kl["kvarn"][0], kl["plain_keys"][0])
    assert kl["auto"][0] <= 1.10 * best, {k: v[0] for k, v in kl.items()}
    # The case exists: rotation really is the worse choice on these keys.
    assert kl["plain_keys"][0] < kl["kvarn"][0]


def test_auto_keeps_rotation_without_outlier_channels():
    model, toks = tiny_model("llama64"), tokens(640)
    kl = {name: mean_kl(model, toks, cfg) for name, cfg in VARIANTS.items()}
    summary = rotated_heads(kl["auto"][1])
    assert sum(r for r, _ in summary) >= 0.75 * sum(n for _, n in summary), summary
    assert kl["auto"][0] <= 1.10 * min(kl["kvarn"][0], kl["plain_keys"][0])


def test_long_first_chunk_decides_from_its_first_tiles_and_rows():
    # A 2,048-token first chunk would compare attention over all its rows and
    # tiles; the choice reads DECIDE_TILES tiles and DECIDE_ROWS rows, so a
    # decision for many tiles and rows is the one for those alone, whatever
    # the later tiles and rows hold. One long chunk still finds the outliers.
    cfg = get_preset("auto4v2")
    k = mx.random.normal((1, 2, 6, 128, 64), key=mx.random.key(0))
    q = mx.random.normal((1, 2, 3 * rotation.DECIDE_ROWS, 64), key=mx.random.key(1)) * 0.125
    head = rotation.candidates(k[:, :, : rotation.DECIDE_TILES], cfg, 0)
    noisy = mx.concatenate(
        [k[:, :, : rotation.DECIDE_TILES], 50 * k[:, :, rotation.DECIDE_TILES :]], axis=2
    )
    for keys in (k, noisy):
        cand = rotation.candidates(keys, cfg, 0)
        assert (
            rotation.decide(cand, cfg.k_bits, q)[0].tolist()
            == rotation.decide(head, cfg.k_bits, q)[0].tolist()
        )
    model, toks = outlier_model("qwen2_bias"), tokens(640)
    cache = make_cache(model, VARIANTS["auto"])
    logits(model, toks, cache, chunk=640)
    assert all(r == 0 for r, _ in rotated_heads(cache)), rotated_heads(cache)


def test_decision_survives_prompt_cache_files(tmp_path):
    model, toks = outlier_model("qwen2_bias"), tokens(400)
    cache = make_cache(model, VARIANTS["auto"])
    logits(model, toks, cache)
    path = str(tmp_path / "auto.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert rotated_heads(loaded) == rotated_heads(cache)
    nxt = mx.array(tokens(3, seed=1))[None]
    assert mx.allclose(model(nxt, cache=cache), model(nxt, cache=loaded), atol=1e-4).item()


def test_decision_without_queries_on_the_fallback_path():
    # Models that bypass the patched entry point never hand queries over: the
    # keys stand in, at the next update, and the cache still decides.
    model, toks = outlier_model("qwen2_bias"), tokens(400)
    unpatch()
    try:
        cache = make_cache(model, VARIANTS["auto"])
        unpatch()  # make_cache turned it on
        logits(model, toks, cache)
    finally:
        patch()
    assert all(s is not None for s in rotated_heads(cache))


@pytest.mark.parametrize("layers", [2, 8])
def test_a_long_step_after_a_decoded_first_tile(layers):
    # One token at a time until the first tile is complete (its layers commit it at their
    # next update: with 8 layers, two wait a turn, waiting_tiles.PER_STEP), then a step
    # longer than a tile. That step quantizes the waiting tile and the next one before any
    # query chose the key rotation: the one choice must cover both.
    model, toks = outlier_model("qwen2_bias", layers), tokens(300)
    S, G = BASE.sink_size, BASE.group_size
    # tokens decoded one at a time (layers waiting a turn: one more)
    n = S + G + (layers > waiting_tiles.PER_STEP)

    def long_step(config):
        cache = make_prompt_cache(model) if config is None else make_cache(model, config)
        model(mx.array(toks[:S])[None], cache=cache)
        for i in range(S, n):
            mx.eval(model(mx.array(toks[i : i + 1])[None], cache=cache))
        return log_softmax(model(mx.array(toks[n : n + G + 16])[None], cache=cache)[0])

    ref = long_step(None)
    kl = {
        name: kl_per_position(ref, long_step(cfg)).mean().item() for name, cfg in VARIANTS.items()
    }
    assert kl["auto"] <= 1.10 * min(kl["kvarn"], kl["plain_keys"]), kl
    assert kl["plain_keys"] < kl["kvarn"]  # the layers that chose plain keys matter


def test_auto_config_is_validated():
    with pytest.raises(ValueError, match="rotate_keys"):
        replace(BASE, rotate_keys="sometimes")
    assert get_preset("auto2").rotate_keys == "auto" and get_preset("auto4v2").k_bits == 4


@pytest.mark.e2e
def test_a_long_step_right_after_the_first_tile_attends_as_decoding(smollm):
    # SmolLM2 (30 layers, so commits spread over steps): one token at a time until the query
    # after the first tile (position 256), then 130 tokens in one step, as a follow-up prompt.
    import pydoc_data.topics

    model, tok = smollm
    text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tok.encode(text[:8000])[:400]
    assert len(ids) == 400

    def last_step(cache):
        model(mx.array(ids[:100])[None], cache=cache)
        for i in range(100, 257):
            mx.eval(model(mx.array(ids[i : i + 1])[None], cache=cache))
        return log_softmax(model(mx.array(ids[257:387])[None], cache=cache)[0])

    ref = last_step(make_prompt_cache(model))
    for preset in ("k4v2_g128", "auto4v2"):
        kl = kl_per_position(ref, last_step(make_cache(model, preset))).mean().item()
        assert kl < 0.05, (preset, kl)  # k4v2_g128: 0.011 on this text
