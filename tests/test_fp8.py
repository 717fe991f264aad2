"""FP8 (e4m3) scales: MLX's conversions, the quantizer against the reference, the
range fit (no overflow), the error against float32 scales, and a cache that
stores one byte per scale and attends like the reference over what it holds."""

import contextlib
import logging

import mlx.core as mx
import numpy as np
import pytest

from kvarn_mlx import dispatch, fp8, kernels, quant
from kvarn_mlx import reference as ref
from kvarn_mlx.attention import attend, packed_attention
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import KVarNConfig
from kvarn_mlx.tiles import StepView, Tiles, append
from refcheck import TIE


def test_mlx_converts_e4m3_exactly():
    # Decoding: every byte is the e4m3 value its bits say (reference.fp8_decode
    # spells the format out), NaN only at 0x7f and 0xff.
    got = np.array(mx.from_fp8(mx.arange(256, dtype=mx.uint8), dtype=mx.float32))
    want = ref.fp8_decode(np.arange(256))
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(want).sum() == 2
    assert np.array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    # Encoding: round to nearest, ties to an even mantissa, saturating at +/-448.
    rng = np.random.default_rng(0)
    x = rng.standard_normal(100_000) * np.exp(rng.uniform(-16, 8, 100_000))
    finite = ref.fp8_decode(np.arange(128))[:127]
    x = np.concatenate(
        [
            x,
            finite,
            -finite,
            (finite[:-1] + finite[1:]) / 2,
            [448, 449, 500, 1e9, 2.0**-10, 2.0**-11],
        ]
    )
    x = x.astype(np.float32)
    enc = np.array(mx.to_fp8(mx.array(x)))
    assert np.array_equal(enc, ref.fp8_encode(x))
    # Every finite value survives a round trip.
    assert np.array_equal(np.array(mx.to_fp8(mx.from_fp8(mx.array(enc), dtype=mx.float32))), enc)


def tiles(rng, G, D, mag=1.0):
    """[4, G, D]: random, outlier channels with an offset, outlier tokens, quiet channels."""
    x = rng.standard_normal((4, G, D)).astype(np.float32)
    ch = rng.choice(D, 3, replace=False)
    x[1][:, ch] = 30 * x[1][:, ch] + 20
    x[2][rng.choice(G, 3, replace=False)] *= 50
    x[3][:, :5] *= 0.01
    return x * np.float32(mag)


def _factors(M, bits):
    """The exact factors quant.quantize_tiles hands to fp8.store (MLX ops)."""
    balanced, sc, sr = quant.normalize(M)
    _, scale, lo = quant.rtn(balanced, bits)
    return (sr * scale)[..., 0], (sr * lo)[..., 0], sc[..., 0, :], scale[..., 0] > 1e-10


@pytest.mark.parametrize("kind", ("k", "v"))
@pytest.mark.parametrize("bits", (2, 3, 4))
@pytest.mark.parametrize("D", (64, 128))
def test_ops_match_reference(D, bits, kind):
    """The fp8 step (exponent fit, e4m3 bytes, codes against them) of the MLX ops path is
    the reference's, from the same exact factors; the factors themselves are tested with
    float32 scales in test_quant.py."""
    rng = np.random.default_rng([D, bits, kind == "k"])
    x = mx.array(tiles(rng, 128, D))
    fn = quant.quantize_keys if kind == "k" else quant.quantize_values
    words, a, b, col = (np.array(o) for o in fn(x, bits, scale_dtype="fp8"))
    assert a.dtype == b.dtype == col.dtype == np.uint8
    code = np.array(quant.unpack(mx.array(words), bits))
    M = quant.rotate(x)
    M = mx.swapaxes(M, -1, -2) if kind == "k" else M
    factors = [np.array(f) for f in _factors(M, bits)]
    M = np.array(M)
    ties = 0
    for i in range(len(M)):
        rc, ra, rb, rcol = ref.fp8_store(M[i], bits, *(f[i] for f in factors))
        assert (
            np.array_equal(a[i], ra) and np.array_equal(b[i], rb) and np.array_equal(col[i], rcol)
        ), i
        frac = (
            M[i] / ref.fp8_decode(rcol)[None, :] - ref.fp8_decode(rb)[:, None]
        ) / ref.fp8_decode(ra)[:, None]
        diff = code[i].astype(int) - rc
        assert np.all(np.abs(diff) <= 1) and np.all(
            np.abs(frac - np.floor(frac) - 0.5)[diff != 0] < TIE
        ), i
        ties += int((diff != 0).sum())
    assert ties <= 1e-3 * code.size


