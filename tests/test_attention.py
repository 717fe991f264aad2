"""Packed attention over a KVarNCache against the numpy oracle (reference.attention)
and against mx.fast.scaled_dot_product_attention over the cache's dequantized K/V.

Tolerance: outputs are O(1); packed attention runs in float32 (quantized_matmul,
float32 softmax) and the oracle in float64 over the same stored codes and float16
scales, so they agree to float32 rounding. We assert max |diff| <= 2e-4 (atol)
with rtol 1e-4; measured max errors are around 1e-6..1e-5 (printed with -s).
"""

import logging
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from kvarn_mlx import cache as cache_mod
from kvarn_mlx import reference as ref
from kvarn_mlx.attention import packed_attention
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import KVarNConfig, get_preset

ATOL, RTOL = 2e-4, 1e-4
ODD_CHUNKS = (1, 37, 100, 129, 3, 61, 200, 17)  # split tiles (64/128) and the sink at odd places


def kv_data(rng, B, H, T, D, dtype=np.float32):
    """Keys with outlier channels (offset, large) like post-RoPE keys; plain values."""
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    ch = rng.choice(D, 3, replace=False)
    k[..., ch] = k[..., ch] * 8 + 4
    v = rng.standard_normal((B, H, T, D)).astype(np.float32)
    return k.astype(dtype), v.astype(dtype)


def feed(cache, k, v, chunks=ODD_CHUNKS):
    """update_and_fetch k, v [B, H, T, D] (numpy) in chunks cycling through `chunks`."""
    T, i, j = k.shape[2], 0, 0
    while i < T:
        n = min(chunks[j % len(chunks)], T - i)
        out = cache.update_and_fetch(mx.array(k[:, :, i : i + n]), mx.array(v[:, :, i : i + n]))
        mx.eval(out)
        i, j = i + n, j + 1


def ref_inputs(cache, b, h, view=None):
    """The reference's inputs for batch row b, kv head h, from the cache's stored arrays."""
    view = cache.step_view() if view is None else view
    sk, sv, rk, rv = (np.array(x) for x in (view.sink_k, view.sink_v, view.recent_k, view.recent_v))
    key_tiles, value_tiles = [], []
    if view.tiles is not None:
        valid = view.tiles.valid(view.n_tiles).arrays()
        kw, ka, kb, kt, vw, va, vb, vc = (
            np.array(x.astype(mx.float32) if x.dtype != mx.uint32 else x) for x in valid
        )
        kbits, vbits = cache.config.k_bits, cache.config.v_bits
        for i in range(kw.shape[2]):
            key_tiles.append(
                (ref.unpack(kw[b, h, i], kbits), ka[b, h, i], kb[b, h, i], kt[b, h, i])
            )
            value_tiles.append(
                (ref.unpack(vw[b, h, i], vbits), va[b, h, i], vb[b, h, i], vc[b, h, i])
            )
    f = lambda x: x[b, h].astype(np.float64)
    return f(sk), f(sv), key_tiles, value_tiles, f(rk), f(rv)


def reference_output(cache, q, scale, causal=True, view=None):
    """reference.attention per (batch row, kv head), assembled to [B, Hq, L, D].
    A short step that completed a tile: its rows after the tile read it quantized."""
    view = cache.step_view() if view is None else view
    if view.after_tile is not None and causal:
        n = q.shape[2] - view.after_tile_row
        first = replace(
            view,
            recent_k=view.recent_k[..., :-n, :],
            recent_v=view.recent_v[..., :-n, :],
            after_tile=None,
        )
        return np.concatenate(
            [
                reference_output(cache, q[:, :, : view.after_tile_row], scale, True, first),
                reference_output(
                    cache, q[:, :, view.after_tile_row :], scale, True, view.after_tile
                ),
            ],
            axis=2,
        )
    q = np.array(q.astype(mx.float32))
    B, Hq, L, D = q.shape
    H = cache.sink_k.shape[1]
    n_rep = Hq // H
    out = np.zeros((B, Hq, L, D))
    for b in range(B):
        for h in range(H):
            sk, sv, kt, vt, rk, rv = ref_inputs(cache, b, h, view)
            out[b, h * n_rep : (h + 1) * n_rep] = ref.attention(
                q[b, h * n_rep : (h + 1) * n_rep], sk, sv, kt, vt, rk, rv, scale, causal=causal
            )
    return out


