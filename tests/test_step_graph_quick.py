"""benchmarks/step_graph.py --quick on a tiny model folder: primitive counts of
one decode step's graph, on the ops path and on the Metal path built without a
device, plain cache against KVarN presets."""

import json

import mlx.core as mx
import pytest

from benchmark_scripts import load_benchmark
from model_folder import tiny_model_folder


def test_primitives_counts_the_graph_down_to_evaluated_arrays():
    sg = load_benchmark("step_graph")
    a = mx.ones((4,))
    mx.eval(a)
    n, names = sg.primitives(mx.exp(a * 2) + a)
    assert n == 4 and names == {"Multiply": 1, "Exp": 1, "Add": 1, "Broadcast": 1}
    assert sg.primitives(a)[0] == 0


def test_metal_graph_stands_in_one_primitive_per_kernel_and_fast_op():
    sg = load_benchmark("step_graph")
    x, w = mx.ones((2, 64)), mx.ones((64,))
    mx.eval(x, w)
    ops = sg.primitives(mx.fast.rms_norm(x, w, 1e-5))[0]
    with sg.metal_graph():
        y = mx.fast.rms_norm(x, w, 1e-5)
        kernel = mx.fast.metal_kernel(
            name="k", input_names=["x"], output_names=["a", "b"], source=""
        )
        a, b = kernel(
            inputs=[x * 2],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(3,), (2, 2)],
            output_dtypes=[mx.float32, mx.uint32],
        )
    assert ops > 1 and sg.primitives(y) == (1, {"Depends": 1})
    assert a.shape == (3,) and b.dtype == mx.uint32
    assert sg.primitives(a, b)[1] == {"Depends": 1, "Multiply": 1, "Broadcast": 1}
    assert (
        mx.fast.rms_norm(x, w, 1e-5).shape == x.shape
        and sg.primitives(mx.fast.rms_norm(x, w, 1e-5))[0] == ops
    )


@pytest.mark.e2e
def test_step_graph_quick(tmp_path):
    sg = load_benchmark("step_graph")
    folder = tiny_model_folder(tmp_path / "model")
    out = tmp_path / "results"
    sg.main(["--quick", "--model", str(folder), "--out", str(out)])
    data = json.loads((out / "step_graph.json").read_text())
    ctx = int(sg.QUICK["contexts"])
    assert [(r["path"], r["context"], r["method"]) for r in data["rows"]] == [
        (p, ctx, m) for p in sg.PATHS for m in sg.METHODS
    ]
    rows = {(r["path"], r["method"]): r for r in data["rows"]}
    for (path, method), r in rows.items():
        assert r["build_s"] > 0 and r["primitives"] == sum(r["by_primitive"].values())
        assert r["slowest_step_s"] >= r["step_s"] > r["build_s"] / 2
        lo, hi = r["primitives_range"]
        assert lo <= r["primitives"] <= hi
        if method == sg.PLAIN:
            assert "commit_primitives" not in r
        else:  # the second measured step commits the tile the first completed
            assert r["commit_primitives"] > r["primitives"]
            assert ("QuantizedMatmul" in r["by_primitive"]) == (path == "ops")
    # Each method quantizes its own tiles in its commit step (not another's, nor another its).
    assert all(
        rows["ops", m]["commit_primitives"] > 2 * rows["ops", m]["primitives"]
        for m in sg.METHODS[1:]
    )
    # Kernels and fast ops are one primitive each on the Metal path.
    assert rows["metal", sg.PLAIN]["primitives"] < rows["ops", sg.PLAIN]["primitives"]
    assert "Depends" in rows["metal", "k4v2_g128"]["by_primitive"]
    md = (out / "step_graph.md").read_text()
    assert "python benchmarks/step_graph.py --quick" in md and md.count("\n| ") == 1 + len(
        data["rows"]
    )


@pytest.mark.e2e
def test_step_graph_quick_batch(tmp_path):
    # --rows: sequences of different lengths joined by mlx-lm's merge, decoding together.
    sg = load_benchmark("step_graph")
    folder = tiny_model_folder(tmp_path / "model")
    out = tmp_path / "results"
    sg.main(
        [
            "--quick",
            "--rows",
            "3",
            "--methods",
            "fp,k4v2_g128",
            "--model",
            str(folder),
            "--out",
            str(out),
            "--clock",
            "thread",
            "--breakdown",
        ]
    )
    data = json.loads((out / "step_graph.json").read_text())
    # --breakdown: the updates and attention calls are part of every build, and the
    # wrappers are gone afterwards
    from mlx_lm.models import base
    from mlx_lm.models.cache import BatchKVCache

    from kvarn_mlx import integration
    from kvarn_mlx.batch_cache import BatchKVarNCache

    for r in data["rows"]:
        assert 0 < r["update_s"] and 0 < r["attention_s"]
        assert r["update_s"] + r["attention_s"] < r["build_s"]
    assert base.scaled_dot_product_attention is integration.scaled_dot_product_attention
    assert BatchKVCache.update_and_fetch.__qualname__ == "BatchKVCache.update_and_fetch"
    assert BatchKVarNCache.update_and_fetch.__qualname__ == "BatchKVarNCache.update_and_fetch"
    assert "Where the build goes" in (out / "step_graph.md").read_text()
    assert data["batch_rows"] == 3 and [
        (r["path"], r["method"], r["rows"]) for r in data["rows"]
    ] == [(p, m, 3) for p in sg.PATHS for m in ("fp", "k4v2_g128")]
    lengths = sg.row_lengths(int(sg.QUICK["contexts"]), 3)
    assert (
        lengths == sorted(set(lengths)) and lengths[-1] == int(sg.QUICK["contexts"]) - sg.WARMUP - 1
    )
    for r in data["rows"]:
        assert r["primitives"] > 0 and r["build_s"] > 0
    assert "Batched: 3 sequences" in (out / "step_graph.md").read_text()


@pytest.mark.e2e
def test_step_memo_runs_and_restores_the_memo(tmp_path, capsys):
    from kvarn_mlx import kernels

    memo = kernels._step_memo
    sm = load_benchmark("step_memo")
    folder = tiny_model_folder(tmp_path / "model")
    sm.main(["--model", str(folder), "--context", "300", "--steps", "14"])
    out = capsys.readouterr().out
    assert "with the memo" in out and "x the plain cache's host build, without" in out
    assert kernels._step_memo is memo


def test_kernel_call_cost_runs_both_factories_and_restores_them(tmp_path):
    from kvarn_mlx import dispatch, kernels

    factory, use_metal = mx.fast.metal_kernel, dispatch.use_metal
    kcc = load_benchmark("kernel_call_cost")
    kcc.main(["--context", "384", "--calls", "20", "--repeats", "2", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "kernel_call_cost.json").read_text())
    assert set(data["us_per_call"]) == {"real", "stand_in", "plain_stand_in"}
    assert all(us > 0 for us in data["us_per_call"].values())
    assert "python " in (tmp_path / "kernel_call_cost.md").read_text()
    assert mx.fast.metal_kernel is factory and dispatch.use_metal is use_metal
    # the real factory built the kernels for the traced calls
    assert any(key[1] == id(factory) for key in kernels._kernels)
