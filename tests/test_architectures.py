"""KVarN on the architectures people run on Macs (tests/archmodels.py: tiny
random-weight models built from mlx-lm's own classes), and the shapes that must
not raise.

Per family: make_cache replaces exactly the full-attention KVCache layers;
mlx_lm.generate runs with attention packed (or the dequantizing fallback
announced) and packed attention equals mlx-lm's attention over the same
dequantized cache; the cache holds fewer bytes than the plain one; at 8 bits,
greedy tokens equal the plain cache's. `pytest -s` prints each family's numbers.
"""

import logging
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate, generate_step
from mlx_lm.models import base
from mlx_lm.models.cache import CacheList, KVCache, make_prompt_cache

import kvarn_mlx
from archmodels import FAMILIES, tiny_model
from kvarn_mlx import KVarNCache
from models import tokenizer, tokens

SINK = 16  # small, so that a short prompt reaches the quantized tiles
PROMPT = SINK + 128 + 110  # one tile at prefill, the next one filled while decoding
STEPS = 32

# MoE layers run float32 only on the CPU (mlx's GatherMM).
MOE = {"qwen3_moe", "gpt_oss", "qwen3_next"}
# Families whose attention does not go through mlx-lm's patched entry point.
BYPASSES_PATCH = {"plamo2"}


def layer_caches(caches):
    """(layer, cache) for every cache of the list, CacheList members included."""
    for i, c in enumerate(caches):
        for member in c.caches if isinstance(c, CacheList) else (c,):
            yield i, member


def kvarn_layers(caches):
    return [c for _, c in layer_caches(caches) if isinstance(c, KVarNCache)]


def make(model, preset="k4v4_g128"):
    return kvarn_mlx.make_cache(model, preset, sink=SINK)


@pytest.fixture
def packed_calls(monkeypatch):
    """(cache, error) for every call that mlx-lm's patched attention entry point routes to
    packed attention (a spy on the function it calls); error is the largest difference
    from mx.fast's attention over the cache's dequantized K/V, relative to its largest value."""
    kvarn_mlx.patch()
    module = sys.modules[base.scaled_dot_product_attention.__module__]
    real, calls = module.packed_attention, []

    def spy(queries, cache, scale, mask=None, sinks=None):
        keys, values = cache.dequantized()
        want = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )
        got = real(queries, cache, scale, mask, sinks)
        calls.append((cache, (mx.abs(got - want).max() / mx.abs(want).max()).item()))
        return got

    monkeypatch.setattr(module, "packed_attention", spy)
    return calls


@pytest.fixture
def log_lines(monkeypatch, caplog):
    """kvarn_mlx's log lines from here on, with its warn-once memory cleared."""
    for name, module in list(sys.modules.items()):
        if name.startswith("kvarn_mlx") and isinstance(getattr(module, "_warned", None), set):
            monkeypatch.setattr(module, "_warned", set())
    caplog.set_level(logging.WARNING, logger="kvarn_mlx")
    return lambda: [r.getMessage() for r in caplog.records if r.name.startswith("kvarn_mlx")]


# -- make_cache --------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_make_cache_replaces_exactly_the_full_attention_layers(family):
    model = tiny_model(family)
    plain = list(layer_caches(make_prompt_cache(model)))
    kvarn = list(layer_caches(make(model)))
    assert [i for i, _ in kvarn] == [i for i, _ in plain]
    for (i, p), (_, k) in zip(plain, kvarn):
        # Full attention (a plain KVCache) is quantized; sliding-window and recurrent state
        # stay as they are.
        assert type(k) is (KVarNCache if type(p) is KVCache else type(p)), (i, type(p), type(k))
    n = len(kvarn_layers([k for _, k in kvarn]))
    print(
        f"{family}: {n} of {len(make_prompt_cache(model))} layers KVarN "
        f"({', '.join(sorted({type(p).__name__ for _, p in plain}))} in the plain cache)"
    )
    assert n > 0


