"""Whole tiles that short steps left waiting in KVarN caches' tails, quantized
in one call.

A decode step fills the tail of every layer at the same step, and each layer
commits its tile at its next update (cache.py, `short_step`). One
dispatch.quantize over all of them, the layers' (and batch rows') kv heads
side by side, is the same math per tile as one call per layer, but one graph
of ops instead of one per layer: on the CPU the ops path costs mostly per op
(the embedded model's 30 layers: 0.14 s against 0.39-0.42 s on a Linux CPU,
benchmarks/results/decode_speed.md).

A cache registers when its update leaves whole tiles waiting. The first
registered cache to commit quantizes, with its own, the tiles of every
registered cache that still holds what it registered (same token counts) with
the same `commit_key()` (shapes and settings) whose turn it is, and leaves each
its result. Per thread, like the steps that fill the tiles.

Turns spread the commit: a decode step completes the tile of every layer at
once, and quantizing them all in the next step made that one step pay for
every layer (the embedded model's commit step built 2.3x a plain step's
primitives on the Metal path, benchmarks/results/step_graph_before.md). The
caches registered in one step are quantized PER_STEP at a time over the
following steps, in the order they registered; until its turn a cache keeps
its tile in the tail and attention reads it in full precision. The stored bits
are the same.
"""

import threading
import weakref

import mlx.core as mx

from . import dispatch
from .tiles import ARRAYS, Tiles

_local = threading.local()


def stamp(cache):
    """What a waiting cache holds, as far as its tiles go: every update changes it (a
    trim and an update can restore it, so a trim drops the cache's result, cache.trim)."""
    return cache.offset, cache.n_tiles, cache.n_tail


# Caches (layers x batch rows) whose waiting tiles one step quantizes.
PER_STEP = 6
# A cache's turn comes at most this many updates after its tile completed (the
# tail holds the tile and the tokens after it meanwhile; it commits earlier when
# they would pass a tile and KVarNCache.tail_step tokens).
MAX_WAIT = 32


def register(cache):
    """cache's tail holds whole tiles that one of its next updates commits. Its
    first registration for these tiles gives it its turn (cache.commit_in):
    after the caches still waiting, PER_STEP a step."""
    waiting = _local.__dict__.setdefault("waiting", [])
    if cache.commit_in is None:
        waiting[:] = [
            (r, s)
            for r, s in waiting
            if (c := r()) is not None and c is not cache and s == stamp(c)
        ]
        cache.commit_in = min(len(waiting) // PER_STEP, MAX_WAIT)
    waiting.append((weakref.ref(cache), stamp(cache)))


def due(cache):
    """Whether cache's waiting tiles are quantized at this update (else it waits)."""
    return cache.commit_in is None or cache.commit_in <= 0


def take(cache) -> Tiles | None:
    """The packed tiles [B, H, m, G, D] of cache's waiting tiles, quantized with
    every waiting peer's; None: quantize them alone."""
    done, cache.batched = cache.batched, None
    if done is not None and done[0] == stamp(cache):
        return done[1]
    live = {}  # id -> (cache, its key), registered caches still holding what they registered
    for ref, s in getattr(_local, "waiting", []):
        c = ref()
        if c is not None and s == stamp(c):
            live[id(c)] = (c, c.commit_key())
    key = cache.commit_key()
    if key is None or id(cache) not in live:
        return None
    turn = [k == key and due(c) for c, k in live.values()]
    peers = [c for (c, _), now in zip(live.values(), turn) if now]
    _local.waiting = [
        (weakref.ref(c), stamp(c)) for (c, _), now in zip(live.values(), turn) if not now
    ]
    if len(peers) < 2:
        return None
    m, G = key[-1], cache.config.group_size
    heads = [c.tail_k.shape[1] for c in peers]

    def tiles_of(tail):
        return mx.concatenate(
            [t[..., : m * G, :].reshape(t.shape[0], t.shape[1], m, G, t.shape[3]) for t in tail],
            axis=1,
        )

    flags = [c.rotate_k for c in peers]
    if all(isinstance(f, bool) and f == flags[0] for f in flags):
        rotate_k = flags[0]
    else:
        rotate_k = mx.concatenate(
            [
                f if isinstance(f, mx.array) else mx.full((h,), f, mx.bool_)
                for f, h in zip(flags, heads)
            ]
        )
    new = dispatch.quantize(
        tiles_of([c.tail_k for c in peers]),
        tiles_of([c.tail_v for c in peers]),
        cache.config,
        rotate_k,
        cache.rotate_v,
    )
    cuts = [sum(heads[: i + 1]) for i in range(len(heads) - 1)]
    parts = zip(*(mx.split(x, cuts, axis=1) for x in new.arrays()))
    for c, arrays in zip(peers, parts):
        c.batched = (stamp(c), Tiles(**dict(zip(ARRAYS, arrays))))
    done, cache.batched = cache.batched, None
    return done[1]
