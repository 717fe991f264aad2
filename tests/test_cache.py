"""KVarNCache as an mlx-lm cache: memory held, make_cache, mlx_lm.generate,
prompt-cache files, deep copy, trim (incl. speculative decoding), bad input.

Models are the tiny random-weight ones of tests/models.py (float32).
"""

import copy
import gc
import logging
import weakref

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate, generate_step, speculative_generate_step, stream_generate
from mlx_lm.models.cache import (
    KVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

import kvarn_mlx
from kvarn_mlx import integration
from kvarn_mlx.attention import packed_attention
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import KVarNConfig, get_preset
from kvarn_mlx.integration import make_cache
from kvarn_mlx.memory import layer_bytes
from models import tiny_model, tokenizer, tokens

SCALES = ("k_a", "k_b", "k_t", "v_a", "v_b", "v_c")
WORDS = ("k_words", "v_words")


def rand_kv(B, H, L, D, dtype=mx.float16, seed=0):
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    return mx.random.normal((B, H, L, D), key=k1).astype(dtype), mx.random.normal(
        (B, H, L, D), key=k2
    ).astype(dtype)


def greedy(model, cache, prompt, n):
    """n greedy tokens and their logits, driving the model directly."""
    out, logits = [], []
    y = model(mx.array(prompt)[None], cache=cache)[:, -1]
    for _ in range(n):
        t = int(mx.argmax(y, axis=-1).item())
        out.append(t)
        logits.append(np.array(y[0]))
        y = model(mx.array([[t]]), cache=cache)[:, -1]
    return out, np.stack(logits)


# -- memory --------------------------------------------------------------------------

# Bars under the per-tile limits (docs/algorithm.md, "Storage and bytes per token":
# 4.05/5.36 at 4096 and 4.43/6.12 at 32768 tokens, head_dim 64, sink 128, 2-byte dtype).
# Held bytes include the tile storage's room (its capacity is a whole number of 4 tiles:
# 32 for the 31 tiles at 4096 tokens).
MEMORY_BARS = [
    (4096, "k4v2_g128", 3.9),
    (4096, "k2v2_g128", 5.2),
    (32768, "k4v2_g128", 4.35),
    (32768, "k2v2_g128", 6.0),
]
_memory = {}


def _fill_both(N, preset):
    """KVarNCache and mlx-lm's KVCache holding the same N float16 tokens of one layer
    (B=1, 3 kv heads, D=64), fed in 2048-token chunks as mlx-lm's prefill does."""
    if (N, preset) not in _memory:
        # iters=1: normalization iterations change values, not bytes, and 8 cost seconds at 32K.
        kvarn, plain = KVarNCache(get_preset(preset, iters=1)), KVCache()
        for i in range(0, N, 2048):
            k, v = rand_kv(1, 3, 2048, 64, seed=i)
            kvarn.update_and_fetch(k, v)
            plain.update_and_fetch(k, v)
            mx.eval(kvarn.held_arrays(), plain.keys, plain.values)
        _memory[(N, preset)] = (kvarn, plain)
    return _memory[(N, preset)]


@pytest.mark.parametrize("N, preset, bar", MEMORY_BARS)
def test_memory_ratio_of_used_bytes(N, preset, bar):
    kvarn, plain = _fill_both(N, preset)
    b = kvarn.nbytes_breakdown()
    # Like for like: KVCache grows in 256-token steps, so at these N it holds exactly N tokens.
    assert plain.nbytes == layer_bytes(kvarn)["fp16"] == 2 * 3 * N * 64 * 2
    assert b["total"] == kvarn.nbytes  # the breakdown adds up to what is held
    used = b["total"] - b["unused"]
    ratio_used, ratio_held = plain.nbytes / used, plain.nbytes / kvarn.nbytes
    print(f"{N} {preset}: held {ratio_held:.3f}x, used {ratio_used:.3f}x, {b}")
    assert ratio_used >= bar


@pytest.mark.parametrize("N, preset, bar", MEMORY_BARS)
def test_memory_ratio_of_held_bytes(N, preset, bar):
    # Everything the arrays hold, preallocated room included.
    kvarn, plain = _fill_both(N, preset)
    assert plain.nbytes / kvarn.nbytes >= bar


def _float_arrays(obj, prefix=""):
    """Every mx.array reachable from the cache's attributes: through tuples, lists,
    dicts, objects (the tile storage) and live weak references (the step's view)."""
    found = []
    if isinstance(obj, weakref.ref):
        obj = obj()
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (tuple, list)):
        items = enumerate(obj)
    else:
        items = vars(obj).items() if hasattr(obj, "__dict__") else ()
    for name, x in items:
        if isinstance(x, mx.array):
            found.append((f"{prefix}{name}", x))
        elif x is not None and not isinstance(x, (str, int, float, bool, KVarNConfig)):
            found += _float_arrays(x, f"{prefix}{name}.")
    return found


