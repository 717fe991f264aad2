"""Attention over a KVarN cache's packed tiles, without a float copy of them.

One softmax over sink + tiles + recent tokens (docs/algorithm.md, "Absorbed
scales"): tile scores come from mx.quantized_matmul over the packed K codes
with the rotated query, times the token scales t; tile outputs from
mx.quantized_matmul over the packed V codes, times the channel scales c, summed
over tiles and rotated back. Tile storage is tile-major, so the step's valid
tiles are a contiguous view that quantized_matmul reads as it is; the Metal
kernel gets the whole storage and the count of valid tiles.
"""

from dataclasses import replace

import mlx.core as mx

from . import dispatch, fp8, kernels, prefill, quant, rotation
from .tiles import StepView, TileStorage


def packed_attention(queries, cache, scale, mask=None, sinks=None):
    """queries [B, Hq, L, D] (after RoPE) over everything in a KVarNCache."""
    if cache.key_candidates is not None:  # "auto": decide key rotation with real queries
        B, Hq, L, D = queries.shape
        H = cache.sink_k.shape[1]
        r = cache.decide_row  # a short step: the row after the tiles, as in one-token decoding
        q = queries[:, :, : rotation.DECIDE_ROWS] if r is None else queries[:, :, r : r + 1]
        cache.decide_key_rotation((q.astype(mx.float32) * scale).reshape(B, H, -1, D))
    view = cache.step_view()
    out = attend_view(queries, view, scale, mask, sinks)
    if cache.n_tiles > view.n_tiles:
        # Tiles quantized in this step: evaluating the step's output (what every
        # generation loop does) quantizes them now, not in a later step that reads them.
        out = mx.depends(out, list(cache.tiles.arrays()))
    return out


def attend_view(queries, view: StepView, scale, mask=None, sinks=None):
    """Chunks of many queries (or no tile yet) through the dequantized buffer
    (prefill.py); else the Metal kernel where it runs and supports this step,
    else the MLX ops path."""
    if view.after_tile is not None and mask == "causal":
        return _split_step(queries, view, scale, sinks)
    if prefill.use_dequantized(queries, view):
        return prefill.attend_dequantized(queries, view, scale, mask, sinks)
    plain_mask = mask is None or (isinstance(mask, str) and mask == "causal")
    if view.tiles is not None and sinks is None and plain_mask and dispatch.use_metal():
        reason = kernels.attention_unsupported(queries, view)
        if reason is None:
            return kernels.packed_attention_metal(queries, view, scale, mask == "causal")
        dispatch.fallback("attention", reason)
    if COMPILE and view.recent_room is not None and mask is None and sinks is None:
        return _attend_compiled(queries, view, scale)
    return attend(queries, view, scale, mask, sinks)


# Decode steps on the MLX ops path run attend() through mx.compile: traced once
# per shape, then replayed from C++ (a third of the host time of building the
# ops from Python), with its elementwise ops fused on the CPU. The recent tokens
# are passed as the whole tail buffer (view.recent_room) with their count as an
# array, so the shapes change once per tile and per tail_step tokens, not at
# every step. False: attend() as it is, every step.
COMPILE = True


def _attend_arrays(q, sk, sv, rk, rv, recent_len, rotate_k, arrays, n, bits, rotate_v, scale, _):
    view = StepView(sk, sv, TileStorage(*arrays, count=n), n, rk, rv, *bits, rotate_k, rotate_v)
    return attend(q, view, scale, recent_len=recent_len)


_compiled = dispatch.Compiled(_attend_arrays)  # a long generation's old shapes dropped
_counts = {}  # recent token count -> that count as an int32 array, made once


def _attend_compiled(queries, view, scale):
    R = view.recent_k.shape[2]
    count = _counts.get(R)
    if count is None:
        count = _counts[R] = mx.array(R, dtype=mx.int32)
        mx.eval(count)
    return _compiled(
        queries,
        view.sink_k,
        view.sink_v,
        *view.recent_room,
        count,
        view.rotate_k,
        view.tiles.arrays(),
        view.n_tiles,
        (view.k_bits, view.v_bits),
        view.rotate_v,
        float(scale),
        trace_streams(view.n_tiles, queries.shape[0]),
    )


def _split_step(queries, view, scale, sinks):
    """A short step that completed a tile: rows before view.after_tile_row read its tokens
    in full precision, the later rows read it quantized (view.after_tile). Each row
    then sees what it would have seen decoding one token at a time."""
    L, a = queries.shape[2], view.after_tile_row
    n = L - a  # the later rows' tokens, which the first rows do not see
    first = replace(
        view,
        recent_k=view.recent_k[..., :-n, :],
        recent_v=view.recent_v[..., :-n, :],
        after_tile=None,
    )
    causal = lambda rows: "causal" if rows > 1 else None
    return mx.concatenate(
        [
            attend_view(queries[:, :, :a], first, scale, causal(a), sinks),
            attend_view(queries[:, :, a:], view.after_tile, scale, causal(n), sinks),
        ],
        axis=2,
    )


