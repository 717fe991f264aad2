"""FP8 (e4m3) storage of a tile's absorbed scales: one byte per scale instead of two.

docs/algorithm.md, "Absorbed scales". e4m3 keeps 3 mantissa bits and values
from 2^-9 to 448 (normal from 2^-6), stored as uint8 (mx.to_fp8's bytes). Two
things float16 storage does not need:

- the power of two moved between the row factors (a, b) and the column
  factor must put both inside that range (fit_exponents), overflow first;
- the codes are rounded against the stored scales: rounding a to 3 mantissa
  bits moves the top of a b-bit grid by up to (2^b - 1)/16 steps, which codes
  chosen for the exact scales would carry as error.

Both the MLX ops path and reference.py implement this; the Metal quantize
kernel does not (dispatch falls back to the ops path for it).
"""

import math

import mlx.core as mx

E_LO, E_HI = -6.0, math.log2(448.0)  # log2 of e4m3's smallest normal and its largest value
TINY = 2.0**-9  # e4m3's smallest subnormal: a and col are kept at least this, never 0


def to_float32(s):
    """Stored scales as float32: e4m3 bytes decoded, any float dtype cast."""
    return mx.from_fp8(s, dtype=mx.float32) if s.dtype == mx.uint8 else s.astype(mx.float32)


def decoded(s):
    """Stored scales as a float dtype: e4m3 bytes decoded to float32, others as they are."""
    return mx.from_fp8(s, dtype=mx.float32) if s.dtype == mx.uint8 else s


def fit_exponents(a, b, col, live):
    """k per tile such that a, b times 2^k and col over 2^k fit e4m3.

    a, b [..., R], col [..., C]; live [..., R]: rows whose grid is not the
    constant-row floor (their a carries no information). The margins to the
    top of the range (largest |a|, |b|, col) and to the bottom (smallest live
    a, smallest col) move in opposite directions with k: k equalizes the
    smallest margin of each direction, then is clipped so nothing overflows
    when that is possible."""
    log2 = lambda v: mx.log2(mx.maximum(v, 1e-30))
    keep = lambda v: mx.expand_dims(v, -1)
    r_hi = log2(mx.maximum(mx.abs(a).max(axis=-1), mx.abs(b).max(axis=-1)))
    r_lo = log2(mx.where(live, mx.abs(a), math.inf).min(axis=-1))
    c_hi, c_lo = log2(col.max(axis=-1)), log2(col.min(axis=-1))
    up = mx.minimum(E_HI - r_hi, c_lo - E_LO)  # room to move the row factors up
    down = mx.minimum(r_lo - E_LO, E_HI - c_hi)  # room to move them down
    k = mx.round((up - down) / 2)
    k_min, k_max = mx.ceil(c_hi - E_HI), mx.floor(E_HI - r_hi)
    k = mx.where(k_min <= k_max, mx.clip(k, k_min, k_max), mx.round((c_hi - r_hi) / 2))
    return keep(k)


def store(M, bits, a, b, col, live):
    """Rotated tiles M [..., R, C] and their exact factors -> (codes [..., R, C] uint32,
    a, b [..., R], col [..., C] as e4m3 bytes), the codes rounded against the stored factors."""
    f = mx.power(2.0, fit_exponents(a, b, col, live))
    a8 = mx.to_fp8(mx.maximum(a * f, TINY))
    b8 = mx.to_fp8(b * f)
    c8 = mx.to_fp8(mx.maximum(col / f, TINY))
    a_s, b_s, c_s = (to_float32(x) for x in (a8, b8, c8))
    code = mx.round((M / c_s[..., None, :] - b_s[..., None]) / a_s[..., None])
    return mx.clip(code, 0, 2**bits - 1).astype(mx.uint32), a8, b8, c8
