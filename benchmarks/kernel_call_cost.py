"""Host cost of one layer's Metal decode-attention call, with MLX's real
mx.fast.metal_kernel against the one-primitive stand-in step_graph.py uses.

    python benchmarks/kernel_call_cost.py --context 2048 --method auto4v2

step_graph.py builds the Metal path's graph on a machine without Metal by standing
in for each kernel call with one primitive (mx.depends). Whether that charges a
kernel call what it costs on a Mac is measured here: MLX builds a metal_kernel call
(kernel name from the input dtypes and any template arguments, the generated
signature and source) in C++ shared by every platform, and without Metal it does so inside an
export trace (mx.export_function), recording the call instead of refusing it. So
packed_attention_metal is timed three ways, on one layer's cache filled to the
context, in thread CPU time (ratios hold on a busy machine): with the real kernel
factory inside an export trace, with step_graph's stand-in, and the plain cache's
attention entry (mx.fast.scaled_dot_product_attention) with its stand-in, the
figure step_graph compares with. The real mx.fast.scaled_dot_product_attention
cannot be timed here (on a CPU it builds its ops fallback, not the GPU's one
primitive).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import fill  # noqa: E402
from step_graph import metal_graph  # noqa: E402

from kvarn_mlx import dispatch, kernels, waiting_tiles  # noqa: E402
from kvarn_mlx.cache import KVarNCache  # noqa: E402
from kvarn_mlx.config import get_preset  # noqa: E402
from kvarn_mlx.eval.runner import meta_markdown, metadata  # noqa: E402


def per_call_us(fn, calls, repeats):
    """The least over repeats of the thread CPU time of `calls` calls of fn, per call (as
    timeit advises: what is above it is other processes and the garbage collector)."""
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        times.append((time.thread_time() - t0) / calls)
    return 1e6 * min(times)


def measure(method, context, kv_heads, q_heads, head_dim, calls, repeats):
    cache = KVarNCache(get_preset(method))
    fill([cache], kv_heads, head_dim, context)
    waiting_tiles._local.waiting = []
    one = mx.ones((1, kv_heads, 1, head_dim))
    cache.update_and_fetch(one, one)
    view = cache.step_view()
    q = mx.random.normal((1, q_heads, 1, head_dim))
    k = mx.random.normal((1, kv_heads, context, head_dim))
    mx.eval(q, k, *cache.tiles.arrays(), cache.tail_k, cache.tail_v)
    scale = head_dim**-0.5
    use_metal = dispatch.use_metal
    dispatch.use_metal = lambda: True
    try:
        reason = kernels.attention_unsupported(q, view)
        if reason is not None:
            raise SystemExit(f"the kernel does not take this view: {reason}")
        out = {}

        def real(x):  # traced by mx.export_function: the real factory records its calls
            out["real"] = per_call_us(
                lambda: kernels.packed_attention_metal(q, view, scale, False), calls, repeats
            )
            return x + 1

        with tempfile.TemporaryDirectory() as tmp:
            mx.export_function(str(Path(tmp) / "trace.mlxfn"), real, mx.zeros((1,)))
        with metal_graph():
            out["stand_in"] = per_call_us(
                lambda: kernels.packed_attention_metal(q, view, scale, False), calls, repeats
            )
            out["plain_stand_in"] = per_call_us(
                lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=scale), calls, repeats
            )
    finally:
        dispatch.use_metal = use_metal
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--method", default="auto4v2")
    p.add_argument("--kv-heads", type=int, default=3, help="SmolLM2-135M: 3; Qwen2.5-1.5B: 2")
    p.add_argument("--q-heads", type=int, default=9, help="SmolLM2-135M: 9; Qwen2.5-1.5B: 12")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=None, help="write kernel_call_cost.md/.json here")
    args = p.parse_args(argv)
    r = measure(
        args.method,
        args.context,
        args.kv_heads,
        args.q_heads,
        args.head_dim,
        args.calls,
        args.repeats,
    )
    rows = [
        ("packed_attention_metal, real mx.fast.metal_kernel (export trace)", r["real"]),
        ("packed_attention_metal, step_graph's stand-in", r["stand_in"]),
        ("plain: mx.fast.scaled_dot_product_attention, step_graph's stand-in", r["plain_stand_in"]),
    ]
    shapes = f"{args.q_heads} query heads over {args.kv_heads} kv heads of dim {args.head_dim}"
    table = [
        f"One layer's decode attention call at {args.context} tokens ({args.method}, {shapes}); "
        f"thread CPU time per call, the least of {args.repeats} runs of {args.calls} calls.",
        "",
        "| call | us per call | vs stand-in |",
        "|---|---|---|",
        *(f"| {name} | {us:.2f} | {us / r['stand_in']:.2f}x |" for name, us in rows),
    ]
    print("\n".join(table))
    if args.out:
        meta = metadata("none (one layer's cache, random K/V)", "python " + " ".join(sys.argv))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernel_call_cost.json").write_text(
            json.dumps({"meta": meta, "args": vars(args), "us_per_call": r}, indent=1)
        )
        md = ["# Host cost of a Metal decode-attention call", "", meta_markdown(meta), "", *table]
        (out / "kernel_call_cost.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
