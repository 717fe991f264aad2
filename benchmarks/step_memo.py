"""Host build of a Metal-path decode step with the per-layer step memo
(kernels._StepMemo) and without it, against the plain cache, in one process.

    python benchmarks/step_memo.py --context 2048 --method auto4v2

Three caches step round-robin (plain, the method with the memo, the method with
the memo turned off), so load from other processes hits them alike; the figure is
the thread CPU time of the model call that builds the step (Python builds the graph
on one thread, so time spent waiting for a busy core is left out). Prints the
medians and the two ratios to the plain cache. The Metal path is built without a
device, as in step_graph.py.
"""

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_graph import make_filled, metal_graph  # noqa: E402

from kvarn_mlx import kernels  # noqa: E402
from kvarn_mlx.loader import load  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--method", default="auto4v2")
    p.add_argument("--steps", type=int, default=120)
    args = p.parse_args(argv)
    model, _ = load(args.model)
    memo = kernels._step_memo
    runs = {"plain": ("fp", memo), "memo": (args.method, memo), "no memo": (args.method, None)}
    times = {r: [] for r in runs}
    with metal_graph():
        caches = {r: make_filled(model, m, args.context, 0) for r, (m, _) in runs.items()}
        tokens = {r: mx.array([[1]]) for r in runs}
        try:
            for i in range(args.steps):
                for r, (_, fn) in runs.items():
                    kernels._step_memo = fn or (lambda q, view: None)
                    t0 = time.thread_time()
                    y = model(tokens[r], cache=caches[r])
                    tokens[r] = mx.argmax(y[:, -1:], axis=-1)
                    if i >= 10:
                        times[r].append(time.thread_time() - t0)
                    mx.eval(tokens[r])
        finally:
            kernels._step_memo = memo
    med = {r: sorted(t)[len(t) // 2] * 1e3 for r, t in times.items()}
    print(", ".join(f"{r} {m:.3f} ms" for r, m in med.items()))
    print(
        f"{args.method} at {args.context}: with the memo {med['memo'] / med['plain']:.3f}x the "
        f"plain cache's host build, without {med['no memo'] / med['plain']:.3f}x"
    )


if __name__ == "__main__":
    main()
