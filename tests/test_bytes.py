"""Bytes per token per kv head of a KVarN cache, at every code width and scale
dtype, measured from the arrays the cache holds: the layout's formula
(docs/algorithm.md, "Storage and bytes per token"),

    codes D*G*(kb + vb)/8 and scales 3*(D + G)*s bytes per tile of G tokens,

s the bytes of one stored scale (2 for float16/bfloat16, 4 for float32, 1 for fp8)."""

import mlx.core as mx
import pytest

from grid import diagonal, grid
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import FP8_MAX_BITS, SUPPORTED_BITS, KVarNConfig

SCALE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8": 1}


def pairs(D, scale_dtype):
    """Every (kb, vb) a cache of head dim D and this scale dtype takes."""
    for kb in SUPPORTED_BITS:
        for vb in SUPPORTED_BITS:
            if D * vb % 32 == 0 and (scale_dtype != "fp8" or max(kb, vb) <= FP8_MAX_BITS):
                yield kb, vb


DIMS, GROUPS, SCALES = (64, 80, 96, 128, 256), (64, 128), sorted(SCALE_BYTES)


# Each case checks every width pair. By default every head dim, tile size and scale
# dtype once; the other combinations: -m slow.
@pytest.mark.parametrize(
    "D,G,scale_dtype", grid(DIMS, GROUPS, SCALES, covering=diagonal(DIMS, GROUPS, SCALES))
)
def test_tile_bytes_per_token_are_the_layout_formula(D, G, scale_dtype):
    B, H, n = 1, 2, 2
    s = SCALE_BYTES[scale_dtype]
    checked = 0
    for kb, vb in pairs(D, scale_dtype):
        cache = KVarNCache(
            KVarNConfig(k_bits=kb, v_bits=vb, group_size=G, sink=0, scale_dtype=scale_dtype)
        )
        x = mx.random.normal((B, H, n * G, D), key=mx.random.key(kb * 10 + vb)).astype(mx.float16)
        mx.eval(cache.update_and_fetch(x, x), cache.held_arrays())
        assert cache.n_tiles == n
        b = cache.nbytes_breakdown()
        tokens = B * H * n * G  # per kv head
        assert b["codes"] == tokens * D * (kb + vb) // 8, (kb, vb)
        assert b["scales"] * G == tokens * 3 * (D + G) * s, (kb, vb)
        checked += 1
    # 80 takes no 3- or 5-bit values (80*3 and 80*5 are not multiples of 32).
    assert checked == (
        len(SUPPORTED_BITS) * (4 if D == 80 else 6)
        if scale_dtype != "fp8"
        else (6 if D == 80 else 9)
    )
