"""Attention over a KVarNCache without a float copy of its tiles, and the patch
that routes mlx-lm's attention entry point to it.

One softmax over sink + tiles + recent tokens (KVARN_SPEC 4, 7): tile scores
come from mx.quantized_matmul over the packed K codes with the rotated query,
times the token scales t; tile outputs from mx.quantized_matmul over the packed
V codes, times the channel scales c, summed over tiles and rotated back.
"""

import sys

import mlx.core as mx
from mlx_lm.models import base

from . import kernels, quant
from .cache import KVarNCache


def packed_attention(queries, cache: KVarNCache, scale, mask=None, sinks=None):
    """queries [B, Hq, L, D] (after RoPE) over everything in `cache`."""
    sk, sv, tiles, rk, rv = cache.attention_view()
    # This step's full-precision tokens are needed by this call only: keeping them
    # until the next update would hold a float copy of the tiles just quantized.
    cache._recent = None
    if cache._key_candidates is not None:  # "auto": decide key rotation with real queries
        B, Hq, L, D = queries.shape
        cache.decide_key_rotation((queries.astype(mx.float32) * scale).reshape(B, sk.shape[1], -1, D))
    c = cache.config
    if tiles is not None and sinks is None and (mask is None or mask == "causal") and kernels.use_metal():
        return kernels.packed_attention_metal(queries, sk, sv, *tiles, tiles[0].shape[2], rk, rv, scale,
                                              c.k_bits, c.v_bits, mask == "causal", cache.rotate_k, cache.rotate_v)
    return attend(queries, sk, sv, tiles, rk, rv, scale, c.k_bits, c.v_bits, cache.rotate_k, cache.rotate_v,
                  mask, sinks)


def attend(queries, sink_k, sink_v, tiles, recent_k, recent_v, scale, k_bits, v_bits,
           rotate_k=True, rotate_v=True, mask=None, sinks=None):
    """The MLX ops path: queries [B, Hq, L, D] over sink [B, H, S, D] + packed tiles
    (cache.py's _TILE_ARRAYS, or None) + recent [B, H, R, D]; one softmax.
    rotate_k may be a per-kv-head bool array."""
    B, Hq, L, D = queries.shape
    sk, sv, rk, rv = sink_k, sink_v, recent_k, recent_v
    H = next(x for x in (sk, rk, None if tiles is None else tiles[0]) if x is not None).shape[1]
    n_rep = Hq // H
    f32 = mx.float32
    # Query heads sharing a kv head become rows of one matrix: [B, H, n_rep*L, D].
    q = (queries.astype(f32) * scale).reshape(B, H, n_rep * L, D)

    scores, S, R = [], 0, 0
    if sk is not None:
        scores.append(q @ mx.swapaxes(sk, -1, -2).astype(f32))
        S = sk.shape[2]
    if tiles is not None:
        kw, ka, kb, kt, vw, va, vb, vc = tiles
        N, G = kt.shape[2], kt.shape[3]
        q_rot = quant.rotated_where(rotate_k, q, quant.rotate)
        s = mx.quantized_matmul(q_rot[:, :, None], kw, ka[..., None].astype(f32), kb[..., None].astype(f32),
                                transpose=False, group_size=G, bits=k_bits)
        s = s * kt[:, :, :, None, :].astype(f32)  # [B, H, N, n_rep*L, G]
        scores.append(mx.swapaxes(s, 2, 3).reshape(B, H, n_rep * L, N * G))
    if rk is not None:
        scores.append(q @ mx.swapaxes(rk, -1, -2).astype(f32))
        R = rk.shape[2]
    s = mx.concatenate(scores, axis=-1).reshape(B, H, n_rep, L, -1)
    T = s.shape[-1]

    s = _apply_mask(s, mask, Hq, H, n_rep)
    if sinks is not None:  # a learned logit per query head that takes softmax mass
        sink_logit = mx.broadcast_to(sinks.astype(f32).reshape(1, H, n_rep, 1, 1), (*s.shape[:-1], 1))
        p = mx.softmax(mx.concatenate([s, sink_logit], axis=-1), axis=-1, precise=True)[..., :T]
    else:
        p = mx.softmax(s, axis=-1, precise=True)
    p = p.reshape(B, H, n_rep * L, T)

    o = mx.zeros((B, H, n_rep * L, D), f32)
    if S:
        o = o + p[..., :S] @ sv.astype(f32)
    if R:
        o = o + p[..., T - R :] @ rv.astype(f32)
    if tiles is not None:
        p_tiles = mx.swapaxes(p[..., S : S + N * G].reshape(B, H, n_rep * L, N, G), 2, 3)
        o_rot = (_tile_values(p_tiles, vw, va, vb, v_bits, D) * vc[:, :, :, None, :].astype(f32)).sum(axis=2)
        o = o + (quant.unrotate(o_rot) if rotate_v else o_rot)
    return o.reshape(B, Hq, L, D).astype(queries.dtype)


def _tile_values(p, words, a, b, bits, D):
    """sum_g p[g] * (code[g, d] * a[g] + b[g]) per tile: [B, H, N, rows, D]."""
    gs = next((g for g in (128, 64, 32) if D % g == 0), None)
    if gs is None:  # no group size of mx.quantized_matmul fits D (e.g. 80)
        code = quant.unpack(words, bits).astype(mx.float32)
        return p @ (code * a[..., None].astype(mx.float32) + b[..., None].astype(mx.float32))
    # Per-token scales repeat over the D/gs groups of a row.
    rep = D // gs
    a = mx.repeat(a[..., None].astype(mx.float32), rep, axis=-1)
    b = mx.repeat(b[..., None].astype(mx.float32), rep, axis=-1)
    return mx.quantized_matmul(p, words, a, b, transpose=False, group_size=gs, bits=bits)


def _apply_mask(s, mask, Hq, H, n_rep):
    """Mask scores s [B, H, n_rep, L, T] with "causal", a boolean or an additive mask."""
    if mask is None:
        return s
    L, T = s.shape[-2:]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported mask {mask!r}")
        mask = mx.arange(T)[None, :] <= mx.arange(T - L, T)[:, None]
    elif mask.ndim == 4:  # [B or 1, Hq or 1, L, T]
        if mask.shape[1] == Hq and Hq > 1:
            mask = mask.reshape(mask.shape[0], H, n_rep, *mask.shape[2:])
        else:
            mask = mx.expand_dims(mask, 2)
    if mask.dtype == mx.bool_:
        return mx.where(mask, s, mx.finfo(s.dtype).min)
    return s + mask.astype(s.dtype)


# -- the patch ------------------------------------------------------------------

_original = base.scaled_dot_product_attention


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
    """mlx-lm's entry point, with KVarN caches routed to packed_attention."""
    if isinstance(cache, KVarNCache):
        return packed_attention(queries, cache, scale, mask, sinks)
    if sinks is not None:
        kwargs["sinks"] = sinks
    return _original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)


def _swap(old, new):
    base.scaled_dot_product_attention = new
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.") and getattr(module, "scaled_dot_product_attention", None) is old:
            module.scaled_dot_product_attention = new


def patch():
    """Route mlx-lm's scaled_dot_product_attention to packed_attention for KVarN
    caches, in mlx_lm.models.base and every loaded module holding it. Idempotent;
    run again after importing new model modules (make_cache does)."""
    _swap(_original, scaled_dot_product_attention)


def unpatch():
    _swap(scaled_dot_product_attention, _original)


def is_patched():
    return base.scaled_dot_product_attention is scaled_dot_product_attention