def test_reference_pipeline_is_close_to_the_ops_path():
    # End to end (normalization included) the two paths may store the neighbouring
    # e4m3 byte where float rounding or a tie-switched normalization iterate moved an
    # exact scale across a rounding midpoint; the reconstructions agree closely.
    rng = np.random.default_rng(9)
    x = tiles(rng, 128, 128)
    H = ref.hadamard(128).astype(np.float32)
    out = quant.quantize_values(mx.array(x), 4, scale_dtype="fp8")
    deq = np.array(quant.dequantize_values(*out, 4))
    for i, t in enumerate(x):
        rc, ra, rb, rcol = ref.quantize_tile_fp8(t @ H, 4)
        want = ref.dequantize_tile(rc, ref.fp8_decode(ra), ref.fp8_decode(rb), ref.fp8_decode(rcol))
        rms = np.sqrt(np.mean((t @ H) ** 2))
        assert np.sqrt(np.mean((deq[i] - want) ** 2)) < 0.05 * rms, i


@pytest.mark.parametrize("mag", (1e-4, 1e-2, 1.0, 1e2, 1e3))
@pytest.mark.parametrize("bits", (2, 3, 4))
@pytest.mark.parametrize("kind", ("k", "v"))
def test_scales_fit_e4m3_and_keep_the_error(kind, bits, mag):
    """The exponent split keeps every scale inside e4m3 (nothing saturates at 448, no
    live a below its smallest subnormal) for tiles from 1e-4 to 1e2 with outliers up to
    50x that, and the error stays that of float32 scales. Past that (mag 1e3: values
    to 5e4) the product of the largest row and column factors exceeds 448^2 and a
    factor saturates; codes rounded against the stored scales still keep the error."""
    rng = np.random.default_rng([bits, int(np.log10(mag)) + 5, kind == "k"])
    x = mx.array(tiles(rng, 128, 128, mag))
    M = quant.rotate(x)
    M = mx.swapaxes(M, -1, -2) if kind == "k" else M
    balanced, sc, sr = quant.normalize(M)
    _, scale, lo = quant.rtn(balanced, bits)
    a, b, col, live = (sr * scale)[..., 0], (sr * lo)[..., 0], sc[..., 0, :], scale[..., 0] > 1e-10
    f = mx.power(2.0, fp8.fit_exponents(a, b, col, live))
    if mag > 1e2:
        assert not (
            (mx.abs(b * f) <= 448).all() and (col / f <= 448).all()
        )  # the range is exceeded
    else:
        assert (
            (mx.abs(a * f) < 448).all() and (mx.abs(b * f) <= 448).all() and (col / f <= 448).all()
        )
        assert (mx.where(live, a * f, 1.0) >= fp8.TINY).all() and (col / f >= fp8.TINY).all()

    fn = quant.quantize_keys if kind == "k" else quant.quantize_values
    dq = quant.dequantize_keys if kind == "k" else quant.dequantize_values
    want = quant.rotate(x)

    def rms(scale_dtype):
        out = fn(x, bits, scale_dtype=scale_dtype)
        return mx.sqrt(mx.mean((dq(*out, bits) - want) ** 2)).item()

    # Measured 0.94-1.08x: codes rounded against the stored scales recover the grid.
    assert rms("fp8") <= 1.12 * rms("float32")


def test_config_allows_fp8_only_for_narrow_codes():
    assert KVarNConfig(k_bits=4, v_bits=2, scale_dtype="fp8").scale_dtype == "fp8"
    with pytest.raises(ValueError, match="at most 4 bits"):
        KVarNConfig(k_bits=6, v_bits=4, scale_dtype="fp8")