def test_no_float_copy_of_quantized_tokens_is_held():
    # After a prefill chunk and a decode step through the patched model path, the only
    # float arrays are the sink, the tail buffer and the scales; active memory agrees.
    model = tiny_model("llama64")
    cache = make_cache(model, KVarNConfig(k_bits=4, v_bits=2, group_size=64, sink=32))
    x = mx.array(tokens(32 + 5 * 64 + 11))[None]
    mx.eval(model(x[:, :-1], cache=cache))
    mx.eval(model(x[:, -1:], cache=cache))
    B, H, D, G = 1, 2, 64, 64
    for c in cache:
        arrays = dict(_float_arrays(c))
        cap_t = c.tail_k.shape[2]  # the tail buffer grows in small steps, never past G
        assert c.n_tail <= cap_t <= min(G, c.n_tail + c.tail_step)
        expect = {
            "sink_k": (B, H, 32, D),
            "sink_v": (B, H, 32, D),
            "tail_k": (B, H, cap_t, D),
            "tail_v": (B, H, cap_t, D),
        }
        cap = c.tiles.capacity  # tile-major storage
        expect.update(
            {
                "tiles.k_a": (cap, B, H, D),
                "tiles.k_b": (cap, B, H, D),
                "tiles.k_t": (cap, B, H, G),
                "tiles.v_a": (cap, B, H, G),
                "tiles.v_b": (cap, B, H, G),
                "tiles.v_c": (cap, B, H, D),
            }
        )
        floats = {n: x.shape for n, x in arrays.items() if mx.issubdtype(x.dtype, mx.floating)}
        assert floats == expect
        for n in SCALES:
            assert arrays["tiles." + n].dtype == mx.float16
        for n in WORDS:
            assert arrays["tiles." + n].dtype == mx.uint32
        assert set(arrays) == set(expect) | {"tiles." + n for n in WORDS}
        assert c.n_tiles == 5 and c.n_tail == 11


def test_active_memory_is_what_nbytes_says():
    # The step's full-precision chunk must not outlive the step (it did once: +3 MB here).
    cache = KVarNCache("k4v2_g128")
    k, v = rand_kv(1, 3, 4096, 64, seed=1)
    q = mx.random.normal((1, 9, 8, 64)).astype(mx.float16)
    mx.eval(k, v, q)
    gc.collect()
    before = mx.get_active_memory()
    cache.update_and_fetch(k, v)
    # Tiles quantized in this step are not in this step's output graph; evaluate the cache
    # state as mlx-lm's generate_step does after each prefill chunk.
    mx.eval(packed_attention(q, cache, 0.125, mask="causal"), cache.state)
    del k, v
    gc.collect()
    grown = mx.get_active_memory() - before + 2 * 3 * 4096 * 64 * 2  # k and v were freed
    assert grown <= cache.nbytes * 1.02 + 65536, (grown, cache.nbytes)