# -- mlx_lm.generate ------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_runs_packed_or_announces_the_fallback(family, packed_calls, log_lines):
    model = tiny_model(family)
    cache = make(model)
    layers = kvarn_layers(cache)
    assert layers
    # Random weights may pick the byte tokenizer's EOS: at least one token, not always 8.
    assert generate(model, tokenizer(), tokens(PROMPT, seed=1), max_tokens=8, prompt_cache=cache)
    offsets = {c.offset for c in layers}
    assert len(offsets) == 1 and offsets.pop() > PROMPT and all(c.n_tiles == 1 for c in layers)
    if family in BYPASSES_PATCH:
        assert not packed_calls
        assert sum("dequantiz" in m for m in log_lines()) == 1, log_lines()
        generate(model, tokenizer(), tokens(PROMPT, seed=2), max_tokens=2, prompt_cache=make(model))
        assert sum("dequantiz" in m for m in log_lines()) == 1, log_lines()  # once, not per step
    else:
        # Every forward pass went packed on every KVarN layer, and on nothing else.
        assert {id(c) for c, _ in packed_calls} == {id(c) for c in layers}
        per_layer = [sum(c is layer for c, _ in packed_calls) for layer in layers]
        assert len(set(per_layer)) == 1 and per_layer[0] >= 2, per_layer


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in BYPASSES_PATCH])
def test_packed_attention_equals_mlx_lm_attention_over_the_dequantized_cache(family, packed_calls):
    # At every call: packed attention against mlx-lm's own attention (mx.fast) over the same
    # cache's dequantized keys and values, through prefill chunks and decode steps that fill
    # and cross the second tile (comparing whole models instead would compare different
    # tiles: a float-noise change in one layer flips rounding in the next layer's codes).
    model = tiny_model(family)
    x = mx.array(tokens(SINK + 2 * 128 + 20, seed=5))[None]
    cuts = [0, 150, 151, SINK + 2 * 128 - 1, SINK + 2 * 128, SINK + 2 * 128 + 1, x.shape[1]]
    cache = make(model)
    for a, b in zip(cuts, cuts[1:]):
        mx.eval(model(x[:, a:b], cache=cache))
    layers = kvarn_layers(cache)
    assert layers and all(c.n_tiles == 2 for c in layers)
    assert len(packed_calls) == len(layers) * (len(cuts) - 1)
    errors = [err for _, err in packed_calls]
    print(f"{family}: packed vs mlx-lm attention, max relative difference {max(errors):.1e}")
    assert max(errors) < 1e-4


# -- memory --------------------------------------------------------------------------------

# The bytes are the cache's, whatever the family; the families run by default cover each
# kind of layer list: full attention (qwen2), sliding windows beside it (gpt_oss), recurrent
# layers beside it (qwen3_next), a CacheList (falcon_h1), attention mlx-lm's entry point does
# not see (plamo2). The others: -m slow (every family is in this file's other tests).
MEMORY_FAMILIES = {"qwen2", "gpt_oss", "qwen3_next", "falcon_h1", "plamo2"}


