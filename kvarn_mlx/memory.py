"""Bytes held by KV caches, and what mlx-lm's plain cache would hold instead.

Every figure comes from the arrays a cache holds (`nbytes` of real arrays);
the comparisons count the same tokens at the plain cache's element size.
"""

import functools

import mlx.core as mx

from .cache import KVarNCache


def _tokens_and_dims(c):
    """(B, H, tokens, Dk, Dv, K/V dtype) of a cache layer holding keys/values, else None."""
    if isinstance(c, KVarNCache):
        if c.empty():
            return None
        B, H, _, Dk = c.sink_k.shape
        return B, H, c.offset, Dk, c.sink_v.shape[-1], c.sink_k.dtype
    keys, values = getattr(c, "keys", None), getattr(c, "values", None)
    if (
        isinstance(keys, (tuple, list)) and keys and isinstance(keys[0], mx.array)
    ):  # QuantizedKVCache
        bits = c.bits
        B, H, cap, kw = keys[0].shape
        n = min(_offset(c), cap)
        return B, H, n, kw * 32 // bits, values[0].shape[-1] * 32 // bits, keys[1].dtype
    if isinstance(keys, mx.array) and isinstance(values, mx.array):
        B, H, cap, Dk = keys.shape
        return B, H, min(_offset(c), cap), Dk, values.shape[-1], keys.dtype
    return None


def _offset(c):
    off = getattr(c, "offset", 0)
    if isinstance(
        off, mx.array
    ):  # batched caches keep one offset per row; _idx is the write position
        return int(getattr(c, "_idx", off.max().item()))
    return int(off)


def _arrays(x):
    if isinstance(x, mx.array):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _arrays(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _arrays(y)


def layer_bytes(c) -> dict:
    """held: bytes of the arrays layer c holds, preallocated room included;
    unused: the preallocated room inside held; tokens: tokens stored;
    plain: what mlx-lm's KVCache would hold for those tokens in this layer's
    K/V dtype, unpadded; fp16: the same at 2 bytes per element.
    Layers that hold no keys/values (recurrent state) count as their own plain cache."""
    held = int(c.nbytes)
    dims = _tokens_and_dims(c)
    if dims is None:
        if isinstance(c, KVarNCache) or hasattr(
            c, "keys"
        ):  # a key/value cache before its first token
            return {"held": held, "unused": held, "tokens": 0, "plain": 0, "fp16": 0}
        fp16 = sum(2 * x.size for x in _arrays(c.state))
        return {"held": held, "unused": 0, "tokens": 0, "plain": held, "fp16": fp16}
    B, H, n, Dk, Dv, dtype = dims
    elements = B * H * n * (Dk + Dv)
    if isinstance(c, KVarNCache):
        unused = c.nbytes_breakdown()["unused"]
    elif isinstance(c.keys, mx.array):
        unused = held - elements * c.keys.dtype.size
    else:  # quantized: the room beyond the stored tokens in every array
        arrays = [*c.keys, *c.values]
        unused = held - sum(x.nbytes * n // x.shape[2] for x in arrays)
    return {
        "held": held,
        "unused": int(unused),
        "tokens": n,
        "plain": elements * dtype.size,
        "fp16": elements * 2,
    }


def cache_bytes(caches) -> dict:
    """layer_bytes summed over the layers, plus kvarn_layers, layers, tiles (the most
    quantized tiles of any KVarN layer; 0 before the first), ratio_plain = plain / held
    and ratio_fp16 = fp16 / held (0.0 while nothing is held)."""
    out = {"held": 0, "unused": 0, "tokens": 0, "plain": 0, "fp16": 0}
    for c in caches:
        for k, v in layer_bytes(c).items():
            out[k] += v
    kvarn = [c for c in caches if isinstance(c, KVarNCache)]
    out.update(
        kvarn_layers=len(kvarn),
        layers=len(caches),
        tiles=max((c.n_tiles for c in kvarn), default=0),
    )
    held = out["held"]
    out["ratio_plain"] = out["plain"] / held if held else 0.0
    out["ratio_fp16"] = out["fp16"] / held if held else 0.0
    return out


@functools.lru_cache(maxsize=64)
def saving_starts_at(config, head_dim: int, dtype_bytes: int) -> int:
    """The first token count from which a KVarN layer, filled one token at a time,
    holds fewer bytes than the plain cache's unpadded keys and values in a dtype
    of dtype_bytes bytes, and keeps holding fewer from there on.

    Measured on a real one-head cache: array bytes depend on shapes only, so
    nothing is computed (the quantization stays an unevaluated graph)."""
    dtype = {2: mx.float16, 4: mx.float32}.get(dtype_bytes)
    if dtype is None:
        raise ValueError(f"dtype_bytes={dtype_bytes}: use 2 (float16/bfloat16) or 4 (float32)")
    G = config.group_size
    cache = KVarNCache(config)
    k = mx.zeros((1, 1, 1, head_dim), dtype)
    # Once below for a whole storage-growth period (step_tiles tiles and the tail
    # after them), every later period only adds saving: each tile saves bytes and
    # the room added per period is the same.
    period = (cache.step_tiles + 1) * G
    start, n = None, 0
    while True:
        n += 1
        cache.update_and_fetch(k, k)
        below = cache.nbytes < 2 * n * head_dim * dtype_bytes
        if below and start is None:
            start = n
        elif not below:
            start = None
        if start is not None and n - start >= period:
            return start
        if n % 64 == 0:
            mx.eval(cache.held_arrays())  # keeps the graph short


def kv_dtype(cache):
    """The dtype the cache keeps full-precision keys in (the model's), or None while empty."""
    for c in cache:
        for name in ("sink_k", "keys"):
            x = getattr(c, name, None)
            if isinstance(x, mx.array):
                return x.dtype
    return None


def sequence_summary(cache) -> dict:
    """cache_bytes (tokens: the sequence's, the most any layer holds) plus what a memory
    panel says before the first tile: the dtype full-precision tokens are held in (the plain
    cache's) and saving_from, the token from which the first KVarN layer holds less than the
    plain cache (None without KVarN layers, or while the cache is empty)."""
    out = cache_bytes(cache)
    out["tokens"] = max(
        (layer_bytes(c)["tokens"] for c in cache), default=0
    )  # of the sequence, not summed
    dtype = kv_dtype(cache)
    kvarn = [c for c in cache if isinstance(c, KVarNCache) and not c.empty()]
    out["dtype"] = None if dtype is None else str(dtype).removeprefix("mlx.core.")
    out["saving_from"] = None
    if kvarn and dtype is not None:
        c = kvarn[0]
        out["saving_from"] = saving_starts_at(c.config, c.sink_k.shape[-1], dtype.size)
    return out
