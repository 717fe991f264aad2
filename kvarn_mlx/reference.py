"""numpy reference for KVarN: the oracle every other path is tested against.

Each function follows docs/algorithm.md (its sections are named in the headings
below). Arithmetic is float32 (as the MLX paths use) unless a function says otherwise.
"""

import numpy as np

# Hadamard matrices of order m that mx.hadamard_transform uses for D = m * 2^k
# (rows of the +/-1 matrix; checked against MLX in tests/test_reference.py).
_HADAMARD_M = {
    12: (
        "+-++++++++++",
        "--+-+-+-+-+-",
        "+++-++----++",
        "+---+--+-++-",
        "+++++-++----",
        "+-+---+--+-+",
        "++--+++-++--",
        "+--++---+--+",
        "++----+++-++",
        "+--+-++---+-",
        "++++----+++-",
        "+-+--+-++---",
    ),
    20: (
        "+-----++++--++--+--+",
        "-+---+-+++---+++-+--",
        "--+--++-+++---+-+-+-",
        "---+-+++-+++-----+-+",
        "----+++++--++--+--+-",
        "+----+----+-++---++-",
        "-+----+----+-++---++",
        "--+----+--+-+-++---+",
        "---+----+-++-+-++---",
        "----+----+-++-+-++--",
        "++--+-+--++----+----",
        "+++--+-+---+----+---",
        "-+++--+-+---+----+--",
        "--+++--+-+---+----+-",
        "+--+++--+-----+----+",
        "+-++-++--+-+++++----",
        "-+-+++++--+-+++-+---",
        "+-+-+-+++-++-++--+--",
        "++-+---++++++-+---+-",
        "-++-++--++++++-----+",
    ),
    28: (
        "+--------++++--+-++-+-++--++",
        "-+--------+++++-+-++-+-++--+",
        "--+----+---+++-+-+-++++-++--",
        "---+---++---+++-+-+-+-++-++-",
        "----+--+++---+++-+-+---++-++",
        "-----+-++++----++-+-++--++-+",
        "------+-++++--+-++-+-++--++-",
        "++----++------+--++---+-++-+",
        "+++-----+------+--++-+-+-++-",
        "-+++-----+------+--++-+-+-++",
        "--+++-----+---+--+--++-+-+-+",
        "---+++-----+--++--+--++-+-+-",
        "----+++-----+--++--+--++-+-+",
        "+----++------+--++--++-++-+-",
        "+-+--+--++--+++------++----+",
        "-+-+--++-++--+-+-----+++----",
        "+-+-+--++-++----+-----+++---",
        "-+-+-+--++-++----+-----+++--",
        "--+-+-+--++-++----+-----+++-",
        "+--+-+-+--++-+-----+-----+++",
        "-+--+-+++--++-------++----++",
        "+--++--+-+--+---++++-+------",
        "-+--++--+-+--+---++++-+-----",
        "--+--+++-+-+--+---+++--+----",
        "+--+--+-+-+-+-++---++---+---",
        "++--+----+-+-++++---+----+--",
        "-++--+-+--+-+-++++--------+-",
        "--++--+-+--+-+-++++--------+",
    ),
}


# 1. Rotation ---------------------------------------------------------------


def sylvester(n):
    """The +/-1 Sylvester-Hadamard matrix: H[i, j] = (-1)^popcount(i & j)."""
    i = np.arange(n)
    bits = np.bitwise_and(i[:, None], i[None, :])
    popcount = np.vectorize(lambda v: bin(v).count("1"))(bits)
    return np.where(popcount % 2 == 0, 1.0, -1.0)


