"""Byte models: how many bytes a model's KV caches hold at n tokens, from the caches' own
growth rules measured on real caches. The planner (plan.py) and the runtime's memory
budget (budget.py) read them; sizes are parsed and printed here too.

A model's cache layers come from its prompt cache after one token went through it
(lazily: nothing is computed). Small caches of those classes and shapes are then filled
and asked for nbytes (shapes fix nbytes, so nothing is computed either), and each
layer's growth rule carries the bytes to any context:
  KVCache, QuantizedKVCache  room added `step` (256) tokens at a time: up to
                             step - 1 tokens of room (Steps)
  RotatingKVCache            at most the window while decoding; while a prompt
                             longer than the window is prefilled, window - 1 plus
                             one prefill chunk (Window)
  KVarNCache                 the sink, the tile storage (a whole number of step_tiles
                             tiles) and a tail buffer rounded up to tail_step tokens:
                             tail_tokens and under a tile, or tail_tokens, a tile and up
                             to tail_step tokens while a finished tile waits for its
                             commit turn (SinkTilesTail)
  other (recurrent) caches   the fixed state the model made for one token (Fixed)
Room depends on the order the tokens came in (prompt chunks, decode steps); peak(n)
is the most any order leaves.
"""

import re
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from .cache import KVarNCache

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
MLX_KV_GROUP_SIZE = 64  # mlx_lm.generate's --kv-group-size default
PREFILL_STEP_SIZE = 2048  # mlx_lm.generate's prefill_step_size default


class PlanError(ValueError):
    """Input the planner or a memory budget cannot use; the message names the fix."""


# -- sizes -----------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text):
    """'24GB', '24G', '24GiB', '512MB', '1e9' -> bytes. K/M/G/T are powers of 1024
    (a "24GB" Mac has 24 x 2^30 bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if not m:
        raise PlanError(f"cannot read {text!r} as a size; write e.g. 24GB, 1.5GiB or 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def human(n):
    """Bytes as B/KiB/MiB/GiB/TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# -- the model's cache layers --------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    """One cache layer of the model as mlx-lm makes it."""

    kind: str  # "kv" (KVCache), "window" (RotatingKVCache) or "state" (anything fixed-size)
    heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    dtype: str = ""
    window: int = 0
    keep: int = 0
    state_bytes: int = 0
    top_level: bool = (
        True  # not inside a CacheList (mlx-lm's --kv-bits quantizes only top-level caches)
    )
    cls: str = ""


def flat_caches(caches):
    """(cache, top level?) for every cache layer, CacheList members in order."""
    for c in caches:
        if isinstance(c, CacheList):
            yield from ((m, False) for m in c.caches)
        else:
            yield c, True


def model_layers(model):
    """The model's cache layers: its prompt cache after one token went through the
    model (lazily: nothing is evaluated)."""
    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    layers = []
    for c, top in flat_caches(caches):
        name = type(c).__name__
        if type(c) in (KVCache, RotatingKVCache):
            _, H, _, Dk = c.keys.shape
            kv = dict(
                heads=H,
                k_dim=Dk,
                v_dim=c.values.shape[-1],
                dtype=str(c.keys.dtype).split(".")[-1],
                top_level=top,
                cls=name,
            )
            if type(c) is KVCache:
                layers.append(Layer("kv", **kv))
            else:
                layers.append(Layer("window", window=c.max_size, keep=c.keep, **kv))
        elif isinstance(c, ArraysCache):
            layers.append(Layer("state", state_bytes=c.nbytes, top_level=top, cls=name))
        else:
            raise PlanError(
                f"the planner does not know how a {name} layer grows (it knows KVCache, "
                "RotatingKVCache and fixed-size recurrent caches)"
            )
    return layers


# -- bytes of one layer at n tokens, from real caches ------------------------------------