def test_cache_holds_one_byte_per_scale_and_attends_over_it():
    rng = np.random.default_rng(1)
    G, D, H = 64, 64, 2
    caches = {
        s: KVarNCache(KVarNConfig(k_bits=4, v_bits=2, group_size=G, sink=G, scale_dtype=s))
        for s in ("float16", "fp8")
    }
    k = mx.array(rng.standard_normal((1, H, G + 3 * G + 7, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, H, G + 3 * G + 7, D)).astype(np.float32))
    for c in caches.values():
        mx.eval(c.update_and_fetch(k, v))
    t16, t8 = caches["float16"].tiles, caches["fp8"].tiles
    for name in ("k_a", "k_b", "k_t", "v_a", "v_b", "v_c"):
        x16, x8 = getattr(t16, name), getattr(t8, name)
        assert x8.dtype == mx.uint8 and x8.shape == x16.shape and x8.nbytes * 2 == x16.nbytes
    assert t8.k_words.nbytes == t16.k_words.nbytes
    saved = t16.nbytes - t8.nbytes
    assert saved == 3 * (D + G) * H * t8.capacity  # one byte less per scale

    # Packed attention over the fp8 tiles equals the reference over the same stored bytes.
    cache = caches["fp8"]
    q = mx.array(rng.standard_normal((1, 2 * H, 1, D)).astype(np.float32))
    k1 = mx.array(rng.standard_normal((1, H, 1, D)).astype(np.float32))
    K, V = cache.update_and_fetch(k1, k1)
    view = cache.step_view()
    valid = view.tiles.valid(view.n_tiles)
    out = np.zeros((1, 2 * H, 1, D))
    for h in range(H):
        kts = [
            (
                ref.unpack(np.array(valid.k_words[0, h, i]), 4),
                *(
                    ref.fp8_decode(np.array(getattr(valid, n)[0, h, i]))
                    for n in ("k_a", "k_b", "k_t")
                ),
            )
            for i in range(view.n_tiles)
        ]
        vts = [
            (
                ref.unpack(np.array(valid.v_words[0, h, i]), 2),
                *(
                    ref.fp8_decode(np.array(getattr(valid, n)[0, h, i]))
                    for n in ("v_a", "v_b", "v_c")
                ),
            )
            for i in range(view.n_tiles)
        ]
        f = lambda x: np.array(x[0, h]).astype(np.float64)
        out[0, 2 * h : 2 * h + 2] = ref.attention(
            np.array(q[0, 2 * h : 2 * h + 2]),
            f(view.sink_k),
            f(view.sink_v),
            kts,
            vts,
            f(view.recent_k),
            f(view.recent_v),
            D**-0.5,
        )
    got = np.array(packed_attention(q, cache, D**-0.5))
    np.testing.assert_allclose(got, out, atol=2e-5, rtol=1e-4)
    # ... and the dequantized fallback reads the same bytes.
    k_deq, _ = cache.tiles.dequantize(4, 2, cache.rotate_k, cache.rotate_v)
    assert np.isfinite(np.array(k_deq)).all()


# Metal: the attention kernel reads e4m3 scales; tile quantization falls back to the ops path.


def _metal():
    import metal_emulator

    if metal_emulator.NATIVE:
        return contextlib.nullcontext()
    mslemu = metal_emulator.load()
    if mslemu is None:
        pytest.skip(metal_emulator.SKIP_REASON)
    return _emulated(mslemu)


@contextlib.contextmanager
def _emulated(mslemu):
    with mslemu.patch_mlx(), mslemu.options_scope(lint="0"):
        yield