def hadamard(D):
    """Orthonormal H with x @ H == mx.hadamard_transform(x, scale=1/sqrt(D))."""
    m = next((m for m in (1, 12, 20, 28) if D % m == 0 and _is_pow2(D // m)), None)
    if m is None:
        raise ValueError(f"head dim {D} has no Hadamard matrix; need 2^k or m*2^k, m in 12, 20, 28")
    S = sylvester(D // m)
    if m > 1:
        Hm = np.array([[1.0 if c == "+" else -1.0 for c in row] for row in _HADAMARD_M[m]])
        S = np.kron(Hm, S)
    return S / np.sqrt(D)


def _is_pow2(n):
    return n >= 1 and n & (n - 1) == 0


# 2. Variance normalization -------------------------------------------------


def std(x, axis):
    return np.std(x, axis=axis, ddof=1, keepdims=True)


def imbalance(X):
    col, row = std(X, 0), std(X, 1)
    return col.max() / max(col.min(), 1e-8) + row.max() / max(row.min(), 1e-8)


def normalize(M, iters=8):
    """Sinkhorn-like dual scaling of one tile M [R, C]; returns (balanced, sc, sr)."""
    M = M.astype(np.float32)
    R, C = M.shape
    log_c = np.zeros((1, C), np.float32)
    log_r = np.zeros((R, 1), np.float32)
    best, sc_best, sr_best = imbalance(M), np.ones((1, C), np.float32), np.ones((R, 1), np.float32)
    for _ in range(iters):
        cur = M / np.exp(log_c) / np.exp(log_r)
        col_std = np.clip(std(cur, 0), 1e-3, 1e3)
        log_c = np.clip(log_c + np.log(col_std), -0.3, 10)
        cur = M / np.exp(log_c) / np.exp(log_r)
        row_std = np.clip(std(cur, 1), 1e-3, 1e3)
        log_r = np.clip(log_r + np.log(row_std), -0.3, 10)
        cur = M / np.exp(log_c) / np.exp(log_r)
        imb = imbalance(cur)
        if imb <= best:
            best, sc_best, sr_best = imb, np.exp(log_c), np.exp(log_r)
    balanced = M / sc_best / sr_best
    return balanced, sc_best, sr_best


# 3. Asymmetric round-to-nearest, per row -----------------------------------


def rtn(X, bits):
    """Per-row min/max RTN; returns (code, scale, lo), code in [0, 2^bits - 1]."""
    qmax = 2**bits - 1
    lo = X.min(axis=1, keepdims=True)
    hi = X.max(axis=1, keepdims=True)
    scale = np.maximum((hi - lo) / qmax, np.float32(1e-10))
    code = np.clip(np.rint((X - lo) / scale), 0, qmax)
    return code.astype(np.uint8), scale, lo


# 4. Absorbed scales and reconstruction -------------------------------------


def quantize_tile(M, bits, iters=8):
    """One rotated tile M [R, C] -> (code [R, C], a [R], b [R], col [C]).

    K tiles are [D, G] (col = t, per token); V tiles are [G, D] (col = c, per channel).
    """
    if not np.isfinite(M).all():
        raise ValueError("tile holds NaN or Inf")
    balanced, sc, sr = normalize(M, iters)
    code, scale, lo = rtn(balanced, bits)
    a, b, col = (sr * scale)[:, 0], (sr * lo)[:, 0], sc[0]
    return code, a, b, col


def balance_exponents(a, b, col):
    """Move a power of two between the row factors (a, b) and col so neither
    overflows or underflows float16 storage. Exact: (code*a + b)*col is unchanged."""
    row_max = np.maximum(np.abs(a).max(), np.abs(b).max())
    col_max = np.abs(col).max()
    k = np.round((np.log2(max(col_max, 1e-30)) - np.log2(max(row_max, 1e-30))) / 2)
    f = np.float32(2.0**k)
    return a * f, b * f, col / f


# FP8 (e4m3) scale storage (kvarn_mlx/fp8.py) ---------------------------------

FP8_E_LO, FP8_E_HI, FP8_TINY = -6.0, np.log2(448.0), 2.0**-9


def fp8_decode(u):
    """e4m3 bytes -> float32: sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7f/0xff are NaN."""
    u = np.asarray(u, np.uint8).astype(np.int64)
    e, m = (u >> 3) & 15, u & 7
    x = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7))
    x = np.where((e == 15) & (m == 7), np.nan, x)
    return np.where(u & 128, -x, x).astype(np.float32)


_FP8_VALUES = fp8_decode(np.arange(128))[:127]  # the non-negative finite values, ascending


def fp8_encode(x):
    """float -> e4m3 bytes: round to nearest, ties to an even mantissa, saturating at 448."""
    x = np.asarray(x, np.float32)
    mag = np.minimum(np.abs(x), 448.0)
    hi = np.clip(
        np.searchsorted(_FP8_VALUES, mag), 1, 126
    )  # _FP8_VALUES[hi - 1] <= mag <= _FP8_VALUES[hi]
    lo = hi - 1
    d_lo, d_hi = mag - _FP8_VALUES[lo], _FP8_VALUES[hi] - mag
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    code = np.where(mag == 0, 0, code)
    return (code | np.where(np.signbit(x), 128, 0)).astype(np.uint8)


def fp8_fit_exponents(a, b, col, live):
    """Power-of-two exponent k: a, b * 2^k and col / 2^k inside e4m3 (fp8.fit_exponents)."""
    log2 = lambda v: np.log2(np.maximum(v, 1e-30))
    r_hi = log2(max(np.abs(a).max(), np.abs(b).max()))
    r_lo = log2(np.abs(a[live]).min()) if live.any() else np.inf
    c_hi, c_lo = log2(col.max()), log2(col.min())
    up = min(FP8_E_HI - r_hi, c_lo - FP8_E_LO)
    down = min(r_lo - FP8_E_LO, FP8_E_HI - c_hi)
    k = np.rint((up - down) / 2)
    k_min, k_max = np.ceil(c_hi - FP8_E_HI), np.floor(FP8_E_HI - r_hi)
    return np.clip(k, k_min, k_max) if k_min <= k_max else np.rint((c_hi - r_hi) / 2)


def fp8_store(M, bits, a, b, col, live):
    """Tile M [R, C] and its exact factors -> (code, a, b, col) with a, b, col as e4m3
    bytes (after the exponent fit) and the codes rounded against the stored scales."""
    f = np.float32(2.0 ** fp8_fit_exponents(a, b, col, live))
    a8 = fp8_encode(np.maximum(a * f, np.float32(FP8_TINY)))
    b8 = fp8_encode(b * f)
    c8 = fp8_encode(np.maximum(col / f, np.float32(FP8_TINY)))
    a_s, b_s, c_s = fp8_decode(a8), fp8_decode(b8), fp8_decode(c8)
    code = np.clip(np.rint((M / c_s[None, :] - b_s[:, None]) / a_s[:, None]), 0, 2**bits - 1)
    return code.astype(np.uint8), a8, b8, c8


def quantize_tile_fp8(M, bits, iters=8):
    """quantize_tile with e4m3 scales (fp8_store)."""
    if not np.isfinite(M).all():
        raise ValueError("tile holds NaN or Inf")
    M = M.astype(np.float32)
    balanced, sc, sr = normalize(M, iters)
    _, scale, lo = rtn(balanced, bits)
    return fp8_store(
        M, bits, (sr * scale)[:, 0], (sr * lo)[:, 0], sc[0], scale[:, 0] > np.float32(1e-10)
    )


def dequantize_tile(code, a, b, col):
    return (code * a[:, None] + b[:, None]) * col[None, :]


def quantize_key_tile(k, bits, iters=8):
    """Key tile k [G, D] (tokens x channels, after RoPE) -> (code [D, G], a [D], b [D], t [G])."""
    M = (k.astype(np.float32) @ hadamard(k.shape[1]).astype(np.float32)).T
    return quantize_tile(M, bits, iters)


def quantize_value_tile(v, bits, iters=8):
    """Value tile v [G, D] -> (code [G, D], a [G], b [G], c [D])."""
    M = v.astype(np.float32) @ hadamard(v.shape[1]).astype(np.float32)
    return quantize_tile(M, bits, iters)


# 7. Packing: one LSB-first bitstream per row, in uint32 words ------------------


def pack(code, bits):
    """Codes [..., C] (each < 2^bits) -> words [..., C*bits/32]: code i of a row
    takes bits [i*bits, i*bits + bits) of the row's bitstream, bit j of the
    stream is bit j % 32 of word j // 32 (mx.quantize's layout; a 3-, 5- or
    6-bit code may straddle two words)."""
    C = code.shape[-1]
    if (C * bits) % 32:
        raise ValueError(
            f"{C} codes of {bits} bits do not fill whole uint32 words (C*bits must be a multiple "
            "of 32)"
        )
    c = code.astype(np.uint32)
    stream = (c[..., None] >> np.arange(bits, dtype=np.uint32)) & np.uint32(1)
    stream = stream.reshape(*code.shape[:-1], -1, 32)
    return np.bitwise_or.reduce(stream << np.arange(32, dtype=np.uint32), axis=-1)


def unpack(words, bits):
    stream = (words[..., None] >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    stream = stream.reshape(*words.shape[:-1], -1, bits)
    return np.bitwise_or.reduce(stream << np.arange(bits, dtype=np.uint32), axis=-1).astype(
        np.uint8
    )


# Attention over a packed cache (one kv head) ---------------------------------


def attention(q, sink_k, sink_v, key_tiles, value_tiles, tail_k, tail_v, scale, causal=True):
    """Queries q [n, L, D] (the kv head's query heads, the last L positions) over
    sink + quantized tiles + tail, in one softmax.

    sink_k/v, tail_k/v: [*, D] unrotated. key_tiles: list of (code [D, G], a, b, t);
    value_tiles: list of (code [G, D], a, b, c), all in the rotated space.
    """
    D = q.shape[-1]
    H = hadamard(D)
    q = q.astype(np.float64)
    K_rot = (
        np.concatenate([dequantize_tile(*t).T for t in key_tiles], 0)
        if key_tiles
        else np.zeros((0, D))
    )
    V_rot = (
        np.concatenate([dequantize_tile(*t) for t in value_tiles], 0)
        if value_tiles
        else np.zeros((0, D))
    )
    # (q H) . (k H) = q . k, so the rotated tiles score against rotated queries.
    s = np.concatenate([q @ sink_k.T, (q @ H) @ K_rot.T, q @ tail_k.T], -1) * scale
    L, T = q.shape[1], s.shape[-1]
    if causal:
        visible = np.arange(T)[None, :] <= np.arange(T - L, T)[:, None]
        s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    S, N = len(sink_k), len(K_rot)
    o = p[..., :S] @ sink_v + (p[..., S : S + N] @ V_rot) @ H.T + p[..., S + N :] @ tail_v
    return o