def _round_up(n, step):
    return -(-n // step) * step


@dataclass(frozen=True)
class Steps:
    """KVCache, QuantizedKVCache: room is added `step` tokens at a time, after
    cutting the buffer back to the tokens held; a chunk that arrives off a step
    boundary (a second prompt, a decode step after it) leaves up to step - 1 tokens of room."""

    token_bytes: int
    step: int

    per_token = property(lambda self: self.token_bytes)

    def peak(self, n):
        return self.token_bytes * (n + self.step - 1) if n else 0


@dataclass(frozen=True)
class Window:
    """RotatingKVCache: decoding holds at most the window (room added `step` tokens
    at a time below it); a prefill chunk of L tokens past the window is appended to
    the newest window - 1 tokens, so it holds up to window - 1 + prefill tokens."""

    token_bytes: int
    window: int
    step: int
    prefill: int

    per_token = 0

    def peak(self, n):
        if n == 0:
            return 0
        return self.token_bytes * max(
            min(n + self.step - 1, self.window), min(n, self.window - 1 + self.prefill)
        )


@dataclass(frozen=True)
class SinkTilesTail:
    """KVarNCache: sink tokens, a tile storage whose capacity is the most tiles held
    rounded up to step_tiles, and a tail buffer grown tail_step tokens at a time.
    The tail holds `tail` (the config's tail_tokens) and under a tile more, or, while
    a tile a short step finished waits for its commit turn (waiting_tiles.py),
    `tail`, that tile and up to tail_step tokens more: a tile is quantized when it
    leaves the tail."""

    sink_token_bytes: int
    tile_bytes: int
    tail_step_bytes: int
    sink: int
    group: int
    step_tiles: int
    tail_step: int
    tail: int = 0

    per_token = property(lambda self: self.tile_bytes / self.group)

    def peak(self, n):
        """The most held at any step up to n tokens, whatever their order: every tile
        that can have left the tail by then in the storage's capacity, and the tail at
        its largest, tail_tokens, a waiting tile and tail_step tokens (once n gets
        there). Each part grows with n, so this is the state at n where the order
        gives the most."""
        sink = min(n, self.sink)
        rest = n - sink
        tiles = _round_up(max(0, rest - self.tail) // self.group, self.step_tiles)
        tail = _round_up(min(rest, self.tail + self.group + self.tail_step), self.tail_step)
        return (
            sink * self.sink_token_bytes
            + tiles * self.tile_bytes
            + tail // self.tail_step * self.tail_step_bytes
        )


@dataclass(frozen=True)
class Fixed:
    nbytes: int

    per_token = 0

    def peak(self, n):
        return self.nbytes


def _feed(cache, layer, n):
    """Append n tokens of zero keys/values of the layer's shape (lazy: nothing is
    computed) and return the bytes the cache holds."""
    dt = DTYPES[layer.dtype]
    cache.update_and_fetch(
        mx.zeros((1, layer.heads, n, layer.k_dim), dt),
        mx.zeros((1, layer.heads, n, layer.v_dim), dt),
    )
    return cache.nbytes


def steps_of(make, layer):
    """Bytes of one room step, read from two sizes of a real cache."""
    c = make()
    one = _feed(c, layer, c.step)
    two = _feed(c, layer, c.step)
    return Steps((two - one) // c.step, c.step)


def window_of(layer, prefill):
    """Bytes per token of a RotatingKVCache, read from two sizes (prompt chunks are
    concatenated without room)."""
    c = RotatingKVCache(max_size=layer.window, keep=layer.keep)
    two = _feed(c, layer, 2)
    four = _feed(c, layer, 2)
    return Window((four - two) // 2, layer.window, c.step, prefill)


def sink_tiles_tail_of(config, layer):
    """Sink, tile and tail bytes of a KVarNCache, read from real caches at a few sizes."""
    S, G, T, step = config.sink_size, config.group_size, config.tail_tokens, KVarNCache.step_tiles

    def held(*chunks):
        c = KVarNCache(config)
        for n in chunks:
            b = _feed(c, layer, n)
        return b

    sink = held(S) if S else 0
    one_step = held(S + step * G + T)  # sink + step_tiles tiles, no room, T tail tokens
    two_steps = held(S + step * G + T, step * G)
    tail = held(S + step * G + T + 1) - one_step  # one tail step
    return SinkTilesTail(
        sink // S if S else 0,
        (two_steps - one_step) // step,
        tail,
        S,
        G,
        step,
        KVarNCache.tail_step,
        T,
    )


def byte_model(layer, kind, prefill):
    """The byte model of one layer whose cache is `kind`: "plain", mlx-lm's
    QuantizedKVCache at that many bits (an int), or a KVarNConfig."""
    if isinstance(kind, int):
        if layer.k_dim % MLX_KV_GROUP_SIZE or layer.v_dim % MLX_KV_GROUP_SIZE:
            raise ValueError(
                f"head dims {layer.k_dim}/{layer.v_dim} are not multiples of mlx-lm's "
                f"KV group size {MLX_KV_GROUP_SIZE}"
            )
        return steps_of(lambda: QuantizedKVCache(MLX_KV_GROUP_SIZE, kind), layer)
    if kind != "plain":
        try:
            return sink_tiles_tail_of(kind, layer)
        except ValueError as e:
            raise ValueError(
                f"KVarNCache raises for {layer.heads} kv heads x head dims {layer.k_dim}/"
                f"{layer.v_dim}: {e}"
            ) from e
    if layer.kind == "kv":
        return steps_of(KVCache, layer)
    if layer.kind == "window":
        return window_of(layer, prefill)
    return Fixed(layer.state_bytes)


# -- the longest context -------------------------------------------------------------------


def longest_context(peak, per_token, available):
    """The most tokens n with peak(n) <= available; None when the cache stops growing."""
    if peak(1) > available:
        return 0
    if per_token == 0:
        return None if peak(2**40) <= available else _bisect(peak, available, 1, 2**40)
    lo, hi = 1, 2
    while peak(hi) <= available:
        lo, hi = hi, hi * 2
    return _bisect(peak, available, lo, hi)


def _bisect(peak, available, lo, hi):
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= available else (lo, mid)
    return lo
