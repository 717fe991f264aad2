"""Attention over a KVarN cache's packed tiles, without a float copy of them.

One softmax over sink + tiles + recent tokens (docs/algorithm.md, "Absorbed
scales"): tile scores come from mx.quantized_matmul over the packed K codes
with the rotated query, times the token scales t; tile outputs from
mx.quantized_matmul over the packed V codes, times the channel scales c, summed
over tiles and rotated back. Both paths read the tile storage in place, over
its whole capacity, with the tiles past the step's valid ones masked out.
"""

import mlx.core as mx

from . import dispatch, kernels, quant
from .tiles import StepView


def packed_attention(queries, cache, scale, mask=None, sinks=None):
    """queries [B, Hq, L, D] (after RoPE) over everything in a KVarNCache."""
    if cache.key_candidates is not None:  # "auto": decide key rotation with real queries
        B, Hq, L, D = queries.shape
        H = cache.sink_k.shape[1]
        cache.decide_key_rotation((queries.astype(mx.float32) * scale).reshape(B, H, -1, D))
    return attend_view(queries, cache.step_view(), scale, mask, sinks)


def attend_view(queries, view: StepView, scale, mask=None, sinks=None):
    """The Metal kernel where it runs and supports this step, else the MLX ops path."""
    if view.tiles is not None and sinks is None and (mask is None or mask == "causal") and dispatch.use_metal():
        reason = kernels.attention_unsupported(queries, view)
        if reason is None:
            return kernels.packed_attention_metal(queries, view, scale, mask == "causal")
        dispatch.fallback("attention", reason)
    return attend(queries, view, scale, mask, sinks)


def attend(queries, view: StepView, scale, mask=None, sinks=None):
    """The MLX ops path: queries [B, Hq, L, D] over the view's sink [B, H, S, D],
    tiles [0, n_tiles) of its storage and recent tokens [B, H, R, D]; one softmax."""
    B, Hq, L, D = queries.shape
    sk, sv, rk, rv, tiles = view.sink_k, view.sink_v, view.recent_k, view.recent_v, view.tiles
    H = sk.shape[1]
    n_rep = Hq // H
    f32 = mx.float32
    # Query heads sharing a kv head become rows of one matrix: [B, H, n_rep*L, D].
    q = (queries.astype(f32) * scale).reshape(B, H, n_rep * L, D)

    S, R = sk.shape[2], rk.shape[2]
    scores = [q @ mx.swapaxes(sk, -1, -2).astype(f32)]
    if tiles is not None:
        N, G = tiles.capacity, tiles.group_size
        q_rot = quant.rotated_where(view.rotate_k, q, quant.rotate)
        s = mx.quantized_matmul(q_rot[:, :, None], tiles.k_words, tiles.k_a[..., None].astype(f32),
                                tiles.k_b[..., None].astype(f32), transpose=False, group_size=G, bits=view.k_bits)
        s = s * tiles.k_t[:, :, :, None, :].astype(f32)  # [B, H, N, n_rep*L, G]
        s = mx.swapaxes(s, 2, 3).reshape(B, H, n_rep * L, N * G)
        if view.n_tiles < N:  # storage past the step's tiles: room, or tiles quantized this step
            s = mx.where(mx.arange(N * G) < view.n_tiles * G, s, mx.finfo(f32).min)
        scores.append(s)
    scores.append(q @ mx.swapaxes(rk, -1, -2).astype(f32))
    s = mx.concatenate(scores, axis=-1).reshape(B, H, n_rep, L, -1)
    T = s.shape[-1]

    if tiles is not None and view.n_tiles < N and mask is not None:
        # Masks are over token positions; the storage past the valid tiles is not.
        n = S + view.n_tiles * G
        if isinstance(mask, str):
            mask = _causal(mask, L, n + R)
        mask = _widen(mask, n, (N - view.n_tiles) * G)
    s = _apply_mask(s, mask, Hq, H, n_rep)
    if sinks is not None:  # a learned logit per query head that takes softmax mass
        sink_logit = mx.broadcast_to(sinks.astype(f32).reshape(1, H, n_rep, 1, 1), (*s.shape[:-1], 1))
        p = mx.softmax(mx.concatenate([s, sink_logit], axis=-1), axis=-1, precise=True)[..., :T]
    else:
        p = mx.softmax(s, axis=-1, precise=True)
    p = p.reshape(B, H, n_rep * L, T)

    o = p[..., :S] @ sv.astype(f32) + p[..., T - R :] @ rv.astype(f32)
    if tiles is not None:
        p_tiles = mx.swapaxes(p[..., S : S + N * G].reshape(B, H, n_rep * L, N, G), 2, 3)
        o_rot = _tile_values(p_tiles, tiles, view.v_bits, D) * tiles.v_c[:, :, :, None, :].astype(f32)
        o_rot = o_rot.sum(axis=2)
        o = o + (quant.unrotate(o_rot) if view.rotate_v else o_rot)
    return o.reshape(B, Hq, L, D).astype(queries.dtype)


def _tile_values(p, tiles, bits, D):
    """sum_g p[g] * (code[g, d] * a[g] + b[g]) per tile: [B, H, N, rows, D]."""
    words, a, b = tiles.v_words, tiles.v_a, tiles.v_b
    gs = next((g for g in (128, 64, 32) if D % g == 0), None)
    if gs is None:  # no group size of mx.quantized_matmul fits D (e.g. 80)
        code = quant.unpack(words, bits).astype(mx.float32)
        return p @ (code * a[..., None].astype(mx.float32) + b[..., None].astype(mx.float32))
    # Per-token scales repeat over the D/gs groups of a row.
    rep = D // gs
    a = mx.repeat(a[..., None].astype(mx.float32), rep, axis=-1)
    b = mx.repeat(b[..., None].astype(mx.float32), rep, axis=-1)
    return mx.quantized_matmul(p, words, a, b, transpose=False, group_size=gs, bits=bits)


def _widen(mask, at, n):
    """An array mask over [sink, valid tiles, recent] with n columns inserted at
    `at` for the storage past the valid tiles (masked out by the scores already)."""
    fill = mx.ones if mask.dtype == mx.bool_ else mx.zeros
    room = fill((*mask.shape[:-1], n), mask.dtype)
    return mx.concatenate([mask[..., :at], room, mask[..., at:]], axis=-1)


def _causal(mask, L, T):
    """The boolean [L, T] mask of L queries that are the last L of T positions."""
    if mask != "causal":
        raise ValueError(f"unsupported mask {mask!r}")
    return mx.arange(T)[None, :] <= mx.arange(T - L, T)[:, None]


def _apply_mask(s, mask, Hq, H, n_rep):
    """Mask scores s [B, H, n_rep, L, T] with "causal", a boolean or an additive mask."""
    if mask is None:
        return s
    L, T = s.shape[-2:]
    if isinstance(mask, str):
        mask = _causal(mask, L, T)
    elif mask.ndim == 4:  # [B or 1, Hq or 1, L, T]
        if mask.shape[1] == Hq and Hq > 1:
            mask = mask.reshape(mask.shape[0], H, n_rep, *mask.shape[2:])
        else:
            mask = mx.expand_dims(mask, 2)
    if mask.dtype == mx.bool_:
        return mx.where(mask, s, mx.finfo(s.dtype).min)
    return s + mask.astype(s.dtype)
