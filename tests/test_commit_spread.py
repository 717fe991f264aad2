"""The tiles a decode step completes are quantized over the following steps, a
few caches at a time (kvarn_mlx/waiting_tiles.py, PER_STEP), not all layers in one
step; what each cache stores is what it stores quantizing alone."""

import mlx.core as mx
import numpy as np

from kvarn_mlx import dispatch, waiting_tiles
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import KVarNConfig
from kvarn_mlx.tiles import ARRAYS

G, S, D = 64, 8, 64
CFG = KVarNConfig(k_bits=4, v_bits=2, group_size=G, sink=S)


def rand(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(mx.float16)


def prompt(caches):
    for i, c in enumerate(caches):
        c.update_and_fetch(rand((1, 2, S + G - 1, D), 2 * i), rand((1, 2, S + G - 1, D), 2 * i + 1))


def step(caches, t):
    """One decode token into every layer, in layer order, as a model's forward does."""
    return [
        c.update_and_fetch(
            rand((1, 2, 1, D), 1000 * t + 2 * i), rand((1, 2, 1, D), 1000 * t + 2 * i + 1)
        )
        for i, c in enumerate(caches)
    ]


def spread_and_alone(run, monkeypatch):
    """run()'s caches with the commits spread over steps, then with each cache
    quantizing its own tiles at once (no tile waits)."""
    spread = run()
    with monkeypatch.context() as m:
        m.setattr(waiting_tiles, "take", lambda cache: None)
        m.setattr(waiting_tiles, "due", lambda cache: True)
        alone = run()
    return spread, alone


def test_the_commit_is_spread_over_steps(monkeypatch):
    n = 2 * waiting_tiles.PER_STEP + 3  # three steps' worth of caches
    calls = []
    quantize = dispatch.quantize
    monkeypatch.setattr(
        dispatch, "quantize", lambda *a: calls.append(a[0].shape[1]) or quantize(*a)
    )
    caches = [KVarNCache(CFG) for _ in range(n)]
    prompt(caches)
    step(caches, 0)  # every tail holds a whole tile now
    assert calls == [] and all(c.n_tail == G for c in caches)
    tiles = []
    for t in range(1, 5):
        fetched = step(caches, t)
        tiles.append([c.n_tiles for c in caches])
        # A cache whose tile still waits reads it in full precision: nothing is lost.
        for c, (k, _) in zip(caches, fetched):
            assert k.shape[2] == c.offset == S + G + t
            assert c.n_tail == c.offset - S - c.n_tiles * G <= 2 * G
    per = waiting_tiles.PER_STEP
    assert calls == [2 * per, 2 * per, 2 * 3]  # kv heads of PER_STEP caches per step, side by side
    assert tiles[0] == [1] * per + [0] * (n - per)
    assert tiles[1] == [1] * 2 * per + [0] * 3
    assert tiles[2] == tiles[3] == [1] * n


def test_spread_commits_store_what_caches_store_alone(monkeypatch):
    n = 2 * waiting_tiles.PER_STEP + 3

    def run():
        caches = [KVarNCache(CFG) for _ in range(n)]
        prompt(caches)
        for t in range(3 * G + 5):
            step(caches, t)
        return caches

    spread, alone = spread_and_alone(run, monkeypatch)
    for a, b in zip(spread, alone):
        assert a.n_tiles == b.n_tiles == 4 and (a.offset, a.n_tail) == (b.offset, b.n_tail)
        for name, x, y in zip(ARRAYS, a.tiles.valid().arrays(), b.tiles.valid().arrays()):
            assert np.array_equal(np.array(x), np.array(y)), name


def test_a_long_step_commits_a_waiting_tile_at_once():
    caches = [KVarNCache(CFG) for _ in range(2 * waiting_tiles.PER_STEP)]
    prompt(caches)
    step(caches, 0)
    step(caches, 1)  # the first PER_STEP caches commit; the others wait
    last = caches[-1]
    assert last.n_tiles == 0 and last.n_tail == G + 1
    # a prefill chunk: no waiting
    last.update_and_fetch(rand((1, 2, 40, D), 5), rand((1, 2, 40, D), 6))
    assert last.n_tiles == 1 and last.n_tail == 41


def test_a_trim_while_a_tile_waits_keeps_the_bits(monkeypatch):
    # Speculative decoding trims rejected drafts: a waiting tile trimmed back to
    # whole still commits the same bits. One trimmed into is no tile any more; its
    # tokens are still the exact ones (a committed tile trimmed into comes back
    # dequantized), so only its counts are compared.
    n = waiting_tiles.PER_STEP + 2

    def run():
        caches = [KVarNCache(CFG) for _ in range(n)]
        prompt(caches)
        step(caches, 0)
        step(caches, 1)  # the first PER_STEP caches commit, the last two wait
        for c in caches:
            c.trim(1)  # back to exactly one whole tile in the waiting tails
        caches[-1].trim(1)  # the last one's tile is cut: it no longer waits
        for t in range(2, G + 4):
            step(caches, t)
        return caches

    spread, alone = spread_and_alone(run, monkeypatch)
    for a, b in zip(spread, alone):
        assert a.n_tiles == b.n_tiles and (a.offset, a.n_tail) == (b.offset, b.n_tail)
    for a, b in zip(spread[:-1], alone[:-1]):
        for name, x, y in zip(ARRAYS, a.tiles.valid().arrays(), b.tiles.valid().arrays()):
            assert np.array_equal(np.array(x), np.array(y)), name
    assert [c.n_tiles for c in spread] == [2] * n
