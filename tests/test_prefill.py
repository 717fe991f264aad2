"""Prefill chunks attend through a dequantized buffer (kvarn_mlx/prefill.py):
the same attention as the packed path, held to the numpy oracle.

Both paths are called directly on the same StepView (the route packed_attention
takes is tested apart), over caches whose views hold sink, tiles and recent
tokens, with chunks that complete tiles in the step. Tolerances as in
tests/test_attention.py: outputs are O(1), the oracle runs in float64 over the
stored codes and scales, both paths in float32.
"""

import io

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask

from kvarn_mlx import attention, prefill
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import KVarNConfig, get_preset
from kvarn_mlx.integration import make_cache
from test_attention import check_close, feed, kv_data, reference_output, step

# (D, GQA ratio, G, k_bits, v_bits, sink, tokens already cached, L of the chunk)
CASES = [
    (64, 3, 64, 4, 2, 128, 128 + 3 * 64 + 20, 40),  # 20 + 40 stays in the tail
    (64, 1, 128, 2, 2, 0, 2 * 128 + 100, 200),  # completes two tiles in the step
    (128, 7, 128, 4, 4, 128, 128 + 128 + 77, 64),
    (128, 3, 64, 2, 4, 128, 128 + 5 * 64, 129),  # starts at a tile boundary
    (256, 1, 128, 4, 2, 0, 3 * 128 + 5, 16),
    (64, 3, 64, 4, 2, 128, 90, 100),  # the chunk fills the sink and starts the tail
]


def _view_of_step(case, seed=0, scale_dtype="float16"):
    D, gqa, G, kb, vb, sink, T, L = case
    rng = np.random.default_rng([D, T, L, seed])
    cache = KVarNCache(
        KVarNConfig(k_bits=kb, v_bits=vb, group_size=G, sink=sink, scale_dtype=scale_dtype)
    )
    k, v = kv_data(rng, 1, 2, T, D)
    feed(cache, k, v)
    q, _, _, K, V = step(cache, rng, 1, 2 * gqa, L, D)
    return cache, q, (K, V)  # K, V keep the step's view alive, as a model does


@pytest.mark.parametrize("case", CASES)
def test_dequantized_and_packed_paths_match_reference(case):
    D = case[0]
    cache, q, alive = _view_of_step(case)
    view = cache.step_view()
    scale = D**-0.5
    want = reference_output(cache, q, scale, causal=True)
    got_deq = prefill.attend_dequantized(q, view, scale, mask="causal")
    got_packed = attention.attend(q, view, scale, mask="causal")
    check_close(got_deq, want, f"dequantized {case}")
    check_close(got_packed, want, f"packed {case}")
    assert got_deq.dtype == q.dtype


@pytest.mark.parametrize("case", [CASES[0], CASES[2]])
def test_fp8_scales(case):
    # e4m3 scale bytes are decoded, not cast (the packed path is held to the oracle
    # with fp8 scales in tests/test_fp8.py).
    cache, q, alive = _view_of_step(case, scale_dtype="fp8")
    view = cache.step_view()
    assert view.tiles.k_a.dtype == mx.uint8
    want = attention.attend(q, view, case[0] ** -0.5, mask="causal")
    got = prefill.attend_dequantized(q, view, case[0] ** -0.5, mask="causal")
    check_close(got, np.array(want).astype(np.float64), f"fp8 {case}")


def test_dequantized_buffer_is_the_views_tokens():
    # Sink and recent tokens exactly; tiles as the storage's dequantization (Tiles.dequantize,
    # what update_and_fetch returns), up to float rounding, in token order.
    cache, q, (K, V) = _view_of_step(CASES[0])
    view = cache.step_view()
    k, v = prefill.dequantized(view)
    assert k.shape == K.shape and k.shape[2] == cache.offset
    S, R = view.sink_k.shape[2], view.recent_k.shape[2]
    for got, want in ((k, K), (v, V)):
        got, want = np.array(got), np.array(want)
        np.testing.assert_array_equal(got[:, :, :S], want[:, :, :S])
        np.testing.assert_array_equal(got[:, :, -R:], want[:, :, -R:])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("kind", ["causal_array", "additive_per_head", "sinks"])