def step(cache, rng, B, Hq, L, D, dtype=np.float32):
    """One more update of L tokens; returns (queries, fed k, fed v, fallback K, fallback V)."""
    H = cache.sink_k.shape[1]
    k, v = kv_data(rng, B, H, L, D, dtype)
    q = mx.array(rng.standard_normal((B, Hq, L, D)).astype(dtype))
    K, V = cache.update_and_fetch(mx.array(k), mx.array(v))
    return q, k, v, K, V


def check_close(got, want, what, atol=ATOL, rtol=RTOL):
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    err = np.abs(got - want).max()
    print(f"{what}: max abs err {err:.2e}")
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=what)
    return err


# (D, GQA ratio, G, k_bits, v_bits, sink, tokens already cached, L of the query step).
# Every value of each axis appears with several others; some query steps complete a
# tile (they must still attend to their own tokens in full precision).
CASES = [
    (64, 1, 128, 4, 2, 128, 128 + 2 * 128 + 45, 1),
    # the step fills the tail: tile quantized now, seen in full now
    (64, 3, 64, 2, 2, 0, 3 * 64 + 63, 1),
    (64, 7, 64, 4, 4, 128, 128 + 2 * 64 + 5, 7),
    (64, 1, 128, 2, 4, 0, 2 * 128 + 120, 13),  # 120 + 13 crosses a tile boundary
    (128, 1, 64, 4, 2, 0, 4 * 64 + 1, 1),
    (128, 3, 128, 2, 2, 128, 128 + 128 + 77, 7),
    (128, 7, 128, 4, 4, 0, 2 * 128 + 127, 1),
    (128, 3, 64, 2, 4, 128, 128 + 3 * 64 + 30, 40),  # 30 + 40 crosses
    (256, 1, 128, 2, 2, 128, 128 + 2 * 128 + 3, 1),
    (256, 3, 64, 4, 2, 0, 3 * 64 + 10, 7),
    (256, 7, 128, 4, 4, 128, 128 + 128 + 90, 1),
    (256, 7, 64, 2, 2, 0, 2 * 64 + 60, 9),  # crosses
    (64, 3, 128, 4, 2, 128, 100, 1),  # still inside the sink: no tiles yet
    (128, 1, 64, 2, 2, 128, 128 + 64, 200),  # a long chunk: several new tiles, all seen in full
]
# Every code width as keys and as values at every head dim whose value rows fill
# uint32 words at that width (D=80 takes 2, 4, 6 and 8 bits).
for D in (64, 80, 96, 128, 256):
    widths = [b for b in (2, 3, 4, 5, 6, 8) if D * b % 32 == 0]
    for i, kb in enumerate(widths):
        G = (64, 128)[i % 2]
        CASES.append(
            (
                D,
                (1, 3, 7)[i % 3],
                G,
                kb,
                widths[(i + 1) % len(widths)],
                (0, 128)[i // 2 % 2],
                128 + 2 * G + 17 * i,
                (1, 5, 1, 9)[i % 4],
            )
        )


@pytest.mark.parametrize("D, gqa, G, kb, vb, sink, T, L", CASES)
def test_packed_matches_reference(D, gqa, G, kb, vb, sink, T, L):
    rng = np.random.default_rng(D * 1000 + T)
    H = 2
    cache = KVarNCache(KVarNConfig(k_bits=kb, v_bits=vb, group_size=G, sink=sink))
    k, v = kv_data(rng, 1, H, T, D)
    feed(cache, k, v)
    tiles_before = cache.n_tiles
    # A model holds the returned K, V until its attention call: so does this test.
    q, k2, v2, K, V = step(cache, rng, 1, H * gqa, L, D)

    # The view: tiles quantized before this step; sink and newer tokens exactly as fed.
    view = cache.step_view()
    sk, sv, rk, rv = view.sink_k, view.sink_v, view.recent_k, view.recent_v
    assert view.n_tiles == tiles_before and (view.tiles is None) == (tiles_before == 0)
    allk, allv = np.concatenate([k, k2], 2), np.concatenate([v, v2], 2)
    S, R = sk.shape[2], rk.shape[2]
    assert S + tiles_before * G + R == T + L == cache.offset
    assert np.array_equal(np.array(sk), allk[:, :, :S]) and np.array_equal(
        np.array(sv), allv[:, :, :S]
    )
    assert np.array_equal(np.array(rk), allk[:, :, T + L - R :]) and np.array_equal(
        np.array(rv), allv[:, :, T + L - R :]
    )

    scale = D**-0.5
    want = reference_output(cache, q, scale, causal=True)
    got = packed_attention(q, cache, scale, mask="causal" if L > 1 else None)
    check_close(got, want, f"packed vs reference D={D} gqa={gqa} G={G} k{kb}v{vb} sink={sink}")


def test_tiles_hold_the_right_tokens():
    # Guards the test above against a self-consistent but misplaced cache: the
    # dequantized tiles must approximate the tokens that were fed, in order.
    rng = np.random.default_rng(1)
    cache = KVarNCache(KVarNConfig(k_bits=4, v_bits=4, group_size=64, sink=128))
    k, v = kv_data(rng, 1, 2, 128 + 5 * 64 + 11, 64)
    feed(cache, k, v)
    K, V = (np.array(x) for x in cache.dequantized())
    for got, want in ((K, k), (V, v)):
        rel = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
        assert rel.max() < 0.2  # 4-bit: a few percent per token, never a swapped token
        assert np.array_equal(got[:, :, :128], want[:, :, :128])  # sink exact
        assert np.array_equal(got[:, :, -11:], want[:, :, -11:])  # tail exact


def test_batch_of_two():
    rng = np.random.default_rng(2)
    B, H, D, gqa = 2, 2, 64, 3
    cache = KVarNCache(KVarNConfig(k_bits=2, v_bits=2, group_size=64, sink=128))
    k, v = kv_data(rng, B, H, 128 + 3 * 64 + 20, D)
    feed(cache, k, v)
    q, *_ = step(cache, rng, B, H * gqa, 5, D)
    want = reference_output(cache, q, D**-0.5)
    assert not np.allclose(want[0], want[1])  # rows really differ
    check_close(packed_attention(q, cache, D**-0.5, mask="causal"), want, "batch 2")


@pytest.mark.parametrize("dtype", [np.float16])
def test_half_precision_inputs(dtype):
    # Model dtype float16: sink/tail stay float16, output float16 (rounding ~1e-3).
    rng = np.random.default_rng(3)
    D = 128
    cache = KVarNCache("k4v2_g128")
    k, v = kv_data(rng, 1, 2, 128 + 2 * 128 + 50, D, dtype)
    feed(cache, k, v)
    q, *_ = step(cache, rng, 1, 6, 3, D, dtype)
    assert cache.sink_k.dtype == mx.float16 and cache.tail_k.dtype == mx.float16
    got = packed_attention(q, cache, D**-0.5, mask="causal")
    assert got.dtype == mx.float16
    check_close(got, reference_output(cache, q, D**-0.5), "float16", atol=3e-3, rtol=3e-3)


# -- the fallback and masks: against mx.fast SDPA over update_and_fetch's K/V ------------


def _cache_with_step(rng, D=64, H=2, gqa=3, L=6, B=1, preset="k4v2_g64", sink=128, T=None):
    cache = KVarNCache(get_preset(preset, sink=sink))
    T = 128 + 3 * 64 + 40 if T is None else T
    k, v = kv_data(rng, B, H, T, D)
    feed(cache, k, v)
    q, _, _, K, V = step(cache, rng, B, H * gqa, L, D)
    return cache, q, K, V


@pytest.mark.parametrize(
    "D, gqa, L, preset",
    [
        (64, 3, 1, "k4v2_g64"),
        (128, 7, 6, "k2v2_g128"),
        (256, 1, 30, "k4v4_g128"),
        (64, 1, 100, "k4v2_g64"),
    ],
)
def test_fallback_equals_packed(D, gqa, L, preset):
    # Models that call mx.fast.scaled_dot_product_attention themselves get update_and_fetch's lazily
    # dequantized K/V: same view, same result. (L=100 with G=64 quantizes tiles in this step.)
    rng = np.random.default_rng(D + L)
    cache, q, K, V = _cache_with_step(rng, D=D, gqa=gqa, L=L, preset=preset)
    mask = "causal" if L > 1 else None
    assert K.shape[2] == cache.offset
    want = mx.fast.scaled_dot_product_attention(q, K, V, scale=D**-0.5, mask=mask)
    got = packed_attention(q, cache, D**-0.5, mask=mask)
    check_close(got, np.array(want).astype(np.float64), f"fallback D={D} L={L}")


def test_causal_string_equals_causal_array_mask():
    rng = np.random.default_rng(4)
    cache, q, K, V = _cache_with_step(rng, L=9)
    arr = create_causal_mask(9, cache.offset - 9)
    assert arr.shape == (9, cache.offset)
    a = packed_attention(q, cache, 0.125, mask="causal")
    b = packed_attention(q, cache, 0.125, mask=arr)
    np.testing.assert_array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("kind", ["bool_b1", "bool_per_head", "additive", "additive_per_head"])
def test_array_masks(kind):
    rng = np.random.default_rng(5)
    B, H, gqa, L, D = 2, 2, 3, 6, 64
    cache, q, K, V = _cache_with_step(rng, B=B, H=H, gqa=gqa, L=L, D=D)
    T = cache.offset
    heads = H * gqa if kind.endswith("per_head") else 1
    if kind.startswith("bool"):
        m = rng.random((B, heads, L, T)) < 0.7
        m[..., -1] = True  # every query sees at least one key
        mask = mx.array(m)
    else:
        mask = mx.array(rng.normal(0, 2, (B, heads, L, T)).astype(np.float32))
    want = mx.fast.scaled_dot_product_attention(q, K, V, scale=D**-0.5, mask=mask)
    got = packed_attention(q, cache, D**-0.5, mask=mask)
    check_close(got, np.array(want).astype(np.float64), f"mask {kind}")
    unmasked = packed_attention(q, cache, D**-0.5, mask=None)
    assert not np.allclose(np.array(got), np.array(unmasked), atol=1e-3)  # the mask did something


@pytest.mark.parametrize("L", [1, 5])
def test_attention_sinks(L):
    # Learned per-head sink logits (gpt-oss style) take softmax mass without a value.
    rng = np.random.default_rng(6)
    D, H, gqa = 64, 2, 3
    cache, q, K, V = _cache_with_step(rng, D=D, H=H, gqa=gqa, L=L)
    sinks = mx.array(rng.normal(1.0, 1.0, (H * gqa,)).astype(np.float32))
    mask = "causal" if L > 1 else None
    want = mx.fast.scaled_dot_product_attention(q, K, V, scale=D**-0.5, mask=mask, sinks=sinks)
    got = packed_attention(q, cache, D**-0.5, mask=mask, sinks=sinks)
    check_close(got, np.array(want).astype(np.float64), f"sinks L={L}")
    assert not np.allclose(
        np.array(got), np.array(packed_attention(q, cache, D**-0.5, mask=mask)), atol=1e-3
    )


# -- head dims the rotation cannot handle ---------------------------------------------


@pytest.mark.parametrize("D, preset", [(144, "k2v2_g128"), (72, "k4v4_g128")])
def test_unrotatable_head_dim_warns_once_and_matches_unrotated_reference(
    D, preset, monkeypatch, caplog
):
    # 144 = 9 * 16 and 72 = 9 * 8: packable (2 and 4 bits; 4 bits only), but no Hadamard
    # transform in MLX (which returns garbage for D=72 if asked anyway).
    monkeypatch.setattr(cache_mod, "_warned", set())
    rng = np.random.default_rng(D)
    caches = []
    with caplog.at_level(logging.WARNING, logger="kvarn_mlx"):
        for _ in range(2):  # two layers with the same head dim: one warning
            c = KVarNCache(preset)
            k, v = kv_data(rng, 1, 2, 128 + 2 * 128 + 33, D)
            feed(c, k, v)
            caches.append(c)
    msgs = [r.getMessage() for r in caplog.records if str(D) in r.getMessage()]
    assert len(msgs) == 1 and "rotation" in msgs[0]
    cache = caches[0]
    assert not cache.rotate_k and not cache.rotate_v
    q, *_ = step(cache, rng, 1, 6, 4, D)
    # The oracle without rotation: H = identity (patched here, not in reference.py).
    monkeypatch.setattr(ref, "hadamard", lambda n: np.eye(n))
    want = reference_output(cache, q, D**-0.5)
    check_close(packed_attention(q, cache, D**-0.5, mask="causal"), want, f"unrotated D={D}")


@pytest.mark.parametrize("D, preset", [(72, "k2v2_g128"), (80, "k3v3_g128"), (80, "k4v5_g128")])
def test_unpackable_head_dim_is_a_clear_error_and_cache_stays_usable(D, preset):
    # D=72 is a multiple of 8 (4-bit words) but not of 16 (2-bit words); 80 values
    # of 3 or 5 bits do not fill whole words either.
    cache = KVarNCache(preset)
    k = mx.zeros((1, 2, 4, D))
    with pytest.raises(ValueError, match=str(D)):
        cache.update_and_fetch(k, k)
    assert cache.offset == 0 and cache.empty()
    K, _ = cache.update_and_fetch(mx.ones((1, 2, 4, 64)), mx.ones((1, 2, 4, 64)))
    assert K.shape == (1, 2, 4, 64) and cache.offset == 4


# -- NaN / Inf keys -----------------------------------------------------------------


def test_nan_inf_keys_in_a_quantized_tile():
    # What we see: quantization maps NaN -> 0 and +/-Inf -> +/-2^24 (quant.LIMIT) before
    # scaling, so every stored scale is finite and attention over the tiles has no NaN.
    # The bad tokens are of course garbage; the other tiles are unaffected. (A NaN still
    # in the sink or tail is attended in full precision exactly as mlx-lm's KVCache would.)
    rng = np.random.default_rng(7)
    D = 64
    cache = KVarNCache(KVarNConfig(k_bits=4, v_bits=2, group_size=64, sink=128))
    k, v = kv_data(rng, 1, 2, 128 + 3 * 64 + 5, D)
    bad = 128 + 64 + 10  # a token of the second tile
    k[0, 0, bad, 3] = np.nan
    k[0, 0, bad + 1, 5] = np.inf
    k[0, 1, bad + 2, :] = -np.inf
    v[0, 1, bad + 3, 7] = np.nan
    feed(cache, k, v)
    for name in ("k_a", "k_b", "k_t", "v_a", "v_b", "v_c"):
        assert np.isfinite(np.array(getattr(cache.tiles.valid(), name).astype(mx.float32))).all(), (
            name
        )
    q, *_ = step(cache, rng, 1, 6, 1, D)
    out = np.array(packed_attention(q, cache, D**-0.5))
    assert np.isfinite(out).all()
    K, V = (np.array(x) for x in cache.dequantized())
    assert np.isfinite(K).all() and np.isfinite(V).all()
    # Tiles 0 and 2 (no bad tokens) still reconstruct their tokens.
    for t in (0, 2):
        sl = slice(128 + t * 64, 128 + (t + 1) * 64)
        rel = np.linalg.norm(K[:, :, sl] - k[:, :, sl]) / np.linalg.norm(k[:, :, sl])
        assert rel < 0.15, (t, rel)


# -- the patch ------------------------------------------------------------------------


def test_patch_idempotent_and_unpatch_restores_modules():
    import importlib
    import sys

    from mlx_lm.models import base

    import kvarn_mlx
    from kvarn_mlx import integration

    llama = importlib.import_module("mlx_lm.models.llama")
    qwen2 = importlib.import_module("mlx_lm.models.qwen2")
    try:
        kvarn_mlx.patch()
        kvarn_mlx.patch()  # idempotent: still one level of wrapping
        assert integration.is_patched()
        assert base.scaled_dot_product_attention is integration.scaled_dot_product_attention
        assert llama.scaled_dot_product_attention is integration.scaled_dot_product_attention
        assert qwen2.scaled_dot_product_attention is integration.scaled_dot_product_attention
        kvarn_mlx.unpatch()
        assert not integration.is_patched()
        assert base.scaled_dot_product_attention is integration._original
        for name, mod in list(sys.modules.items()):
            if name.startswith("mlx_lm.") and hasattr(mod, "scaled_dot_product_attention"):
                assert (
                    mod.scaled_dot_product_attention is not integration.scaled_dot_product_attention
                ), name
        kvarn_mlx.unpatch()  # harmless twice
        assert llama.scaled_dot_product_attention is integration._original
    finally:
        kvarn_mlx.patch()  # the package's import-time state, for the other tests
    assert llama.scaled_dot_product_attention is integration.scaled_dot_product_attention


@pytest.mark.parametrize("name", ["llama64", "qwen2", "gemma3"])
def test_patch_leaves_other_caches_alone(name):
    # Plain KVCache / RotatingKVCache models give bit-identical logits patched and unpatched.
    from mlx_lm.models.cache import make_prompt_cache

    import kvarn_mlx
    from models import tiny_model, tokens

    model = tiny_model(name)
    x = mx.array(tokens(70))[None]

    def run():
        c = make_prompt_cache(model)
        out = [model(x[:, :50], cache=c), model(x[:, 50:51], cache=c), model(x[:, 51:], cache=c)]
        return [np.array(o) for o in out]

    try:
        kvarn_mlx.patch()
        patched = run()
        kvarn_mlx.unpatch()
        plain = run()
    finally:
        kvarn_mlx.patch()
    for a, b in zip(patched, plain):
        np.testing.assert_array_equal(a, b)


def test_nan_key_in_the_tail_behaves_like_a_float_cache_until_quantized():
    # Documented: a NaN key still in the full-precision tail poisons the queries that see
    # it, exactly as with mlx-lm's KVCache; once its tile is quantized it is a 0 and the
    # output is finite again.
    rng = np.random.default_rng(8)
    D, G = 64, 64
    cache = KVarNCache(KVarNConfig(k_bits=4, v_bits=2, group_size=G, sink=0))
    k, v = kv_data(rng, 1, 1, G + 10, D)
    k[0, 0, G + 3, 0] = np.nan
    feed(cache, k, v)
    q = mx.array(rng.standard_normal((1, 2, 1, D)).astype(np.float32))
    cache.update_and_fetch(*(mx.array(x) for x in kv_data(rng, 1, 1, 1, D)))
    assert np.isnan(np.array(packed_attention(q, cache, D**-0.5))).all()
    cache.update_and_fetch(*(mx.array(x) for x in kv_data(rng, 1, 1, G, D)))  # fills the tile
    cache.update_and_fetch(*(mx.array(x) for x in kv_data(rng, 1, 1, 1, D)))
    assert cache.n_tiles == 2
    assert np.isfinite(np.array(packed_attention(q, cache, D**-0.5))).all()


# -- tile ranges on separate CPU streams ----------------------------------------------


def _many_tiles(rng, L, preset="k2v2_g64"):
    """A cache with enough tiles (13) to be split across CPU streams, and a step of L queries."""
    return _cache_with_step(rng, D=64, H=2, gqa=3, L=L, preset=preset, T=128 + 13 * 64 + 20)


def test_stream_count_counts_the_tiles_of_every_batch_row(monkeypatch):
    from kvarn_mlx import attention

    monkeypatch.setattr(attention, "MIN_STREAM_TILES", 4)
    assert [attention.stream_count(n) for n in (0, 3, 4, 7, 8, 13)] == [0, 0, 1, 1, 2, 3]
    # a batch's rows share the tile ranges: 3 tiles of 4 rows are 12 tile-rows of work
    assert attention.stream_count(3, rows=4) == 3 and attention.stream_count(7, rows=8) == 7
    assert attention.stream_count(1, rows=8) == 1  # never an empty range


@pytest.mark.parametrize("kind", ["decode", "causal", "bool_per_head", "additive", "sinks"])
def test_tile_ranges_on_cpu_streams_match_one_range_and_the_reference(kind, monkeypatch):
    from kvarn_mlx import attention

    rng = np.random.default_rng(11)
    L = 1 if kind == "decode" else 5
    cache, q, K, V = _many_tiles(rng, L)
    T, D = cache.offset, q.shape[-1]
    mask, sinks = ("causal" if L > 1 else None), None
    if kind == "bool_per_head":
        m = rng.random((1, q.shape[1], L, T)) < 0.6
        m[..., -1] = True
        mask = mx.array(m)
    elif kind == "additive":
        mask = mx.array(rng.normal(0, 2, (1, 1, L, T)).astype(np.float32))
    elif kind == "sinks":
        sinks = mx.array(rng.normal(1.0, 1.0, (q.shape[1],)).astype(np.float32))
    ranges = []
    real = attention._tile_ranges
    monkeypatch.setattr(
        attention, "_tile_ranges", lambda n, rows=1: ranges.append(real(n, rows)) or ranges[-1]
    )

    with mx.stream(mx.cpu):
        monkeypatch.setattr(attention.dispatch, "CPU_STREAMS", 2)
        split = attention.attend(q, cache.step_view(), D**-0.5, mask, sinks)
        monkeypatch.setattr(attention.dispatch, "CPU_STREAMS", 1)
        one = attention.attend(q, cache.step_view(), D**-0.5, mask, sinks)
    assert [len(r) for r in ranges] == [2, 1]  # the split did happen, then did not
    assert [hi - lo for (lo, hi), _ in ranges[0]] == [6, 7] and ranges[0][0][1] != ranges[0][1][1]
    check_close(
        split, np.array(one).astype(np.float64), f"two streams vs one, {kind}", atol=1e-5, rtol=1e-5
    )
    if kind in ("decode", "causal"):
        check_close(
            split,
            reference_output(cache, q, D**-0.5, causal=True),
            f"two streams vs reference, {kind}",
        )
    else:
        want = mx.fast.scaled_dot_product_attention(q, K, V, scale=D**-0.5, mask=mask, sinks=sinks)
        check_close(
            split, np.array(want).astype(np.float64), f"two streams vs SDPA over K/V, {kind}"
        )


def test_tile_streams_belong_to_each_thread():
    # MLX streams are per thread: the mlx-lm server decodes in a thread of its own.
    import threading

    rng = np.random.default_rng(12)
    cache, q, _, _ = _many_tiles(rng, 1)
    want = np.array(packed_attention(q, cache, 0.125))
    got, errors = [], []

    def run():
        try:
            with mx.stream(mx.new_stream(mx.cpu)):  # as mlx-lm's generation_stream
                got.append(np.array(packed_attention(q, cache, 0.125)))
        except Exception as e:  # pragma: no cover - the failure this test is for
            errors.append(e)

    for _ in range(2):
        t = threading.Thread(target=run)
        t.start()
        t.join()
    assert not errors, errors
    assert len(got) == 2 and all(np.allclose(g, want, atol=1e-6) for g in got)


@pytest.mark.parametrize("preset, sink", [("k4v2_g128", 128), ("auto4v2", 128), ("k2v2_g64", 0)])
def test_compiled_decode_steps_match_attend_and_the_reference(preset, sink, monkeypatch):
    # Decode steps on the ops path run attend() through mx.compile over the whole tail
    # buffer; over steps that cross tail-buffer growths and tile commits, every step
    # must equal attend() on the exact recent tokens and the reference.
    from kvarn_mlx import attention, dispatch

    monkeypatch.setattr(dispatch, "use_metal", lambda: False)
    rng = np.random.default_rng(21)
    cfg = replace(get_preset(preset), sink=sink)
    G = cfg.group_size
    D, H, gqa = 64, 2, 3
    cache = KVarNCache(cfg)
    k, v = kv_data(rng, 1, H, sink + 9 * G - 40, D)
    feed(cache, k, v)
    calls = []
    compiled = attention._compiled
    monkeypatch.setattr(attention, "_compiled", lambda *a: calls.append(a[3].shape) or compiled(*a))
    rooms = set()
    for i in range(G + 8):
        q, *_ = step(cache, rng, 1, H * gqa, 1, D)
        view = cache.step_view()
        got = packed_attention(q, cache, D**-0.5)
        rooms.add((view.n_tiles, view.recent_room[0].shape[2]))
        exact = replace(view, recent_room=None)
        want = attention.attend(q, exact, D**-0.5)
        check_close(
            got, np.array(want).astype(np.float64), f"compiled vs attend, step {i}", 1e-5, 1e-5
        )
        if i % 16 == 0:
            check_close(got, reference_output(cache, q, D**-0.5), f"compiled vs reference {i}")
    assert len(calls) == G + 8
    assert len({n for n, _ in rooms}) >= 2 and len({r for _, r in rooms}) >= 2, rooms


def test_compiled_decode_starts_afresh_after_max_traces(monkeypatch):
    # mx.compile keeps every trace; the decode path drops them after max_traces so that a
    # long generation's old shapes do not slow the lookup. Results stay the same.
    from kvarn_mlx import attention, dispatch

    monkeypatch.setattr(dispatch, "use_metal", lambda: False)
    monkeypatch.setattr(attention._compiled, "max_traces", 1)
    rng = np.random.default_rng(22)
    D, H = 64, 2
    cache = KVarNCache("k4v2_g128")
    feed(cache, *kv_data(rng, 1, H, 128 + 2 * 128 + 20, D))
    made = []
    compile = mx.compile
    monkeypatch.setattr(mx, "compile", lambda f: made.append(f) or compile(f))
    for i in range(80):  # crosses tail-buffer growths: new shapes, new traces
        q, *_ = step(cache, rng, 1, H, 1, D)
        got = packed_attention(q, cache, D**-0.5)
        want = attention.attend(q, replace(cache.step_view(), recent_room=None), D**-0.5)
        check_close(got, np.array(want).astype(np.float64), f"step {i}", 1e-5, 1e-5)
    assert len(made) >= 2 and attention._compiled.traces <= 2
