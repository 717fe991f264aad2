"""KVarN tile quantization with MLX ops, batched over any leading axes.

The same math as reference.py (KVARN_SPEC.md sections 1-4, 7), for every
(batch, head, tile) in one call; runs on every MLX backend and under mx.compile.
"""

import mlx.core as mx

# Inputs are clamped to +/-LIMIT (NaN -> 0) before quantizing: a documented safe
# result instead of NaN scales. 2^24 keeps every product of scales inside
# float16's range once balance_exponents has split it.
LIMIT = 2.0**24
_SCALE_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def can_rotate(D: int) -> bool:
    """Whether mx.hadamard_transform supports head dim D (2^k or m*2^k, m in 12, 20, 28)."""
    for m in (1, 12, 20, 28):
        if D % m == 0 and (D // m) & (D // m - 1) == 0:
            return True
    return False


def check_head_dim(D: int, bits: int):
    if bits < 1 or 32 % bits:
        raise ValueError(f"bits={bits} is not supported: it must divide 32 to pack codes into uint32 words")
    per_word = 32 // bits
    if D % per_word:
        raise ValueError(
            f"head dim {D} is not supported at {bits} bits: it must be a multiple of {per_word} "
            "to pack codes into uint32 words"
        )


def rotate(x):
    # mx.hadamard_transform does not reject other sizes (mlx 0.32.4 CPU returns
    # wrong values and corrupts the heap for e.g. D=72), so check first.
    D = x.shape[-1]
    if not can_rotate(D):
        raise ValueError(
            f"head dim {D} cannot be rotated: mx.hadamard_transform needs 2^k or m*2^k, m in 12, 20, 28"
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
    """fn(x) where flag says so: flag is a bool, or a per-kv-head bool array for x [B, H, ...]."""
    if isinstance(flag, mx.array):
        return mx.where(flag.reshape(1, -1, *([1] * (x.ndim - 2))), fn(x), x)
    return fn(x) if flag else x


def _check_tiles(x, bits, name):
    """Tiles must be [..., G, D] with G >= 2 tokens (std uses ddof=1)."""
    if x.ndim < 2 or x.shape[-2] < 2:
        raise ValueError(f"{name} tiles must have shape [..., G, D] with G >= 2; got shape {tuple(x.shape)}")
    check_head_dim(x.shape[-1], bits)


def _std(x, axis):
    return mx.sqrt(mx.var(x, axis=axis, keepdims=True, ddof=1))


def imbalance(X):
    col, row = _std(X, -2), _std(X, -1)
    col_term = col.max(axis=(-2, -1), keepdims=True) / mx.maximum(col.min(axis=(-2, -1), keepdims=True), 1e-8)
    row_term = row.max(axis=(-2, -1), keepdims=True) / mx.maximum(row.min(axis=(-2, -1), keepdims=True), 1e-8)
    return col_term + row_term


def normalize(M, iters=8):
    """Dual variance scaling of tiles M [..., R, C] (float32); returns (balanced, sc, sr)."""
    log_c = mx.zeros((*M.shape[:-2], 1, M.shape[-1]), mx.float32)
    log_r = mx.zeros((*M.shape[:-1], 1), mx.float32)
    best, sc_best, sr_best = imbalance(M), mx.ones_like(log_c), mx.ones_like(log_r)
    for _ in range(iters):
        cur = M / mx.exp(log_c) / mx.exp(log_r)
        log_c = mx.clip(log_c + mx.log(mx.clip(_std(cur, -2), 1e-3, 1e3)), -0.3, 10)
        cur = M / mx.exp(log_c) / mx.exp(log_r)
        log_r = mx.clip(log_r + mx.log(mx.clip(_std(cur, -1), 1e-3, 1e3)), -0.3, 10)
        cur = M / mx.exp(log_c) / mx.exp(log_r)
        imb = imbalance(cur)
        better = imb <= best
        best = mx.where(better, imb, best)
        sc_best = mx.where(better, mx.exp(log_c), sc_best)
        sr_best = mx.where(better, mx.exp(log_r), sr_best)
    return M / sc_best / sr_best, sc_best, sr_best


def rtn(X, bits):
    """Per-row asymmetric min/max round-to-nearest; returns (code uint32, scale, lo)."""
    qmax = 2**bits - 1
    lo = X.min(axis=-1, keepdims=True)
    hi = X.max(axis=-1, keepdims=True)
    scale = mx.maximum((hi - lo) / qmax, 1e-10)
    code = mx.clip(mx.round((X - lo) / scale), 0, qmax).astype(mx.uint32)
    return code, scale, lo


def pack(code, bits):
    """uint32 codes [..., C] -> words [..., C*bits/32], LSB first (mx.quantize's layout)."""
    per_word = 32 // bits
    c = code.astype(mx.uint32).reshape(*code.shape[:-1], -1, per_word)
    shifts = mx.arange(per_word, dtype=mx.uint32) * bits
    return mx.sum(mx.left_shift(c, shifts), axis=-1).astype(mx.uint32)


def unpack(words, bits):
    per_word = 32 // bits
    shifts = mx.arange(per_word, dtype=mx.uint32) * bits
    c = mx.bitwise_and(mx.right_shift(words[..., None], shifts), 2**bits - 1)
    return c.reshape(*words.shape[:-1], -1)


def balance_exponents(a, b, col):
    """Split a power of two between (a, b) and col so float16 storage neither
    overflows nor underflows; (code*a + b)*col is unchanged."""
    row_max = mx.maximum(mx.abs(a).max(axis=-1, keepdims=True), mx.abs(b).max(axis=-1, keepdims=True))
    col_max = mx.abs(col).max(axis=-1, keepdims=True)
    k = mx.round((mx.log2(mx.maximum(col_max, 1e-30)) - mx.log2(mx.maximum(row_max, 1e-30))) / 2)
    f = mx.power(2.0, k)
    return a * f, b * f, col / f


def quantize_tiles(M, bits, iters=8, scale_dtype="float16"):
    """Rotated tiles M [..., R, C] -> (words [..., R, C*bits/32], a [..., R], b [..., R], col [..., C])."""
    balanced, sc, sr = normalize(M, iters)
    code, scale, lo = rtn(balanced, bits)
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
    """Key tiles k [..., G, D] (tokens x channels) -> (words [..., D, G*bits/32], a [..., D], b [..., D], t [..., G])."""
    _check_tiles(k, bits, "key")
    per_word = 32 // bits
    if k.shape[-2] % per_word:
        # K codes are packed along tokens.
        raise ValueError(
            f"key tiles of {k.shape[-2]} tokens (shape {tuple(k.shape)}) cannot be packed at {bits} bits: "
            f"G must be a multiple of {per_word}"
        )
    M = mx.swapaxes(_prepare(k, rotated), -1, -2)
    return quantize_tiles(M, bits, iters, scale_dtype)


def quantize_values(v, bits, iters=8, rotated=True, scale_dtype="float16"):
    """Value tiles v [..., G, D] -> (words [..., G, D*bits/32], a [..., G], b [..., G], c [..., D])."""
    _check_tiles(v, bits, "value")
    return quantize_tiles(_prepare(v, rotated), bits, iters, scale_dtype)


def dequantize_keys(words, a, b, t, bits):
    """Rotated K tiles [..., G, D] in float32."""
    code = unpack(words, bits).astype(mx.float32)
    K = (code * a[..., None].astype(mx.float32) + b[..., None].astype(mx.float32)) * t[..., None, :].astype(mx.float32)
    return mx.swapaxes(K, -1, -2)


def dequantize_values(words, a, b, c, bits):
    """Rotated V tiles [..., G, D] in float32."""
    code = unpack(words, bits).astype(mx.float32)
    return (code * a[..., None].astype(mx.float32) + b[..., None].astype(mx.float32)) * c[..., None, :].astype(mx.float32)
