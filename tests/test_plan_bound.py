"""The planner's bytes at a context bound what the caches hold, tightly:
benchmarks/plan_bound.py's fill (a prompt prefilled in chunks as mlx_lm.generate
does, then one-token steps) on a model shaped like the embedded SmolLM2 (30
layers, 3 kv heads of dim 64, float32; a small hidden size, the model never
runs). At every step held <= the planner's figure at that step's context, and
the planner's figure at the end is within 5% of the most held."""

import pytest

from benchmark_scripts import load_benchmark
from kvarn_mlx import model_info, plan

CONFIG = dict(
    model_type="llama",
    hidden_size=192,
    num_hidden_layers=30,
    intermediate_size=64,
    num_attention_heads=3,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    vocab_size=256,
    tie_word_embeddings=True,
    torch_dtype="float32",
)


@pytest.fixture(scope="module")
def setup():
    lazy = model_info.lazy_model(CONFIG, "float32")
    plans = {p.name: p for p in plan.cache_plans(CONFIG, "float32", model=lazy) if not p.error}
    return load_benchmark("plan_bound"), lazy, plans


# 4096: the sink and 31 tiles; 6000: off a tile boundary; 8192: more tiles (slow). The
# planner and the caches both with make_cache's default tail.
@pytest.mark.default_tail
@pytest.mark.parametrize(
    "n",
    [4096, pytest.param(6000, marks=pytest.mark.slow), pytest.param(8192, marks=pytest.mark.slow)],
)
def test_planner_bytes_bound_held_bytes_within_5_percent(setup, n):
    bench, lazy, plans = setup
    assert len(plans) == 1 + 1 + 2 + len(plan.PRESETS)  # plain f32, f16, mlx-lm 8/4, presets
    counts = bench.steps(n, decode=8)
    ratios = {}
    for name, p in plans.items():
        if name == "plain (float16)":
            continue
        held = list(bench.fill_arrays(lazy, bench.build_caches(lazy, name), counts, random=False))
        assert all(h <= p.peak(t) for t, h in held), name
        ratios[name] = p.peak(held[-1][0]) / max(h for _, h in held)
    assert all(1 <= r <= 1.05 for r in ratios.values()), ratios
    assert max(ratios.values()) > 1.01  # the waiting tile's tail step: not an exact figure