@pytest.mark.parametrize(
    "family",
    [f if f in MEMORY_FAMILIES else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES],
)
def test_memory_drops(family):
    # After a 600-token prompt, a float16 model (what people run; float32 for MoE on the CPU):
    # the KVarN layers against the plain cache's same layers, from the arrays each holds.
    dtype = mx.float32 if family in MOE else mx.float16
    model = tiny_model(family, dtype)
    N = 600
    x = mx.array(tokens(N, seed=3))[None]
    kvarn, plain = make(model), make_prompt_cache(model)
    mx.eval(model(x, cache=kvarn), model(x, cache=plain))
    pairs = [
        (k, p)
        for (_, k), (_, p) in zip(layer_caches(kvarn), layer_caches(plain))
        if isinstance(k, KVarNCache)
    ]
    assert pairs and all(k.n_tiles == (N - SINK) // 128 for k, _ in pairs)
    held = sum(k.nbytes for k, _ in pairs)
    plain_held = sum(p.nbytes for _, p in pairs)  # KVCache holds room for 256-token steps
    plain_used = sum(p.keys[..., :N, :].nbytes + p.values[..., :N, :].nbytes for _, p in pairs)
    print(
        f"{family} ({dtype}): {held} bytes held by KVarN k4v4 vs {plain_used} in the plain cache's "
        f"{N} tokens ({plain_used / held:.2f}x; {plain_held / held:.2f}x of what the plain cache "
        "holds)"
    )
    # At 4 bits the tiles take about a quarter of their float16 bytes; sink and tail stay float16.
    assert plain_used / held > 1.8


# -- greedy decoding -------------------------------------------------------------------------


def greedy(model, cache, prompt):
    """STEPS (greedy token, log-probabilities) through mlx-lm's generate loop."""
    return [
        (int(t), p)
        for t, p in generate_step(mx.array(prompt), model, max_tokens=STEPS, prompt_cache=cache)
    ]


# Random weights leave near-tied logits. 8-bit tiles move the logits by up to ~1e-2 of their
# range on these models; a tie closer than this (a fraction of the range) may go either way.
NEAR_TIE = 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_the_plain_cache_at_8_bits(family):
    # Not at 4 bits: random weights leave near-tied logits that 4-bit tiles flip within a
    # few steps (test_packed_attention_equals_the_dequantized_fallback checks those tiles).
    model = tiny_model(family)
    prompt = tokens(PROMPT, seed=4)
    cache = make(model, "k8v8_g128")
    got = [t for t, _ in greedy(model, cache, prompt)]
    plain = greedy(model, make_prompt_cache(model), prompt)
    want = [t for t, _ in plain]
    layers = kvarn_layers(cache)
    assert layers and all(
        c.n_tiles == 2 for c in layers
    )  # the second tile was quantized mid-decode
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is None:
        print(f"{family} k8v8: {STEPS} tokens equal to the plain cache's")
        return
    # Equal up to a step where the plain cache's two best tokens are a near-tie, and there its
    # runner-up.
    logprobs = plain[first][1]
    best, second = mx.argsort(-logprobs)[:2].tolist()
    gap = ((logprobs[best] - logprobs[second]) / (logprobs.max() - logprobs.min())).item()
    print(
        f"{family} k8v8: equal to the plain cache's tokens up to step {first}, a near-tie there "
        f"(top two {gap:.1e} of the logit range apart)"
    )
    assert got[first] == second and gap < NEAR_TIE, (first, got[first], best, second, gap)


# -- shapes that must not raise -----------------------------------------------------------------


def prefill_logits(model, cache, prompt):
    return model(mx.array(prompt)[None], cache=cache)[0, -1]


def assert_prefill_matches_plain(model, cache, prompt):
    # A prefill attends to its own tokens in full precision: any difference is a wrong attention.
    got, want = (
        prefill_logits(model, cache, prompt),
        prefill_logits(model, make_prompt_cache(model), prompt),
    )
    assert (mx.abs(got - want).max() / mx.abs(want).max()).item() < 1e-4


@pytest.mark.parametrize(
    "name, preset, quantized, lines",
    [
        # Value codes pack along the head dim: D * v_bits must fill whole uint32 words, else the
        # layer stays plain.
        ("llama_d40", "k2v2_g128", False, 1),
        ("llama_d72", "k4v2_g128", False, 1),
        ("llama_d120", "k2v2_g128", False, 1),
        (
            "llama_d40",
            "k2v4_g128",
            True,
            0,
        ),  # key codes pack along the tile's tokens: 2-bit keys fit any head dim
        (
            "llama_d72",
            "k4v4_g128",
            True,
            1,
        ),  # no Hadamard transform of size 72: runs unrotated, says so once
        ("llama_d120", "k4v4_g128", True, 1),
        (
            "llama_d40",
            "k4v4_g128",
            True,
            0,
        ),  # 40 = 20 * 2 rotates, and 4-bit codes pack 8 to a word
    ],
)
def test_head_dim_the_rotation_or_packing_cannot_take_falls_back_with_one_log_line(
    name, preset, quantized, lines, packed_calls, log_lines
):
    model = tiny_model(name)
    D = model.args.head_dim
    assert_prefill_matches_plain(
        model, kvarn_mlx.make_cache(model, preset, sink=SINK), tokens(PROMPT, seed=1)
    )
    for seed in (1, 2):
        cache = kvarn_mlx.make_cache(model, preset, sink=SINK)
        assert generate(
            model, tokenizer(), tokens(PROMPT, seed=seed), max_tokens=4, prompt_cache=cache
        )
        assert all(type(c) is (KVarNCache if quantized else KVCache) for c in cache)
    assert all(err < 1e-4 for _, err in packed_calls)
    assert bool(packed_calls) == quantized
    assert sum(f"head dim {D}" in m for m in log_lines()) == lines, log_lines()
    assert len(log_lines()) == lines, log_lines()


def test_a_kvarn_cache_made_by_hand_names_the_shape_it_cannot_hold():
    c = KVarNCache("k4v2_g128")
    with pytest.raises(
        ValueError, match=r"value head dim 40 .* 2 bits.*make_cache leaves such layers plain"
    ):
        c.update_and_fetch(mx.zeros((1, 1, 4, 40)), mx.zeros((1, 1, 4, 40)))
    with pytest.raises(ValueError, match=r"different head dims \(96 and 64\)"):
        c.update_and_fetch(mx.zeros((1, 1, 4, 96)), mx.zeros((1, 1, 4, 64)))
    assert c.empty()  # nothing was stored


@pytest.mark.parametrize("name", ["deepseek_v2", "minicpm3"])
def test_keys_and_values_of_different_head_dims(name, packed_calls, log_lines):
    model = tiny_model(name)
    assert_prefill_matches_plain(model, make(model), tokens(PROMPT, seed=1))
    cache = make(model)
    assert generate(model, tokenizer(), tokens(PROMPT, seed=1), max_tokens=4, prompt_cache=cache)
    if packed_calls:  # quantized: packed attention on every KVarN layer, right
        assert {id(c) for c, _ in packed_calls} == {id(c) for c in kvarn_layers(cache)}
        assert all(err < 1e-4 for _, err in packed_calls)
    else:  # left plain, said once
        assert not kvarn_layers(cache)
        assert len(log_lines()) == 1 and "different head dims" in log_lines()[0], log_lines()


def test_latent_attention_is_not_sent_to_packed_attention(packed_calls, log_lines):
    model = tiny_model("deepseek_v3")
    assert_prefill_matches_plain(model, make(model), tokens(PROMPT, seed=1))
    assert generate(
        model, tokenizer(), tokens(PROMPT, seed=1), max_tokens=4, prompt_cache=make(model)
    )
    assert not packed_calls
    assert len(log_lines()) == 1, (
        log_lines()
    )  # the latent and the rope key have different head dims: plain


def test_attention_on_arrays_the_cache_did_not_return_is_mlx_lm_attention_and_said_once(
    packed_calls, log_lines
):
    # What a latent-attention model does at every step when its two cached arrays share a head dim:
    # it attends on keys and values it derived from those update_and_fetch returned.
    c = KVarNCache(kvarn_mlx.get_preset("k4v4_g128", sink=4))
    c.announce_bypass = True  # as make_cache sets it
    q = mx.random.normal((1, 2, 1, 64), key=mx.random.key(0))
    for step in range(3):
        x = mx.random.normal((1, 1, 140 if step == 0 else 1, 64), key=mx.random.key(step + 1))
        k, v = c.update_and_fetch(x, x * 0.5)
        derived = k * 2.0
        got = base.scaled_dot_product_attention(q, derived, v, cache=c, scale=0.125, mask=None)
        want = mx.fast.scaled_dot_product_attention(q, derived, v, scale=0.125, mask=None)
        assert mx.array_equal(got, want)
    assert not packed_calls
    assert sum("dequantiz" in m for m in log_lines()) == 1, log_lines()
    # The arrays it returned go to packed attention.
    k, v = c.update_and_fetch(x, x)
    base.scaled_dot_product_attention(q, k, v, cache=c, scale=0.125, mask=None)
    assert [cache for cache, _ in packed_calls] == [c]


def test_only_caches_from_make_cache_announce_attention_that_bypasses_them(log_lines):
    c = KVarNCache(
        "k4v4_g128"
    )  # byte accounting and the planner feed caches that nothing attends on
    for _ in range(3):
        c.update_and_fetch(mx.zeros((1, 1, 8, 64)), mx.zeros((1, 1, 8, 64)))
    assert not log_lines()


def test_make_cache_reads_head_dims_without_an_observed_attention_call():
    model = tiny_model("llama")
    seen = []
    with kvarn_mlx.integration.observe(lambda *a: seen.append(a)):
        cache = make(model)
    assert not seen and kvarn_layers(cache) and all(c.empty() for c in kvarn_layers(cache))


def test_a_cache_list_with_a_kvarn_member_saves_and_loads(tmp_path):
    # Falcon-H1: CacheList(ArraysCache, KVarNCache) per layer, through mlx-lm's prompt-cache files.
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = tiny_model("falcon_h1")
    cache = make(model)
    mx.eval(model(mx.array(tokens(PROMPT, seed=6))[None], cache=cache))
    save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert [type(m) for _, m in layer_caches(loaded)] == [type(m) for _, m in layer_caches(cache)]
    assert kvarn_layers(loaded) and all(c.n_tiles == 1 for c in kvarn_layers(loaded))
    step = mx.array([[7]])
    assert mx.array_equal(model(step, cache=loaded), model(step, cache=cache))
