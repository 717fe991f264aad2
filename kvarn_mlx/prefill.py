"""Attention of a prefill chunk: the layer's tiles dequantized into one
transient full-precision buffer, then mx.fast.scaled_dot_product_attention.

A chunk of many query tokens does as much work per key as the plain cache's
attention; reading the keys through the packed path (quantized matmuls, see
attention.py) costs more than dequantizing them once. The buffer is sink +
tiles + recent tokens in token order, in the model's dtype: one layer's
context, referenced by nothing once the attention call is built, so MLX frees
it when that layer's attention has run. The tiles are unrotated back to the
model's space (docs/algorithm.md, "Rotation"): one D x D matmul per
dequantized row, small next to the chunk's attention over it and cheaper than
rotating the chunk's queries (GQA: more query rows than key rows), the sink and
the recent tokens, and unrotating the output. The attention is
the one the cache defines (one softmax over sink, tiles [0, n_tiles) and the
recent tokens in full precision); only the order of float operations differs.

Decode steps (few query tokens) keep the packed path: there, dequantizing
every key costs as much as attending to it.
"""

import mlx.core as mx

from . import fp8, quant
from .tiles import StepView

# Query tokens from which a step attends through the dequantized buffer, per
# device type. Measured with `python benchmarks/kernels.py --chunks`: "cpu" on
# Linux x86-64 (2 cores, OpenBLAS), where the dequantized path is faster from
# a few query tokens on. "gpu": the Metal attention kernel serves up to 8
# query tokens; longer chunks on Metal otherwise take the quantized-matmul
# ops path, which materializes the scores, where the fused
# scaled_dot_product_attention does not.
MIN_QUERIES = {"cpu": 16, "gpu": 9}


def use_dequantized(queries, view: StepView) -> bool:
    """Whether this step attends through the dequantized buffer."""
    if view.tiles is None or view.n_tiles == 0:
        return True  # nothing to dequantize: one fused call over sink + recent tokens
    return queries.shape[2] >= MIN_QUERIES.get(mx.default_device().type.name, MIN_QUERIES["gpu"])


def dequantized(view: StepView, dtype=None):
    """The view's keys and values in token order, [B, H, S + n_tiles*G + R, D],
    in `dtype` (default: the sink's dtype)."""
    dtype = view.sink_k.dtype if dtype is None else dtype
    ks, vs = [view.sink_k], [view.sink_v]
    if view.tiles is not None and view.n_tiles:
        k, v = dequantize_tiles(view)
        ks.append(k)
        vs.append(v)
    ks.append(view.recent_k)
    vs.append(view.recent_v)
    return (
        mx.concatenate([x.astype(dtype) for x in ks], axis=2),
        mx.concatenate([x.astype(dtype) for x in vs], axis=2),
    )


def dequantize_tiles(view: StepView):
    """Tiles [0, n_tiles) as unrotated float32 K, V [B, H, n_tiles*G, D]: the
    codes through mx.dequantize, the absorbed per-token (K) / per-channel (V)
    scales (docs/algorithm.md, "Absorbed scales"), the unrotation as one matmul.
    The same values as Tiles.dequantize up to float rounding."""
    t = view.tiles.valid(view.n_tiles)
    ka, kb, kt, va, vb, vc = (fp8.to_float32(s) for s in (t.k_a, t.k_b, t.k_t, t.v_a, t.v_b, t.v_c))
    B, H, n, D, G = *ka.shape, kt.shape[-1]
    # K codes are packed along tokens: rows are channels, one group of G per row.
    k = mx.dequantize(t.k_words, ka[..., None], kb[..., None], group_size=G, bits=view.k_bits)
    k = mx.swapaxes(k, -1, -2).reshape(B, H, n * G, D)
    k = _unrotate(k, view.rotate_k) * kt.reshape(B, H, n * G, 1)
    v = _dequantize_value_codes(t.v_words, va, vb, view.v_bits, D) * vc[..., None, :]
    return k, _unrotate(v.reshape(B, H, n * G, D), view.rotate_v)


def _unrotate(x, flag):
    """Rows of x [B, H, T, D] taken back from the rotated space (x -> x H^T) as a
    matmul, for every kv head (flag True), none, or those of a per-head bool array."""
    if not isinstance(flag, mx.array) and not flag:
        return x
    B, H, T, D = x.shape
    eye = mx.eye(D, dtype=mx.float32)
    m = quant.unrotate(eye)
    if isinstance(flag, mx.array):
        return x @ mx.where(flag.reshape(H, 1, 1), m, eye)
    return (x.reshape(-1, D) @ m).reshape(B, H, T, D)


def _dequantize_value_codes(words, a, b, bits, D):
    """code * a + b of value tiles (float32 a, b [B, H, n, G]): [B, H, n, G, D] float32."""
    groups = quant.row_groups(a, b, D)
    if groups is None:
        return quant.unpack(words, bits).astype(mx.float32) * a[..., None] + b[..., None]
    gs, a, b = groups
    return mx.dequantize(words, a, b, group_size=gs, bits=bits)


# Bytes of float32 attention scores one block of a chunk's query rows may
# materialize. Where scaled_dot_product_attention is not fused (CPU) it holds
# the whole [B, Hq, L, N] score matrix a few times over, which at long context
# outweighs the cache itself (2,048 queries over 32K keys, 4 heads: 512 MiB a
# copy). Blocks of rows keep the prefill's transient near 4 x SCORE_BYTES, and
# on CPU run slightly faster than one call.
SCORE_BYTES = 16 * 2**20


def query_block(B, Hq, N):
    """Query rows per block so that B x Hq x rows x N float32 scores fit SCORE_BYTES."""
    return max(16, SCORE_BYTES // (4 * B * Hq * max(N, 1)) // 16 * 16)


def attend_dequantized(queries, view: StepView, scale, mask=None, sinks=None):
    """queries [B, Hq, L, D] over the view through mx.fast.scaled_dot_product_attention
    on its dequantized keys and values, in the queries' dtype; mask and sinks as
    mlx-lm passes them ("causal", an array over all key positions, or None).
    Long chunks attend in blocks of query rows (query_block), one after the
    other: each block's queries depend on the previous block's output, or MLX
    would run every block's score matmul before any softmax and hold them all.
    Under the causal mask a block reads only the keys up to its last row."""
    k, v = dequantized(view, queries.dtype)
    B, Hq, L, _ = queries.shape
    N = k.shape[2]
    rows = query_block(B, Hq, N)
    if L <= rows:
        return mx.fast.scaled_dot_product_attention(
            queries, k, v, scale=scale, mask=mask, sinks=sinks
        )
    causal = isinstance(mask, str) and mask == "causal"
    out = []
    for i in range(0, L, rows):
        j = min(L, i + rows)
        n = N - L + j if causal else N  # causal: the keys after row j are masked anyway
        m = mask
        if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == L:
            m = mask[..., i:j, :]
        q = queries[:, :, i:j] if not out else mx.depends(queries[:, :, i:j], out[-1])
        out.append(
            mx.fast.scaled_dot_product_attention(
                q, k[:, :, :n], v[:, :, :n], scale=scale, mask=m, sinks=sinks
            )
        )
    return mx.concatenate(out, axis=2)
