"""Tile quantization through mx.compile stores the same bits as the uncompiled ops.

dispatch quantizes tiles on the MLX ops path through mx.compile, whose fused
CPU code could round differently; these tests compare every packed code word
and every scale, bit for bit, over random tiles and edge cases."""

import mlx.core as mx
import numpy as np
import pytest

from kvarn_mlx import dispatch, quant

SCALE_DTYPES = ("float16", "bfloat16", "float32", "fp8")


@pytest.fixture(autouse=True)
def ops_path(monkeypatch):
    monkeypatch.setattr(dispatch, "_backend", "ops")


def tiles(seed, dtype=mx.float32, G=128, D=64):
    """[1, 2, 8, G, D]: random tiles of several scales and the edge cases."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 2, 8, G, D)).astype(np.float32)
    x[0, 0, 1] *= 1e4  # large
    x[0, 0, 2] *= 1e-5  # small
    x[0, 0, 3] = 0.75  # constant tile
    x[0, 0, 4] = 0.0  # zero tile
    x[0, 0, 5, :, 3] *= 300  # an outlier channel
    x[0, 0, 6, 7] *= 500  # an outlier token
    x[0, 0, 7] = rng.integers(-3, 4, (G, D))  # few distinct values, ties in rounding
    x[0, 1] *= np.exp(rng.uniform(-6, 6, (8, 1, 1))).astype(np.float32)
    if dtype == mx.float16:
        x = np.clip(x, -6e4, 6e4)
    return mx.array(x).astype(dtype)


def both(x, bits, rotated, scale_dtype, keys):
    """(compiled, uncompiled) outputs of dispatch's tile quantization."""
    fn = dispatch.quantize_keys if keys else dispatch.quantize_values
    compiled = fn(x, bits, 8, rotated, scale_dtype)
    dispatch.COMPILE = False
    try:
        plain = fn(x, bits, 8, rotated, scale_dtype)
    finally:
        dispatch.COMPILE = True
    mx.eval(compiled, plain)
    return compiled, plain


def assert_same_bits(compiled, plain):
    for c, p in zip(compiled, plain, strict=True):
        assert c.dtype == p.dtype and c.shape == p.shape
        # compare raw bytes: equal bits, NaNs included
        assert np.array_equal(np.array(c.view(mx.uint8)), np.array(p.view(mx.uint8))), (
            "compiled quantization stored different bits"
        )


@pytest.mark.parametrize("keys", [True, False], ids=["keys", "values"])
@pytest.mark.parametrize("bits", quant.BITS)
def test_every_width_same_bits(bits, keys):
    for seed, dtype, rotated in ((0, mx.float32, True), (1, mx.float16, False)):
        assert_same_bits(*both(tiles(seed, dtype), bits, rotated, "float16", keys))


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_every_scale_dtype_same_bits(scale_dtype):
    for keys in (True, False):
        assert_same_bits(*both(tiles(2, mx.float16), 3, True, scale_dtype, keys))


def test_compiled_path_is_taken(monkeypatch):
    """The comparison above means something only if dispatch really compiles."""
    monkeypatch.setattr(dispatch._compiled, "traces", 0)
    x = tiles(3, G=96, D=32)  # a shape no other test quantizes: traced here
    for _ in range(3):
        mx.eval(dispatch.quantize_values(x, 4, 8, True, "float16"))
    assert dispatch._compiled.traces > 0
    traced = dispatch._compiled.traces
    mx.eval(dispatch.quantize_values(x, 4, 8, True, "float16"))
    assert dispatch._compiled.traces == traced  # replayed, not traced again


@pytest.mark.slow
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_grid_same_bits(scale_dtype):
    for seed in range(4):
        for dtype in (mx.float32, mx.float16, mx.bfloat16):
            for bits in quant.BITS:
                for keys in (True, False):
                    x = tiles(10 + seed, dtype, D=128 if seed % 2 else 64)
                    assert_same_bits(*both(x, bits, seed % 2 == 0, scale_dtype, keys))