def test_fallback_path_holds_no_float_copy_between_steps():
    cache = KVarNCache("k4v2_g128")
    k, v = rand_kv(1, 3, 4096, 64, seed=2)
    mx.eval(k, v)
    gc.collect()
    before = mx.get_active_memory()
    K, V = cache.update_and_fetch(k, v)
    mx.eval(
        mx.fast.scaled_dot_product_attention(
            mx.zeros((1, 9, 1, 64), mx.float16), K, V, scale=0.125
        ),
        cache.state,
    )
    del k, v, K, V
    gc.collect()
    grown = mx.get_active_memory() - before + 2 * 3 * 4096 * 64 * 2
    assert grown <= cache.nbytes * 1.02 + 65536, (grown, cache.nbytes)


# -- make_cache ------------------------------------------------------------------------


def test_make_cache_replaces_plain_kvcache_layers():
    model = tiny_model("llama64")
    caches = make_cache(model, "k2v2_g128")
    assert len(caches) == 2 and all(type(c) is KVarNCache for c in caches)
    assert caches[0].config == get_preset("k2v2_g128")
    assert integration.is_patched()


def test_make_cache_leaves_sliding_window_layers_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(integration, "_warned", set())
    model = tiny_model("gemma3")
    with caplog.at_level(logging.WARNING, logger="kvarn_mlx"):
        caches = make_cache(model)
        make_cache(model)
    assert [type(c).__name__ for c in caches] == [
        "RotatingKVCache",
        "KVarNCache",
        "RotatingKVCache",
        "KVarNCache",
    ]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "RotatingKVCache" in warnings[0]
    # The sliding layers still work as they did: same window, same trimming rules.
    assert caches[0].max_size == 32
    x = mx.array(tokens(100))[None]
    logits = model(x, cache=caches)
    assert np.isfinite(np.array(logits)).all()
    assert caches[0].offset == caches[1].offset == 100


def test_make_cache_per_layer_list_fp16_and_overrides():
    model = tiny_model("qwen2")
    caches = make_cache(model, ["k2v2_g128", "fp16"])
    assert type(caches[0]) is KVarNCache and type(caches[1]) is KVCache
    caches = make_cache(model, [None, KVarNConfig(k_bits=4, v_bits=4, group_size=64)])
    assert type(caches[0]) is KVCache and caches[1].config.group_size == 64
    assert all(type(c) is KVCache for c in make_cache(model, "fp16"))
    caches = make_cache(model, "k4v2_g64", sink=0)
    assert caches[0].config.sink_size == 0 and caches[0].config.group_size == 64
    with pytest.raises(ValueError, match="2 cache layers"):
        make_cache(model, ["k2v2_g128"])


def test_make_cache_applies_overrides_to_configs_too():
    model = tiny_model("qwen2")
    cfg = KVarNConfig(k_bits=4, v_bits=4, group_size=64)
    caches = make_cache(model, cfg, sink=0, iters=3)
    assert all(
        c.config == KVarNConfig(k_bits=4, v_bits=4, group_size=64, sink=0, iters=3) for c in caches
    )
    caches = make_cache(model, [cfg, "k2v2_g128"], sink=16)
    assert [c.config.sink_size for c in caches] == [16, 16] and caches[1].config.k_bits == 2
    assert make_cache(model, cfg)[0].config == cfg  # no overrides: the config as given
    with pytest.raises((TypeError, ValueError), match="preset"):
        make_cache(model, 4)


def test_observe_sees_every_attention_call_of_any_cache():
    model = tiny_model("gemma3")  # sliding-window (RotatingKVCache) and KVarN layers
    caches = make_cache(model, "k4v2_g64")
    seen = []
    x = mx.array(tokens(80))[None]
    with integration.observe(
        lambda q, k, v, cache, out: seen.append((type(cache).__name__, q.shape, out.shape))
    ):
        model(x, cache=caches)
    model(x[:, :1], cache=caches)  # outside the block: not observed
    assert [name for name, _, _ in seen] == [type(c).__name__ for c in caches]
    assert all(q == o for _, q, o in seen)


