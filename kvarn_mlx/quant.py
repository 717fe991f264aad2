"""KVarN tile quantization with MLX ops, batched over any leading axes.

The same math as reference.py (docs/algorithm.md), for every
(batch, head, tile) in one call; runs on every MLX backend and under mx.compile.
"""

import math

import mlx.core as mx

from . import fp8

# Inputs are clamped to +/-LIMIT (NaN -> 0) before quantizing: a documented safe
# result instead of NaN scales. 2^24 keeps every product of scales inside
# float16's range once balance_exponents has split it.
LIMIT = 2.0**24
_SCALE_DTYPES = {
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
    "fp8": mx.uint8,
}


def can_rotate(D: int) -> bool:
    """Whether mx.hadamard_transform supports head dim D (2^k or m*2^k, m in 12, 20, 28)."""
    for m in (1, 12, 20, 28):
        if D % m == 0 and (D // m) & (D // m - 1) == 0:
            return True
    return False


# The code widths mx.quantized_matmul reads.
BITS = (2, 3, 4, 5, 6, 8)


def check_bits(n: int, bits: int, what: str):
    """n codes of `bits` bits per packed row must fill whole uint32 words."""
    if bits not in BITS:
        raise ValueError(f"bits={bits} is not supported: use one of {BITS}")
    if n * bits % 32:
        raise ValueError(
            f"{what} {n} is not supported at {bits} bits: {n}*{bits} must be a multiple of 32 "
            "to pack codes into uint32 words"
        )


def check_head_dim(D: int, bits: int):
    """Value codes are packed along the head dim."""
    check_bits(D, bits, "head dim")


def rotate(x):
    # mx.hadamard_transform does not reject other sizes (mlx 0.32.4 CPU returns
    # wrong values and corrupts the heap for e.g. D=72), so check first.
    D = x.shape[-1]
    if not can_rotate(D):
        raise ValueError(
            f"head dim {D} cannot be rotated: "
            "mx.hadamard_transform needs 2^k or m*2^k, m in 12, 20, 28"
        )
    return mx.hadamard_transform(x)


def unrotate(x):
    """x -> x H^T. The Sylvester H (D = 2^k) is symmetric; for D = m * 2^k it is not."""
    D = x.shape[-1]
    if D & (D - 1) == 0:
        return rotate(x)
    if (D, x.dtype) not in _HT:
        _HT[(D, x.dtype)] = rotate(mx.eye(D, dtype=mx.float32)).T.astype(x.dtype)
    return x @ _HT[(D, x.dtype)]


_HT = {}


def rotated_where(flag, x, fn):
    """fn(x) where flag says so: flag is a bool, or a bool array per kv head [H] or per
    batch row and kv head [B, H], for x [B, H, ...]."""
    if isinstance(flag, mx.array):
        lead = flag.shape if flag.ndim == 2 else (1, -1)
        return mx.where(flag.reshape(*lead, *([1] * (x.ndim - 2))), fn(x), x)
    return fn(x) if flag else x


def _check_tiles(x, name):
    """Tiles must be [..., G, D] with G >= 2 tokens (std uses ddof=1)."""
    if x.ndim < 2 or x.shape[-2] < 2:
        raise ValueError(
            f"{name} tiles must have shape [..., G, D] with G >= 2; got shape {tuple(x.shape)}"
        )


def _std(x, axis):
    return mx.sqrt(mx.var(x, axis=axis, keepdims=True, ddof=1))


def imbalance(X):
    return _imbalance(_std(X, -2), _std(X, -1))


def _imbalance(col, row):
    """From a tile's column and row stds: max/min of each, summed."""
    col_term = col.max(axis=(-2, -1), keepdims=True) / mx.maximum(
        col.min(axis=(-2, -1), keepdims=True), 1e-8
    )
    row_term = row.max(axis=(-2, -1), keepdims=True) / mx.maximum(
        row.min(axis=(-2, -1), keepdims=True), 1e-8
    )
    return col_term + row_term


def normalize(M, iters=8):
    """Dual variance scaling of tiles M [..., R, C] (float32); returns (balanced, sc, sr).

    The loop of docs/algorithm.md, "Variance normalization". Each std of the
    iterate M / exp(log_c) / exp(log_r) along one axis is taken as
    std(M / exp(the other factor)) / exp(this axis's factor), which is constant
    along that axis: one pass over M per std, where dividing by both factors
    costs two. An iterate's column stds are the next column update's, and its
    row stds come from the row update's, so the imbalance costs no pass."""
    log_c = mx.zeros((*M.shape[:-2], 1, M.shape[-1]), mx.float32)
    log_r = mx.zeros((*M.shape[:-1], 1), mx.float32)
    # exp(log_c), exp(log_r): one exp each per iteration
    c, r = mx.ones_like(log_c), mx.ones_like(log_r)
    col, row = _std(M, -2), _std(M, -1)  # of the current iterate
    best, sc_best, sr_best = _imbalance(col, row), c, r
    for _ in range(iters):
        log_c = mx.clip(log_c + mx.log(mx.clip(col, 1e-3, 1e3)), -0.3, 10)
        c = mx.exp(log_c)
        row_c = _std(M / c, -1)  # over r: the iterate's row stds
        log_r = mx.clip(log_r + mx.log(mx.clip(row_c / r, 1e-3, 1e3)), -0.3, 10)
        r = mx.exp(log_r)
        row = row_c / r
        col = _std(M / r, -2) / c
        imb = _imbalance(col, row)
        better = imb <= best
        best = mx.where(better, imb, best)
        sc_best = mx.where(better, c, sc_best)
        sr_best = mx.where(better, r, sr_best)
    return M / sc_best / sr_best, sc_best, sr_best


def rtn(X, bits):
    """Per-row asymmetric min/max round-to-nearest; returns (code uint32, scale, lo)."""
    qmax = 2**bits - 1
    lo = X.min(axis=-1, keepdims=True)
    hi = X.max(axis=-1, keepdims=True)
    scale = mx.maximum((hi - lo) / qmax, 1e-10)
    code = mx.clip(mx.round((X - lo) / scale), 0, qmax).astype(mx.uint32)
    return code, scale, lo


def _period(bits):
    """(codes, words) of the shortest run of codes that fills whole words: a
    3-bit row repeats every 32 codes in 3 words, a 4-bit row every 8 in 1."""
    n = 32 // math.gcd(32, bits)
    return n, n * bits // 32


def pack(code, bits):
    """uint32 codes [..., C] -> words [..., C*bits/32]: one LSB-first bitstream
    per row (mx.quantize's layout); a code may straddle two words."""
    n, nw = _period(bits)
    c = code.astype(mx.uint32).reshape(*code.shape[:-1], -1, n)
    words = []
    for w in range(nw):
        at = [i * bits - 32 * w for i in range(n)]  # where code i starts, relative to word w
        left = mx.left_shift(c, mx.array([max(s, 0) for s in at], mx.uint32))
        right = mx.right_shift(c, mx.array([min(max(-s, 0), 31) for s in at], mx.uint32))
        part = mx.where(mx.array([s >= 0 for s in at]), left, right)
        inside = mx.array([-bits < s < 32 for s in at])
        # disjoint bits: sum is or
        words.append(mx.sum(mx.where(inside, part, 0), axis=-1).astype(mx.uint32))
    return mx.stack(words, axis=-1).reshape(*code.shape[:-1], -1)


def unpack(words, bits):
    """words [..., W] -> uint32 codes [..., W*32/bits]."""
    n, nw = _period(bits)
    w = words.reshape(*words.shape[:-1], -1, nw)
    first = [i * bits // 32 for i in range(n)]
    shift = [i * bits % 32 for i in range(n)]
    lo = mx.right_shift(mx.take(w, mx.array(first), axis=-1), mx.array(shift, mx.uint32))
    if nw > 1:  # the high bits of codes that straddle into the next word
        nxt = mx.take(w, mx.array([min(f + 1, nw - 1) for f in first]), axis=-1)
        hi = mx.left_shift(
            nxt, mx.array([32 - s if s + bits > 32 else 0 for s in shift], mx.uint32)
        )
        lo = mx.where(mx.array([s + bits > 32 for s in shift]), mx.bitwise_or(lo, hi), lo)
    c = mx.bitwise_and(lo, 2**bits - 1)
    return c.reshape(*words.shape[:-1], -1)


def row_groups(a, b, D):
    """mx.quantized_matmul / mx.dequantize operands for codes packed along D with
    one (a, b) per row [..., rows]: (group size, a, b [..., rows, D/gs]), or None
    where no group size fits D (e.g. 80)."""
    gs = next((g for g in (128, 64, 32) if D % g == 0), None)
    if gs is None:
        return None
    a, b = a[..., None], b[..., None]
    if D > gs:  # the row's scales repeat over its D/gs groups (no gather when D == gs)
        a, b = mx.repeat(a, D // gs, axis=-1), mx.repeat(b, D // gs, axis=-1)
    return gs, a, b


def balance_exponents(a, b, col):
    """Split a power of two between (a, b) and col so float16 storage neither
    overflows nor underflows; (code*a + b)*col is unchanged."""
    row_max = mx.maximum(
        mx.abs(a).max(axis=-1, keepdims=True), mx.abs(b).max(axis=-1, keepdims=True)
    )
    col_max = mx.abs(col).max(axis=-1, keepdims=True)
    k = mx.round((mx.log2(mx.maximum(col_max, 1e-30)) - mx.log2(mx.maximum(row_max, 1e-30))) / 2)
    f = mx.power(2.0, k)
    return a * f, b * f, col / f


def quantize_tiles(M, bits, iters=8, scale_dtype="float16"):
    """Rotated tiles M [..., R, C] -> (words [..., R, C*bits/32], a [..., R], b [..., R],
    col [..., C])."""
    balanced, sc, sr = normalize(M, iters)
    code, scale, lo = rtn(balanced, bits)
    if scale_dtype == "fp8":  # e4m3 bytes, codes rounded against them (fp8.py)
        code, a, b, col = fp8.store(
            M, bits, (sr * scale)[..., 0], (sr * lo)[..., 0], sc[..., 0, :], scale[..., 0] > 1e-10
        )
        return pack(code, bits), a, b, col
    a, b, col = balance_exponents((sr * scale)[..., 0], (sr * lo)[..., 0], sc[..., 0, :])
    dt = _SCALE_DTYPES[scale_dtype]
    return pack(code, bits), a.astype(dt), b.astype(dt), col.astype(dt)


def sanitize(x):
    """float32, NaN -> 0, clamped to +/-LIMIT."""
    return mx.clip(mx.nan_to_num(x.astype(mx.float32), nan=0.0), -LIMIT, LIMIT)


def _prepare(x, rotated):
    x = sanitize(x)
    return rotate(x) if rotated else x


def quantize_keys(k, bits, iters=8, rotated=True, scale_dtype="float16"):
    """Key tiles k [..., G, D] (tokens x channels) -> (words [..., D, G*bits/32], a [..., D],
    b [..., D], t [..., G])."""
    _check_tiles(k, "key")
    try:
        check_bits(k.shape[-2], bits, "key tile size")  # K codes are packed along tokens
    except ValueError as e:
        raise ValueError(f"key tiles of shape {tuple(k.shape)}: {e}") from None
    M = mx.swapaxes(_prepare(k, rotated), -1, -2)
    return quantize_tiles(M, bits, iters, scale_dtype)


def quantize_values(v, bits, iters=8, rotated=True, scale_dtype="float16"):
    """Value tiles v [..., G, D] -> (words [..., G, D*bits/32], a [..., G], b [..., G],
    c [..., D])."""
    _check_tiles(v, "value")
    check_head_dim(v.shape[-1], bits)
    return quantize_tiles(_prepare(v, rotated), bits, iters, scale_dtype)


def dequantize_keys(words, a, b, t, bits):
    """Rotated K tiles [..., G, D] in float32."""
    code = unpack(words, bits).astype(mx.float32)
    a, b, t = (fp8.to_float32(s) for s in (a, b, t))
    K = (code * a[..., None] + b[..., None]) * t[..., None, :]
    return mx.swapaxes(K, -1, -2)


def dequantize_values(words, a, b, c, bits):
    """Rotated V tiles [..., G, D] in float32."""
    code = unpack(words, bits).astype(mx.float32)
    a, b, c = (fp8.to_float32(s) for s in (a, b, c))
    return (code * a[..., None] + b[..., None]) * c[..., None, :]