@pytest.mark.emulator
@pytest.mark.parametrize("kb, vb, L", [(4, 2, 1), (3, 3, 4), (2, 4, 2)])
def test_metal_attention_reads_fp8_scales(kb, vb, L):
    rng = np.random.default_rng([kb, vb, L])
    B, H, n, G, D = 1, 2, 3, 64, 128
    x = mx.array(rng.standard_normal((2, B, H, n, G, D)).astype(np.float32))
    tiles_ = Tiles(
        *quant.quantize_keys(x[0], kb, scale_dtype="fp8"),
        *quant.quantize_values(x[1], vb, scale_dtype="fp8"),
    )
    storage = append(None, tiles_, 2)  # room past the valid tiles
    dense = lambda m: mx.array(rng.standard_normal((B, H, m, D)).astype(np.float32)).astype(
        mx.float16
    )
    view = StepView(dense(G), dense(G), storage, n, dense(10), dense(10), kb, vb)
    q = mx.array(rng.standard_normal((B, 2 * H, L, D)).astype(np.float32))
    assert kernels.attention_unsupported(q, view) is None
    want = np.array(attend(q, view, D**-0.5, "causal" if L > 1 else None))
    with _metal():
        got = np.array(kernels.packed_attention_metal(q, view, D**-0.5, L > 1))
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()


@pytest.mark.emulator
def test_metal_quantization_of_fp8_scales_is_an_announced_fallback(caplog):
    x = mx.array(np.random.default_rng(3).standard_normal((2, 64, 64)).astype(np.float32))
    dispatch._logged.clear()
    with _metal(), caplog.at_level(logging.WARNING, logger="kvarn_mlx.kernels"):
        assert dispatch.use_metal()
        for _ in range(2):
            got = dispatch.quantize_values(x, 2, scale_dtype="fp8")
    want = quant.quantize_values(x, 2, scale_dtype="fp8")
    assert all(np.array_equal(np.array(g), np.array(w)) for g, w in zip(got, want))
    assert sum("scale dtype 'fp8'" in r.getMessage() for r in caplog.records) == 1
    dispatch._backend = None


def test_model_logits_with_fp8_scales_are_as_close_to_the_plain_cache():
    """A tiny model through every attention path a cache sees (a long prompt chunk over
    existing tiles, short chunks, one-token decoding): fp8 scales move the logits from
    the plain cache's about as much as float16 scales do. A path that read the e4m3
    bytes as numbers would be off by orders of magnitude."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvarn_mlx.integration import make_cache
    from models import tiny_model, tokens

    model = tiny_model("llama64")
    outs = {}
    for s in ("plain", "float16", "fp8"):
        cache = (
            make_prompt_cache(model)
            if s == "plain"
            else make_cache(
                model, KVarNConfig(k_bits=4, v_bits=4, group_size=64, sink=64, scale_dtype=s)
            )
        )
        logits = [model(mx.array(tokens(200, seed=1))[None], cache=cache)]  # sink + 2 tiles
        for chunk in (100, 5, 1, 1):  # attends over the tiles with long, short and one-token steps
            logits.append(model(mx.array(tokens(chunk, seed=chunk))[None], cache=cache))
        outs[s] = np.concatenate([np.array(x[0].astype(mx.float32)) for x in logits])
    rms = {s: float(np.sqrt(np.mean((outs[s] - outs["plain"]) ** 2))) for s in ("float16", "fp8")}
    print(f"\nRMS logit change from the plain cache: {rms} (logits' std {outs['plain'].std():.2f})")
    assert 0 < rms["fp8"] < 1.5 * rms["float16"]


def test_prompt_cache_file_keeps_the_fp8_bytes(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    cfg = KVarNConfig(k_bits=3, v_bits=2, group_size=64, sink=16, scale_dtype="fp8")
    cache = KVarNCache(cfg)
    x = mx.random.normal((1, 2, 16 + 2 * 64 + 5, 64), key=mx.random.key(4))
    mx.eval(cache.update_and_fetch(x, x))
    path = str(tmp_path / "fp8.safetensors")
    save_prompt_cache(path, [cache])
    (loaded,) = load_prompt_cache(path)
    assert loaded.config == cfg and loaded.n_tiles == cache.n_tiles == 2
    for a, b in zip(cache.tiles.valid().arrays(), loaded.tiles.valid().arrays()):
        assert a.dtype == b.dtype and np.array_equal(np.array(a), np.array(b))
    assert loaded.tiles.k_a.dtype == mx.uint8