def test_unknown_preset_lists_presets():
    model = tiny_model("llama64")
    for make in (lambda: make_cache(model, "k3v1_g128"), lambda: KVarNCache("nope")):
        with pytest.raises(ValueError) as e:
            make()
        for name in ("k2v2_g128", "k4v2_g128", "k4v4_g128", "k4v2_g64"):
            assert name in str(e.value)


# -- models: patched path == fallback path ------------------------------------------------


@pytest.mark.parametrize("name", ["llama64", "llama128", "gemma3", "qwen2"])
def test_model_logits_packed_equal_fallback(name):
    # Same tokens, chunks that split tiles: packed attention (patched) vs the model's own
    # mx.fast SDPA over update_and_fetch's dequantized K/V (unpatched). And the packed
    # path is really taken on every KVarN layer.
    model = tiny_model(name)
    x = mx.array(tokens(64 + 3 * 64 + 20, seed=1))[None]
    cuts = [0, 50, 51, 150, 151, 152, 250, x.shape[1]]

    def run():
        c = make_cache(model, "k4v2_g64")
        return [np.array(model(x[:, a:b], cache=c)) for a, b in zip(cuts, cuts[1:])]

    calls = []
    orig = integration.packed_attention
    try:
        integration.packed_attention = lambda *a, **k: calls.append(1) or orig(*a, **k)
        packed = run()
        integration.packed_attention = orig
        n_kvarn = sum(type(c) is KVarNCache for c in make_cache(model))
        assert len(calls) == n_kvarn * (len(cuts) - 1)
        kvarn_mlx.unpatch()
        fallback = run()
    finally:
        integration.packed_attention = orig
        kvarn_mlx.patch()
    for a, b in zip(packed, fallback):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-4)


# -- mlx_lm.generate ---------------------------------------------------------------------


def test_stream_generate_and_generate_with_prompt_cache():
    model, tok = tiny_model("llama64"), tokenizer()
    prompt = tokens(150, seed=2)
    cache = make_cache(model)
    responses = list(stream_generate(model, tok, prompt, max_tokens=12, prompt_cache=cache))
    streamed = [r.token for r in responses]
    assert len(streamed) == 12 and responses[-1].finish_reason == "length"
    assert all(c.offset == 150 + 12 for c in cache)  # generate_step feeds one token ahead
    # generate_step with a fresh KVarN cache gives the same tokens (deterministic).
    steps = [
        int(t)
        for t, _ in generate_step(
            mx.array(prompt), model, max_tokens=12, prompt_cache=make_cache(model)
        )
    ]
    assert steps == streamed
    text = generate(model, tok, prompt, max_tokens=12, prompt_cache=make_cache(model))
    assert text == tok.decode(streamed)
    # Continuing a used cache through stream_generate works too (multi-turn).
    more = [
        r.token
        for r in stream_generate(model, tok, tokens(7, seed=3), max_tokens=5, prompt_cache=cache)
    ]
    assert len(more) == 5 and cache[0].offset == 150 + 12 + 7 + 5


# -- prompt-cache files --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama64", "gemma3"])
def test_save_load_then_continue_is_identical(name, tmp_path):
    model = tiny_model(name)
    cache = make_cache(model, "k4v2_g64")
    mx.eval(model(mx.array(tokens(64 + 2 * 64 + 30, seed=4))[None], cache=cache))
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache, {"model": name})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"model": name}
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    for a, b in zip(cache, loaded):
        if isinstance(a, KVarNCache):
            assert b.config == a.config and (b.offset, b.n_tiles, b.n_tail) == (
                a.offset,
                a.n_tiles,
                a.n_tail,
            )
    # Continuing from the loaded cache == continuing the uninterrupted one (crosses a tile).
    t1, l1 = greedy(model, cache, [7], 50)
    t2, l2 = greedy(model, loaded, [7], 50)
    assert t1 == t2
    np.testing.assert_allclose(l1, l2, atol=1e-5, rtol=1e-5)