def test_masks_and_sinks(kind):
    case = (64, 3, 64, 4, 2, 128, 128 + 3 * 64 + 20, 24)
    cache, q, alive = _view_of_step(case, seed=1)
    view = cache.step_view()
    L, T, Hq = q.shape[2], cache.offset, q.shape[1]
    rng = np.random.default_rng(9)
    mask, sinks = "causal", None
    if kind == "causal_array":
        mask = create_causal_mask(L, T - L)
    elif kind == "additive_per_head":
        mask = mx.array(rng.normal(0, 2, (1, Hq, L, T)).astype(np.float32))
    else:
        sinks = mx.array(rng.normal(1.0, 1.0, (Hq,)).astype(np.float32))
    got = prefill.attend_dequantized(q, view, 0.125, mask=mask, sinks=sinks)
    want = attention.attend(q, view, 0.125, mask=mask, sinks=sinks)
    check_close(got, np.array(want).astype(np.float64), kind)


def test_float16_model():
    rng = np.random.default_rng(3)
    D = 128
    cache = KVarNCache("k4v2_g128")
    k, v = kv_data(rng, 1, 2, 128 + 2 * 128 + 50, D, np.float16)
    feed(cache, k, v)
    q, _, _, K, V = step(cache, rng, 1, 6, 32, D, np.float16)
    got = prefill.attend_dequantized(q, cache.step_view(), D**-0.5, mask="causal")
    assert got.dtype == mx.float16
    check_close(got, reference_output(cache, q, D**-0.5), "float16", atol=3e-3, rtol=3e-3)


def test_auto_rotation_per_head():
    # An "auto" cache decides key rotation per kv head; the buffer unrotates only those heads.
    rng = np.random.default_rng(11)
    D = 64
    cache = KVarNCache(get_preset("auto4v2", sink=0, group_size=64))
    k, v = kv_data(rng, 1, 2, 3 * 64 + 10, D)
    feed(cache, k, v)
    q, _, _, K, V = step(cache, rng, 1, 6, 1, D)
    attention.packed_attention(q, cache, D**-0.5)  # decides
    assert isinstance(cache.rotate_k, mx.array)
    q, _, _, K, V = step(cache, rng, 1, 6, 40, D)
    view = cache.step_view()
    want = reference_output(cache, q, D**-0.5) if bool(cache.rotate_k.all()) else None
    got = prefill.attend_dequantized(q, view, D**-0.5, mask="causal")
    check_close(
        got, np.array(attention.attend(q, view, D**-0.5, mask="causal")).astype(np.float64), "auto"
    )
    if want is not None:
        check_close(got, want, "auto vs reference")


def test_route(monkeypatch):
    # packed_attention takes the dequantized path from MIN_QUERIES query tokens on,
    # and for any step that sees no tile; the packed path below.
    device = mx.default_device().type.name
    monkeypatch.setitem(prefill.MIN_QUERIES, device, 16)
    calls = []
    real = prefill.attend_dequantized
    monkeypatch.setattr(
        prefill, "attend_dequantized", lambda *a, **k: calls.append(a[0].shape[2]) or real(*a, **k)
    )
    for L, want in ((15, False), (16, True), (1, False)):
        cache, q, alive = _view_of_step((64, 3, 64, 4, 2, 128, 128 + 3 * 64 + 20, L))
        calls.clear()
        attention.packed_attention(q, cache, 0.125, mask="causal" if L > 1 else None)
        assert bool(calls) == want, L
    # inside the sink and tail: no tile
    cache, q, alive = _view_of_step((64, 3, 64, 4, 2, 128, 100, 20))
    calls.clear()
    attention.packed_attention(q, cache, 0.125, mask="causal")
    assert calls == [20]


def test_model_prefill_matches_packed_only(monkeypatch):
    # A real model forward in chunks: logits with the dequantized prefill path equal
    # the packed-only run's within float32 rounding (same tiles: quantization is
    # independent of the attention path).
    from models import tiny_model, tokens

    model = tiny_model("llama64")
    ids = mx.array(tokens(700))[None]

    def run():
        cache = make_cache(model, get_preset("k4v2_g64", sink=64))
        out = [model(ids[:, s : s + 256], cache=cache) for s in range(0, 700, 256)]
        return mx.concatenate(out, axis=1)

    with_prefill = run()
    monkeypatch.setitem(prefill.MIN_QUERIES, mx.default_device().type.name, 10**9)
    monkeypatch.setattr(prefill, "use_dequantized", lambda q, view: False)
    packed_only = run()
    a, b = np.array(with_prefill), np.array(packed_only)
    assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()
    plain = mlx_cache.make_prompt_cache(model)
    ref_logits = mx.concatenate(
        [model(ids[:, s : s + 256], cache=plain) for s in range(0, 700, 256)], axis=1
    )
    assert not np.allclose(a, np.array(ref_logits), atol=1e-6)  # the tiles were really quantized


