"""The tiles decode steps leave waiting are quantized in one call for all
layers (kvarn_mlx/waiting_tiles.py), and that call stores exactly what one call per
layer stores."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from kvarn_mlx import dispatch, waiting_tiles
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import KVarNConfig, get_preset
from kvarn_mlx.integration import make_cache
from kvarn_mlx.tiles import ARRAYS
from models import tiny_model, tokens

G, S, D = 64, 8, 64
CFG = KVarNConfig(k_bits=4, v_bits=2, group_size=G, sink=S)
AUTO = get_preset("auto4v2", group_size=G, sink=S)


def rand(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(mx.float16)


def layers(configs, heads):
    return [KVarNCache(c) for c in configs], heads


def run(caches, heads, steps, prompt=S + G - 1, seed=0):
    """A prompt, then one token per step into every layer, as a model's forward does."""
    for i, (c, h) in enumerate(zip(caches, heads)):
        c.update_and_fetch(
            rand((1, h, prompt, D), seed + 2 * i), rand((1, h, prompt, D), seed + 2 * i + 1)
        )
    for t in range(steps):
        for i, (c, h) in enumerate(zip(caches, heads)):
            c.update_and_fetch(
                rand((1, h, 1, D), 1000 * t + 2 * i), rand((1, h, 1, D), 1000 * t + 2 * i + 1)
            )
    return caches


def assert_same_tiles(a, b):
    assert (a.offset, a.n_tiles, a.n_tail) == (b.offset, b.n_tiles, b.n_tail)
    for name, x, y in zip(ARRAYS, a.tiles.valid().arrays(), b.tiles.valid().arrays()):
        assert np.array_equal(np.array(x), np.array(y)), name


def alone(monkeypatch):
    monkeypatch.setattr(waiting_tiles, "take", lambda cache: None)


@pytest.mark.parametrize("configs", [[CFG] * 4, [AUTO] * 4, [CFG, AUTO, CFG, AUTO]])
def test_one_call_stores_what_one_call_per_layer_stores(monkeypatch, configs):
    # Layers of 2 and 4 kv heads; the "auto" ones decide per head (the keys stand
    # in for queries here), so their rotation flags are per-head arrays.
    heads = [2, 4, 2, 4]
    batched = run([KVarNCache(c) for c in configs], heads, steps=3 * G + 5)
    with monkeypatch.context() as m:
        alone(m)
        single = run([KVarNCache(c) for c in configs], heads, steps=3 * G + 5)
    for a, b in zip(batched, single):
        assert a.n_tiles == 4
        assert_same_tiles(a, b)


def test_a_commit_step_quantizes_once(monkeypatch):
    calls = []
    quantize = dispatch.quantize
    monkeypatch.setattr(dispatch, "quantize", lambda *a: calls.append(a[0].shape) or quantize(*a))
    caches = run([KVarNCache(CFG) for _ in range(5)], [2] * 5, steps=1)  # every tail full, waiting
    run_steps = lambda n: [
        c.update_and_fetch(rand((1, 2, 1, D), 7), rand((1, 2, 1, D), 8))
        for _ in range(n)
        for c in caches
    ]
    for n_tiles in (1, 2):
        assert calls == []
        run_steps(1)  # the next update commits: one call, the 5 layers' heads side by side
        assert calls == [(1, 10, 1, G, D)]
        assert all(c.n_tiles == n_tiles for c in caches)
        calls.clear()
        run_steps(G - 1)  # the tails fill again


def test_a_trim_after_the_call_is_not_fooled(monkeypatch):
    # Layer 0 commits for everyone; layer 1 is trimmed and refilled with other
    # tokens before its own update: it must quantize what it then holds.
    new = [(rand((1, 2, 1, D), 50 + i), rand((1, 2, 1, D), 60 + i)) for i in range(3)]

    def steps(caches):
        caches[0].update_and_fetch(*new[0])
        caches[1].trim(1)
        # full again, other tokens
        caches[1].update_and_fetch(rand((1, 2, 1, D), 70), rand((1, 2, 1, D), 71))
        for c, kv in zip(caches[1:], new[1:]):
            c.update_and_fetch(*kv)
        return caches

    with monkeypatch.context() as m:
        alone(m)
        want = steps(run([KVarNCache(CFG) for _ in range(3)], [2] * 3, steps=1))
    got = steps(run([KVarNCache(CFG) for _ in range(3)], [2] * 3, steps=1))  # tails full, waiting
    for a, b in zip(got, want):
        assert_same_tiles(a, b)


def test_generation_takes_the_same_tokens(monkeypatch):
    model = tiny_model("llama64")
    prompt = mx.array([t % 255 for t in tokens(40, seed=3)])

    def generate(preset):
        cache = make_cache(model, preset, sink=16, group_size=64)
        out = [
            t
            for t, _ in generate_step(
                prompt,
                model,
                prompt_cache=cache,
                max_tokens=140,
                sampler=lambda lp: mx.argmax(lp, axis=-1),
            )
        ]
        return out, cache

    for preset in ("k4v2_g128", "auto2"):
        got, batched = generate(preset)
        with monkeypatch.context() as m:
            alone(m)
            want, single = generate(preset)
        assert got == want
        for a, b in zip(batched, single):
            assert_same_tiles(a, b)