def test_state_round_trips_every_setting(tmp_path):
    cfg = KVarNConfig(
        k_bits=2,
        v_bits=4,
        group_size=64,
        sink=0,
        iters=3,
        scale_dtype="bfloat16",
        rotate_keys=False,
        rotate_values=True,
    )
    c = KVarNCache(cfg)
    k, v = rand_kv(1, 2, 150, 64, dtype=mx.float32)
    c.update_and_fetch(k, v)
    empty = KVarNCache("k2v2_g128")
    path = str(tmp_path / "s.safetensors")
    save_prompt_cache(path, [c, empty])
    a, e = load_prompt_cache(path)
    assert a.config == cfg and a.rotate_k is False and a.rotate_v is True
    assert a.tiles.k_a.dtype == mx.bfloat16
    assert e.empty() and e.config == get_preset("k2v2_g128")
    # Loaded with its own settings; both still work and agree.
    k2, v2 = rand_kv(1, 2, 1, 64, dtype=mx.float32, seed=5)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(6))
    outs = []
    for x in (c, a):
        x.update_and_fetch(k2, v2)
        outs.append(np.array(packed_attention(q, x, 0.125)))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-6)
    e.update_and_fetch(k2, v2)
    assert e.offset == 1


def _saved(tmp_path, model):
    cache = make_cache(model, "k2v2_g128")
    mx.eval(model(mx.array(tokens(128 + 128 + 9, seed=8))[None], cache=cache))
    path = str(tmp_path / "p.safetensors")
    save_prompt_cache(path, cache)
    return cache, path


@pytest.mark.parametrize(
    "damage", ["truncate", "n_tiles", "missing_array", "missing_setting", "bad_class"]
)
def test_damaged_prompt_cache_file_clear_error(damage, tmp_path):
    model = tiny_model("llama64")
    cache, path = _saved(tmp_path, model)
    if damage == "truncate":
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
        match = "corrupt|incomplete"
    else:
        arrays, meta = mx.load(path, return_metadata=True)
        if damage == "n_tiles":
            arrays["0.n_tiles"] = mx.array(5)  # claims tiles the file does not hold
            match = "corrupt KVarNCache state"
        elif damage == "missing_array":
            del arrays["0.k_words"]
            match = "corrupt KVarNCache state"
        elif damage == "missing_setting":
            # Renamed rather than deleted: mlx-lm's file format is positional.
            arrays["0.group_sizX"] = arrays.pop("0.group_size")
            meta = {k: ("0.group_sizX" if v == "0.group_size" else v) for k, v in meta.items()}
            match = "not a KVarNCache state"
        else:
            meta = {k: ("KVarNCacheV9" if v == "KVarNCache" else v) for k, v in meta.items()}
            match = "KVarNCacheV9"
        mx.save_safetensors(path, arrays, meta)
    with pytest.raises((ValueError, RuntimeError, KeyError), match=match):
        load_prompt_cache(path)
    # The cache in memory is untouched and keeps generating.
    t, _ = greedy(model, cache, [3], 3)
    assert len(t) == 3 and cache[0].offset == 128 + 128 + 9 + 4


def test_setting_a_bad_state_in_place_keeps_the_cache():
    # Setting state on a live cache (not what load_prompt_cache does) must not wreck it.
    c = KVarNCache("k2v2_g128")
    k, v = rand_kv(1, 2, 300, 64, dtype=mx.float32)
    c.update_and_fetch(k, v)
    before = [np.array(x) for x in c.dequantized()]
    bad = dict(c.state, n_tiles=5)
    with pytest.raises(ValueError, match="corrupt"):
        c.state = bad
    assert (c.offset, c.n_tiles, c.n_tail) == (300, 1, 44)
    for x, y in zip(before, c.dequantized()):
        np.testing.assert_array_equal(x, np.array(y))