def _pending_ops(arrays):
    """Operations MLX has yet to run to produce these arrays (0: all evaluated)."""
    f = io.StringIO()
    mx.export_to_dot(f, *arrays)
    return f.getvalue().count("shape=rectangle")


@pytest.mark.parametrize("with_depends", [True, False])
def test_logits_only_prefill_leaves_no_quantization_pending(with_depends, monkeypatch):
    # A loop that evaluates only the logits (eval tools, custom generation loops) must
    # not leave the prompt's tile quantization to the first decode step that reads them.
    from models import tiny_model, tokens

    if not with_depends:  # shows the test can fail: without the dependency it stays pending
        monkeypatch.setattr(mx, "depends", lambda inputs, dependencies: inputs)
    model = tiny_model("llama64")
    cache = make_cache(model, get_preset("k4v2_g64", sink=64))
    mx.eval(model(mx.array(tokens(700))[None], cache=cache))  # one chunk: sees no tile, quantizes 9
    assert cache[0].n_tiles == 9
    pending = sum(_pending_ops(c.tiles.arrays()) for c in cache)
    assert (pending == 0) == with_depends, pending


@pytest.mark.parametrize("kind", ["causal", "causal_array", "additive_per_head", "sinks", "none"])
def test_query_blocks(monkeypatch, kind):
    # A chunk longer than query_block attends in blocks of rows: the same output as one
    # call over all rows (and as the oracle under the causal mask), for every kind of mask.
    case = (64, 3, 64, 4, 2, 128, 128 + 3 * 64 + 20, 100)
    cache, q, alive = _view_of_step(case, seed=2)
    view = cache.step_view()
    L, T, Hq = q.shape[2], cache.offset, q.shape[1]
    rng = np.random.default_rng(4)
    mask, sinks = ("causal" if kind in ("causal", "sinks") else None), None
    if kind == "causal_array":
        mask = create_causal_mask(L, T - L)
    elif kind == "additive_per_head":
        mask = mx.array(rng.normal(0, 2, (1, Hq, L, T)).astype(np.float32))
    elif kind == "sinks":
        sinks = mx.array(rng.normal(1.0, 1.0, (Hq,)).astype(np.float32))
    whole = prefill.attend_dequantized(q, view, 0.125, mask=mask, sinks=sinks)
    rows = prefill.query_block(1, Hq, T)
    assert rows >= L  # the default budget: one block here
    # 32 rows a block: 4 blocks, the last short
    monkeypatch.setattr(prefill, "SCORE_BYTES", 4 * Hq * T * 32)
    assert prefill.query_block(1, Hq, T) == 32
    calls = []
    real = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(
        mx.fast,
        "scaled_dot_product_attention",
        lambda q, *a, **k: calls.append(q.shape[2]) or real(q, *a, **k),
    )
    blocked = prefill.attend_dequantized(q, view, 0.125, mask=mask, sinks=sinks)
    assert calls == [32, 32, 32, 4]
    np.testing.assert_allclose(np.array(blocked), np.array(whole), rtol=1e-5, atol=1e-5)
    if kind == "causal":
        check_close(blocked, reference_output(cache, q, 0.125, causal=True), "blocked vs reference")


def test_query_blocks_bound_the_peak():
    # 1,024 queries over 8,192 dequantized keys: one call materializes 9 x 1,024 x 8,192
    # float32 scores (288 MiB) a few times over; in blocks, about 4 x SCORE_BYTES.
    rng = np.random.default_rng(5)
    cache = KVarNCache("k4v2_g128")
    k, v = kv_data(rng, 1, 3, 7 * 1024, 64)
    feed(cache, k, v)
    q, _, _, K, V = step(cache, rng, 1, 9, 1024, 64)
    view = cache.step_view()
    mx.eval(q, *view.tiles.arrays(), view.recent_k, view.recent_v, view.sink_k, view.sink_v)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(prefill.attend_dequantized(q, view, 0.125, mask="causal"))
    extra = mx.get_peak_memory() - base
    scores = 4 * 9 * 1024 * cache.offset
    print(f"peak above the inputs: {extra / 2**20:.0f} MiB")
    assert extra < 6 * prefill.SCORE_BYTES < scores / 2, (extra / 2**20, scores / 2**20)