def attend(queries, view: StepView, scale, mask=None, sinks=None, recent_len=None):
    """The MLX ops path: queries [B, Hq, L, D] over the view's sink [B, H, S, D],
    tiles [0, n_tiles) of its storage and recent tokens [B, H, R, D]; one softmax.

    Each part (sink, a range of tiles, recent) gives its own maximum, sum and
    output, merged as in flash decoding; tile scores stay in the storage's
    tile-major layout, and on the CPU the tile ranges run on separate streams,
    one per core (MLX's CPU quantized_matmul uses one thread). recent_len (an
    int32 array, with mask None): only the first recent_len recent tokens are
    real, the rest of recent_k/v is room."""
    B, Hq, L, D = queries.shape
    sk, sv, rk, rv = view.sink_k, view.sink_v, view.recent_k, view.recent_v
    H = sk.shape[1]
    n_rep = Hq // H
    rows = n_rep * L
    f32 = mx.float32
    # Query heads sharing a kv head become rows of one matrix: [B, H, n_rep*L, D].
    q = (queries.astype(f32) * scale).reshape(B, H, rows, D)
    tiles = view.tiles if view.n_tiles else None
    n, G = (view.n_tiles, tiles.group_size) if tiles is not None else (0, 0)
    S, R = sk.shape[2], rk.shape[2]
    mask_sink, mask_tiles, mask_recent = _split_mask(mask, L, (S, n, G, R), Hq, H, n_rep)
    if recent_len is not None:
        mask_recent = mx.arange(R) < recent_len

    def dense(k, v, m):
        s = _apply_mask((q @ mx.swapaxes(k, -1, -2).astype(f32)).reshape(B, H, n_rep, L, -1), m)
        return _softmax_part(s.reshape(B, H, rows, -1), lambda e: e @ v.astype(f32))

    parts = []  # (max, sum, output) [B, H, rows, 1 | 1 | D] per non-empty part
    if S:
        parts.append(dense(sk, sv, mask_sink))
    if tiles is not None:
        q_rot = quant.rotated_where(view.rotate_k, q, quant.rotate)[None]
        tile_parts = []
        for (lo, hi), stream in _tile_ranges(n, B):
            with mx.stream(stream):
                m_t = None if mask_tiles is None else mask_tiles[lo:hi]
                tile_parts.append(_tile_part(q_rot, tiles, lo, hi, view, m_t, (B, H, n_rep, L)))
        m, total, o_rot = _merge(tile_parts)
        parts.append((m, total, quant.unrotate(o_rot) if view.rotate_v else o_rot))
    if R:
        parts.append(dense(rk, rv, mask_recent))
    if sinks is not None:  # a learned sink logit per query head: takes mass, adds no value
        sink_logit = mx.broadcast_to(
            sinks.astype(f32).reshape(1, H, n_rep, 1), (B, H, n_rep, L)
        ).reshape(B, H, rows, 1)
        parts.append((sink_logit, mx.ones_like(sink_logit), mx.zeros((B, H, rows, D), f32)))
    m, total, o = _merge(parts)
    return (o / total).reshape(B, Hq, L, D).astype(queries.dtype)


def _softmax_part(s, values, axes=-1):
    """Scores s' maximum over `axes`, the sum of their exponentials and values(e)."""
    # A fully masked part must not give exp(-inf - -inf): its weight in the merge is 0 anyway.
    m = mx.maximum(s.max(axis=axes, keepdims=True), mx.finfo(mx.float32).min)
    e = mx.exp(s - m)
    return m, e.sum(axis=axes, keepdims=True), values(e)


def _tile_part(q_rot, tiles, lo, hi, view, mask, shape):
    """Tiles [lo, hi): (max, sum, output in the rotated basis), [B, H, rows, 1 | 1 | D];
    q_rot [1, B, H, rows, D]."""
    B, H, n_rep, L = shape
    k = hi - lo
    G, D = tiles.group_size, q_rot.shape[-1]
    # quantized_matmul's scales as float32; the token and channel scales multiply float32
    # products, which promote them (a cast mx.compile fuses into the product)
    ka, kb = (fp8.to_float32(x[lo:hi]) for x in (tiles.k_a, tiles.k_b))
    kt = fp8.decoded(tiles.k_t[lo:hi])
    st = mx.quantized_matmul(
        q_rot,
        tiles.k_words[lo:hi],
        ka[..., None],
        kb[..., None],
        transpose=False,
        group_size=G,
        bits=view.k_bits,
    )
    st = st * kt[:, :, :, None, :]  # [k, B, H, rows, G]
    if mask is not None:
        st = _apply_mask(st.reshape(k, B, H, n_rep, L, G), mask).reshape(k, B, H, n_rep * L, G)

    def values(e):
        v = (
            _tile_values(e, tiles, lo, hi, view.v_bits, D)
            * fp8.decoded(tiles.v_c[lo:hi])[:, :, :, None, :]
        )
        return v.sum(axis=0)

    m, total, o = _softmax_part(st, values, axes=(0, -1))
    return m[0], total[0], o