def test_cache_from_another_model_gives_clear_error_and_stays_usable():
    # A loaded cache fed K/V of another head dim / kv-head count (a file from another model).
    c = KVarNCache("k2v2_g128")
    k, v = rand_kv(1, 2, 140, 64, dtype=mx.float32)
    c.update_and_fetch(k, v)
    for shape in ((1, 2, 1, 128), (1, 3, 1, 64)):
        with pytest.raises(ValueError, match="64|2"):
            c.update_and_fetch(mx.zeros(shape), mx.zeros(shape))
        assert c.offset == 140
    K, _ = c.update_and_fetch(*rand_kv(1, 2, 1, 64, dtype=mx.float32))
    assert K.shape[2] == c.offset == 141


# -- deep copy ------------------------------------------------------------------------------


def test_deepcopy_is_independent():
    model = tiny_model("llama64")
    cache = make_cache(model, "k4v2_g64")
    mx.eval(model(mx.array(tokens(64 + 64 + 40, seed=9))[None], cache=cache))
    twin = copy.deepcopy(cache)
    assert twin[0] is not cache[0] and twin[0].tail_k is not cache[0].tail_k
    other = copy.deepcopy(cache)
    greedy(model, other, tokens(90, seed=10), 5)  # diverge the copy, across a tile
    assert other[0].offset != cache[0].offset
    t1, l1 = greedy(model, cache, [1], 30)
    t2, l2 = greedy(model, twin, [1], 30)
    assert t1 == t2
    np.testing.assert_array_equal(l1, l2)


# -- trim --------------------------------------------------------------------------------


def _fed(T, preset=("k4v2_g64"), sink=None, seed=0):
    cfg = get_preset(preset) if sink is None else get_preset(preset, sink=sink)
    c = KVarNCache(cfg)
    k, v = rand_kv(1, 2, T, 64, dtype=mx.float32, seed=seed)
    for a in range(0, T, 70):
        c.update_and_fetch(k[:, :, a : a + 70], v[:, :, a : a + 70])
    return c, k, v


def _probe(c, k, v, seed=11):
    q = mx.random.normal((1, 6, k.shape[2], 64), key=mx.random.key(seed))
    c.update_and_fetch(k, v)
    return np.array(packed_attention(q, c, 0.125, mask="causal" if k.shape[2] > 1 else None))


def test_trim_inside_tail_is_exact():
    c, _, _ = _fed(64 + 2 * 64 + 10)  # tail holds 10 tokens (plus those added below)
    extra_k, extra_v = rand_kv(1, 2, 20, 64, dtype=mx.float32, seed=12)
    c.update_and_fetch(extra_k[:, :, :15], extra_v[:, :, :15])  # tail 25
    first = _probe(c, extra_k[:, :, 15:], extra_v[:, :, 15:])
    assert c.trim(5 + 15) == 20 and c.offset == 64 + 128 + 10 and c.n_tail == 10
    c.update_and_fetch(extra_k[:, :, :15], extra_v[:, :, :15])
    again = _probe(c, extra_k[:, :, 15:], extra_v[:, :, 15:])
    np.testing.assert_array_equal(first, again)


def test_trim_across_tiles_dequantizes_into_tail():
    # Documented approximation: the cut tile's kept tokens come back dequantized.
    c, k, v = _fed(64 + 3 * 64 + 5)
    assert c.trim(5 + 64 + 20) == 89
    assert (c.offset, c.n_tiles, c.n_tail) == (64 + 64 + 44, 1, 44)
    tail = np.array(c.tail_k[:, :, :44])
    want = np.array(k[:, :, 128:172])
    assert not np.array_equal(tail, want)
    assert np.linalg.norm(tail - want) / np.linalg.norm(want) < 0.15  # 4-bit keys
    K, _ = c.dequantized()
    assert K.shape[2] == 172
    # Usable: refilling the tile quantizes it again, and attention is finite.
    out = _probe(c, *rand_kv(1, 2, 30, 64, dtype=mx.float32, seed=13))
    assert c.n_tiles == 2 and np.isfinite(out).all()


def test_trim_into_sink_and_beyond_the_cache():
    c, k, v = _fed(64 + 64 + 7)
    assert c.trim(0) == 0 and c.trim(-3) == 0
    assert c.trim(64 + 7 + 20) == 91 and (c.offset, c.n_sink, c.n_tiles, c.n_tail) == (44, 44, 0, 0)
    assert c.trim(10_000) == 44 and c.offset == 0  # clamps, returns what was trimmed
    # Usable, and the same as a fresh cache fed the same tokens.
    fresh, _, _ = _fed(0)
    for x in (c, fresh):
        x.update_and_fetch(k[:, :, :100], v[:, :, :100])
    a = _probe(c, k[:, :, 100:103], v[:, :, 100:103])
    b = _probe(fresh, k[:, :, 100:103], v[:, :, 100:103])
    np.testing.assert_array_equal(a, b)


def test_protocol_bits():
    c = KVarNCache()
    assert c.empty() and c.is_trimmable() and c.nbytes == 0 and c.size() == 0
    # mlx-lm treats caches with `bits` as its QuantizedKVCache (quantized SDPA), and
    # to_quantized as convertible: neither applies.
    assert not hasattr(c, "bits") and not hasattr(c, "to_quantized")
    c.update_and_fetch(*rand_kv(1, 2, 10, 64))
    assert not c.empty() and c.size() == 10
    assert can_trim_prompt_cache([c]) and trim_prompt_cache([c], 4) == 4 and c.offset == 6
    assert c.make_mask(1) is None
    assert c.make_mask(5) == "causal"
    m = c.make_mask(5, return_array=True)
    assert m.shape == (5, 11) and np.array(m)[0].tolist() == [True] * 7 + [False] * 4
    w = np.array(c.make_mask(5, window_size=4))
    assert w.shape == (5, 11) and w[-1].tolist() == [False] * 7 + [True] * 4


# -- speculative decoding ----------------------------------------------------------------------


def test_trim_after_rejected_drafts_equals_never_drafting():
    # Each step verifies [token, 3 drafts] in one chunk, like speculative decoding, then
    # rejects the drafts by trimming. The drafts stay in the tail, so nothing is lost.
    model = tiny_model("llama64")
    prompt = tokens(128 + 40, seed=14)  # sink 128, tail 40 of a 128-token tile
    plain_tokens, plain_logits = greedy(model, make_cache(model), prompt, 12)

    cache = make_cache(model)
    y = model(mx.array(prompt)[None], cache=cache)[:, -1]
    got, logits = [], []
    for i in range(12):
        t = int(mx.argmax(y, axis=-1).item())
        got.append(t)
        logits.append(np.array(y[0]))
        drafts = tokens(3, seed=100 + i)
        out = model(mx.array([[t, *drafts]]), cache=cache)
        assert trim_prompt_cache(cache, 3) == 3
        y = out[:, 0]
    assert got == plain_tokens
    np.testing.assert_allclose(np.stack(logits), plain_logits, atol=1e-5, rtol=1e-5)


def test_mlx_lm_speculative_generate_step():
    # mlx-lm's own speculative decoding with KVarN caches for model and draft: the same
    # greedy tokens as plain decoding while everything it drafts stays in the tail.
    model, draft = tiny_model("llama64", seed=0), tiny_model("qwen2", seed=1)
    prompt = mx.array(tokens(128 + 8, seed=15))
    plain = [
        int(t)
        for t, _ in generate_step(prompt, model, max_tokens=40, prompt_cache=make_cache(model))
    ]
    cache = make_cache(model) + make_cache(draft)
    spec = list(
        speculative_generate_step(
            prompt, model, draft, num_draft_tokens=3, max_tokens=40, prompt_cache=cache
        )
    )
    assert [int(t) for t, _, _ in spec] == plain
    assert any(not d for _, _, d in spec[1:])  # some drafts were rejected, so trims happened