def _merge(parts):
    """One softmax from parts' (max, sum, output): rescale each to the shared maximum."""
    if len(parts) == 1:
        return parts[0]
    m = parts[0][0]
    for p in parts[1:]:
        m = mx.maximum(m, p[0])
    total = o = 0
    for m_p, total_p, o_p in parts:
        w = mx.exp(m_p - m)
        total = total + w * total_p
        o = o + w * o_p
    return m, total, o


# On the CPU, tiles split into ranges, one per stream (dispatch.cpu_streams), with
# at least MIN_STREAM_TILES tiles of every batch row together in a range: MLX's CPU
# quantized_matmul uses one thread.
MIN_STREAM_TILES = 4


def stream_count(n, rows=1):
    """The streams for n tiles of `rows` batch rows (each range at least one tile)."""
    return min(n, n * rows // MIN_STREAM_TILES)


def trace_streams(n, rows):
    """The names of the streams attend() splits n tiles of `rows` batch rows over: a
    compiled attention takes them as an input, since a trace replays the streams it
    ran on (a trace per thread's streams)."""
    return tuple(map(str, dispatch.cpu_streams(stream_count(n, rows))))


def _tile_ranges(n, rows=1):
    """[((lo, hi), stream)] covering tiles [0, n) of `rows` batch rows: one range per stream."""
    streams = dispatch.cpu_streams(stream_count(n, rows))
    cuts = [n * i // len(streams) for i in range(len(streams) + 1)]
    return [((cuts[i], cuts[i + 1]), s) for i, s in enumerate(streams)]


def _tile_values(p, tiles, lo, hi, bits, D):
    """sum_g p[g] * (code[g, d] * a[g] + b[g]) over tiles [lo, hi), p [k, B, H, rows, G]:
    [k, B, H, rows, D]."""
    words = tiles.v_words[lo:hi]
    a, b = (fp8.to_float32(x[lo:hi]) for x in (tiles.v_a, tiles.v_b))
    groups = quant.row_groups(a, b, D)
    if groups is None:
        code = quant.unpack(words, bits).astype(mx.float32)
        return p @ (code * a[..., None] + b[..., None])
    gs, a, b = groups
    return mx.quantized_matmul(p, words, a, b, transpose=False, group_size=gs, bits=bits)


def _split_mask(mask, L, widths, Hq, H, n_rep):
    """A mask over all key positions, split for the sink, tile and recent parts:
    [B or 1, H or 1, n_rep or 1, L, cols] each, the tiles' [n, B or 1, ..., L, G];
    None where nothing is masked."""
    if mask is None:
        return None, None, None
    S, n, G, R = widths
    T = S + n * G + R
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported mask {mask!r}")
        if L <= R:  # the queries are the newest tokens: only the recent part is masked
            return None, None, mx.arange(R)[None, :] <= mx.arange(R - L, R)[:, None]
        mask = mx.arange(T)[None, :] <= mx.arange(T - L, T)[:, None]
    if mask.ndim == 4 and mask.shape[1] == Hq and Hq > 1:  # [B or 1, Hq, L, T]
        mask = mask.reshape(mask.shape[0], H, n_rep, *mask.shape[2:])
    else:  # [L, T] or [B or 1, 1, L, T]
        mask = (
            mask.reshape(*([1] * (5 - mask.ndim)), *mask.shape)
            if mask.ndim < 4
            else mx.expand_dims(mask, 2)
        )
    tiles = mask[..., S : S + n * G]
    tiles = mx.moveaxis(tiles.reshape(*tiles.shape[:-1], n, G), -2, 0) if n else None
    return mask[..., :S], tiles, mask[..., S + n * G :]


def _apply_mask(s, mask):
    """Mask scores s [..., L, cols] with a boolean or an additive mask that broadcasts to them."""
    if mask is None:
        return s
    if mask.dtype == mx.bool_:
        return mx.where(mask, s, mx.finfo(s.dtype).min)
    return s + mask.astype(s.dtype)
