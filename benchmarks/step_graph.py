"""The graph of one decode step: how many primitives it holds and how long
Python takes to build it, the plain cache against KVarN presets, on the MLX
ops path this machine runs and on the Metal-kernel path.

    python benchmarks/step_graph.py --contexts 2048,8192,32768          # counts and host times
    python benchmarks/step_graph.py --quick --model tiny/folder --out /tmp/sg   # CI

On a Mac, MLX evaluates step t on the GPU while Python builds step t+1's graph
(mlx-lm's generate loop uses async_eval): a step whose graph takes longer to
build than the GPU takes to run it is host-bound. Both figures here carry over
from this machine to a Mac; wall times of the evaluation do not.

Primitives: every primitive in the step's graph, counted from the step's output
(the next token) with mx.export_to_dot, which walks the graph from the outputs
down to arrays already evaluated (the caches' held arrays). Deterministic: the
same code and context give the same count. Arrays Python builds that the
output does not depend on (the keys and values update_and_fetch returns, when
packed attention reads the tiles instead) cost host time but no primitives.

Host build: the seconds of the model call of one decode step, before anything is
evaluated (median over the steps). Needs a quiet machine, or `--clock thread`
(the thread's CPU time: ratios hold on a busy machine). On the ops path the steps
are measured after an uncounted pass of the same steps, which makes mx.compile's
traces of their shapes (made once per process and shape, as a long generation
does at its first steps and commits).

The Metal path (`--paths metal`) is built here without a Metal device: each
Metal kernel call (dispatch forced to the kernels) and each mx.fast op
(rms_norm, layer_norm, rope, scaled_dot_product_attention, which a GPU runs as
one primitive but MLX's CPU splits into many) is stood in for by one
primitive, mx.depends of placeholder outputs of the right shapes on all of the
call's inputs. The step is then evaluated on the CPU (placeholder values:
its tokens are meaningless) so that the next step's graph starts from
evaluated arrays, as on a Mac.

`--breakdown` also times, within each build, the caches' update_and_fetch and the
attention calls, to show where a method's extra host time goes.

Caches are filled with random K/V (as benchmarks/decode_speed.py does) to
context - warmup - 1 tokens, so that at a context of sink + n tiles the first
measured step completes a tile in every layer and the following steps commit
them (waiting_tiles.py: PER_STEP caches a step): the steps that quantize tiles are
reported apart from the others, by the heaviest of them. Methods step round-robin, one step each in
turn, so load from other processes hits them alike.
"""

import argparse
import contextlib
import io
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import base as mlx_base
from mlx_lm.models import cache as mlx_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import fill  # noqa: E402
from decode_speed import row_lengths as decode_speed_row_lengths  # noqa: E402

from kvarn_mlx import dispatch, integration, waiting_tiles  # noqa: E402
from kvarn_mlx.batch_cache import BatchKVarNCache  # noqa: E402
from kvarn_mlx.cache import KVarNCache  # noqa: E402
from kvarn_mlx.eval.runner import meta_markdown, metadata  # noqa: E402
from kvarn_mlx.integration import make_cache  # noqa: E402

PLAIN = "fp"
METHODS = (PLAIN, "k4v2_g128", "k2v2_g128", "auto4v2")
PATHS = ("ops", "metal")
QUICK = dict(contexts="384", steps=4)
WARMUP = 2


def primitives(*outputs):
    """The number of primitives in the graph of outputs, and a Counter by name
    (mx.export_to_dot: one rectangle per primitive, evaluated arrays are leaves)."""
    f = io.StringIO()
    mx.export_to_dot(f, *outputs)
    names = re.findall(r'label ="([^"]*)", shape=rectangle', f.getvalue())
    return len(names), Counter(names)


# -- the Metal path, built without a Metal device ---------------------------------

_leaves = {}


def _placeholder(shape, dtype):
    key = (tuple(shape), dtype)
    if key not in _leaves:
        _leaves[key] = mx.zeros(shape, dtype)
        mx.eval(_leaves[key])
    return _leaves[key]


def _one_primitive(outputs, inputs):
    """Arrays like `outputs` ((shape, dtype) pairs) from one primitive reading every input."""
    deps = [x for x in inputs if isinstance(x, mx.array)]
    return mx.depends([_placeholder(s, d) for s, d in outputs], deps)


class _KernelStandIn:
    """mx.fast.metal_kernel's stand-in: each call is one primitive."""

    def __init__(self, **_):
        pass

    def __call__(self, inputs, output_shapes, output_dtypes, **_):
        return _one_primitive(zip(output_shapes, output_dtypes), inputs)


def _like(x, *deps):
    return _one_primitive([(x.shape, x.dtype)], [x, *deps])[0]


def _sdpa(q, k, v, *, scale, mask=None, sinks=None, **_):
    return _one_primitive([((*q.shape[:-1], v.shape[-1]), q.dtype)], [q, k, v, mask, sinks])[0]


_STAND_INS = {
    "metal_kernel": _KernelStandIn,
    "rms_norm": lambda x, weight, eps: _like(x, weight),
    "layer_norm": lambda x, weight, bias, eps: _like(x, weight, bias),
    "rope": lambda a, dims, *, traditional, base, scale, offset, freqs=None: _like(
        a, offset, freqs
    ),
    "scaled_dot_product_attention": _sdpa,
}


@contextlib.contextmanager
def metal_graph():
    """Within the block, graphs are built as the Metal path builds them (above)."""
    saved = {name: getattr(mx.fast, name) for name in _STAND_INS}
    use_metal = dispatch.use_metal
    try:
        for name, fn in _STAND_INS.items():
            setattr(mx.fast, name, fn)
        dispatch.use_metal = lambda: True
        yield
    finally:
        for name, fn in saved.items():
            setattr(mx.fast, name, fn)
        dispatch.use_metal = use_metal


# -- where a step's build goes (--breakdown) ------------------------------------------

PARTS = {"update": 0.0, "attention": 0.0}


@contextlib.contextmanager
def timed_parts(clock):
    """Within the block, the time of every cache's update_and_fetch and of every
    attention call through mlx-lm's scaled_dot_product_attention (as kvarn_mlx
    patches it) adds up in PARTS. The wrappers add a little time of their own."""

    def timed(fn, part):
        def wrapper(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                PARTS[part] += clock() - t0

        return wrapper

    classes = [mlx_cache.KVCache, mlx_cache.BatchKVCache, KVarNCache, BatchKVarNCache]
    saved = {c: c.__dict__["update_and_fetch"] for c in classes}
    attention = mlx_base.scaled_dot_product_attention
    wrapped = timed(attention, "attention")
    try:
        for c, fn in saved.items():
            c.update_and_fetch = timed(fn, "update")
        integration._swap(attention, wrapped)
        yield
    finally:
        integration._swap(wrapped, attention)
        for c, fn in saved.items():
            c.update_and_fetch = fn


# -- running -------------------------------------------------------------------------


def make(model, name):
    return mlx_cache.make_prompt_cache(model) if name == PLAIN else make_cache(model, name)


def row_lengths(ctx, rows):
    """Tokens per batch row before the warm-up steps: decode_speed's rows (the others
    shorter by up to half the context and 128 / rows tokens more per row, so that, as
    in a server's batch, the rows complete their tiles at spread steps), each
    WARMUP + 1 tokens short of it."""
    return [n - WARMUP - 1 for n in decode_speed_row_lengths(ctx, rows)]


def make_filled(model, name, ctx, rows):
    """The method's cache, filled; with rows > 0, a batch of that many sequences
    (each filled alone, then joined as mlx-lm's BatchGenerator does: merge)."""
    a = model.args
    H = a.num_key_value_heads
    D = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    if not rows:
        caches = make(model, name)
        fill(caches, H, D, ctx - WARMUP - 1)
        return caches
    seqs = []
    for i, n in enumerate(row_lengths(ctx, rows)):
        seqs.append(make(model, name))
        fill(seqs[-1], H, D, n, seed=i)
    return [type(layer[0]).merge(list(layer)) for layer in zip(*seqs)]


def n_tiles(caches):
    # (a batch's _rows, not rows: reading `rows` catches the rows' tails up, which the
    # decode loop being measured does not do)
    rows = [r for c in caches for r in (c._rows if isinstance(c, BatchKVarNCache) else [c])]
    return sum(r.n_tiles for r in rows if isinstance(r, KVarNCache))


def run(model, methods, ctx, steps, count=True, rows=0, clock=time.perf_counter):
    """Per method: [(primitives, Counter, build seconds, committed, step seconds, parts)] of
    each measured step (step: build and evaluation, the counting left out; parts: PARTS
    of its build, zeros unless within timed_parts), timed by clock."""
    all_caches = [make_filled(model, m, ctx, rows) for m in methods]
    waiting_tiles._local.waiting = []
    toks = [mx.array([[1]] * max(rows, 1)) for _ in methods]
    out = [[] for _ in methods]
    # Each method's tiles waiting for a commit (waiting_tiles.py, per thread): kept
    # apart, or one method's commit would quantize another's tiles too.
    waiting = [[] for _ in methods]
    for i in range(WARMUP + steps):
        for j, caches in enumerate(all_caches):
            before = n_tiles(caches)
            waiting_tiles._local.waiting = waiting[j]
            PARTS.update(update=0.0, attention=0.0)
            t0 = clock()
            y = model(toks[j], cache=caches)
            toks[j] = mx.argmax(y[:, -1:], axis=-1)
            built = clock() - t0
            parts = dict(PARTS)
            waiting[j] = waiting_tiles._local.waiting
            n, names = primitives(toks[j]) if count else (0, Counter())
            t1 = clock()
            mx.eval(toks[j])
            step = built + clock() - t1  # the step's build and evaluation
            if i >= WARMUP:
                out[j].append((n, names, built, n_tiles(caches) > before, step, parts))
    return out


def summarize(path, ctx, method, measured, rows=0):
    normal = [m for m in measured if not m[3]]
    commit = [m for m in measured if m[3]]
    r = {
        "path": path,
        "context": ctx,
        "method": method,
        "rows": rows,
        "primitives": int(np.median([m[0] for m in normal])),
        "primitives_range": [min(m[0] for m in normal), max(m[0] for m in normal)],
        "build_s": float(np.median([m[2] for m in normal])),
        "step_s": float(np.median([m[4] for m in normal])),
        # the slowest measured step, commit steps included (on the Metal path the
        # evaluation is of placeholders, so only the ops path's is a real step time)
        "slowest_step_s": max(m[4] for m in measured),
        "by_primitive": dict(normal[len(normal) // 2][1].most_common()),
    }
    if any(m[5]["update"] for m in normal):
        for part in PARTS:
            r[f"{part}_s"] = float(np.median([m[5][part] for m in normal]))
    if commit:  # the heaviest of the steps that quantized tiles
        worst = max(commit, key=lambda m: m[0])
        r.update(
            commit_steps=len(commit),
            commit_primitives=worst[0],
            commit_build_s=max(m[2] for m in commit),
            commit_by_primitive=dict(worst[1].most_common()),
        )
    return r


def plain_row(rows, r):
    """The plain cache's row of r's path and context."""
    return next(
        b
        for b in rows
        if (b["path"], b["context"], b["method"]) == (r["path"], r["context"], PLAIN)
    )


def render(data, times=True):
    md = [
        "# One decode step's graph: primitives and host build time\n",
        meta_markdown(data["meta"]),
        f"\nPer decode step of the model ({data['steps']} steps after {WARMUP} warm-up steps, "
        "caches filled with random K/V): the primitives in the step's graph (mx.export_to_dot "
        "from the next token; deterministic) and the host time to build it (the model call "
        "before evaluation; median). 'ops': the MLX ops path this CPU runs. 'metal': the graph "
        "the Metal path builds (kernels and mx.fast ops one primitive each, as on a GPU; see "
        "benchmarks/step_graph.py). 'commit step': the heaviest of the steps that quantize the "
        "tiles the first measured step completed (its primitives, and the longest build). "
        "Ratios against the plain cache (fp) of the same path and context. 'Slowest step vs fp "
        "step' (ops path): the longest measured step, build and evaluation, commit steps "
        "included, against the plain cache's median step.\n",
    ]
    if data.get("batch_rows"):
        md.append(
            f"Batched: {data['batch_rows']} sequences decoding together (mlx-lm's merge: "
            "BatchKVCache for fp, BatchKVarNCache for KVarN); 'context' is the longest row, the "
            "others are shorter by steps of context / (2 x rows) + 128 / rows tokens "
            "(step_graph.row_lengths: tile boundaries at spread steps, as in a server's "
            "batch).\n"
        )
    head = "| path | context | method | primitives | vs fp | commit step | vs fp |"
    rule = "|---|---|---|---|---|---|---|"
    if times:
        head += " build ms | vs fp | commit step ms | vs fp | slowest step vs fp step |"
        rule += "---|---|---|---|---|"
    md += [head, rule]
    for r in data["rows"]:
        base = plain_row(data["rows"], r)
        commit = (
            f"{r['commit_primitives']} | {r['commit_primitives'] / base['primitives']:.2f}x"
            if "commit_primitives" in r
            else "- | -"
        )
        line = (
            f"| {r['path']} | {r['context']} | {r['method']} | {r['primitives']} | "
            f"{r['primitives'] / base['primitives']:.2f}x | {commit} |"
        )
        if times:
            cb = (
                f"{1000 * r['commit_build_s']:.1f} | {r['commit_build_s'] / base['build_s']:.2f}x"
                if "commit_build_s" in r
                else "- | -"
            )
            slowest = (
                f"{r['slowest_step_s'] / base['step_s']:.2f}x"
                if r["path"] == "ops" and "slowest_step_s" in r
                else "-"
            )
            line += (
                f" {1000 * r['build_s']:.1f} | {r['build_s'] / base['build_s']:.2f}x | {cb} |"
                f" {slowest} |"
            )
        md.append(line)
    if times and any("update_s" in r for r in data["rows"]):
        md += [
            "\n## Where the build goes (`--breakdown`)\n",
            "Medians over the steps that quantize no tile, per step and per layer (the "
            f"model has {data['layers']} layers): the caches' update_and_fetch, the attention "
            "calls (mlx-lm's scaled_dot_product_attention, which kvarn_mlx routes to packed "
            "attention) and the rest of the model call (projections, norms, RoPE, MLP). The "
            "timing wrappers add a little to every part.\n",
            "| path | context | method | update ms | attention ms | rest ms | update us/layer "
            "| attention us/layer | vs fp: update, attention, rest |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        rest = lambda r: r["build_s"] - r["update_s"] - r["attention_s"]
        for r in data["rows"]:
            b = plain_row(data["rows"], r)
            per = 1e6 / data["layers"]
            md.append(
                f"| {r['path']} | {r['context']} | {r['method']} | {1000 * r['update_s']:.2f} | "
                f"{1000 * r['attention_s']:.2f} | {1000 * rest(r):.2f} | "
                f"{per * r['update_s']:.1f} | {per * r['attention_s']:.1f} | "
                f"{r['update_s'] / b['update_s']:.2f}x, "
                f"{r['attention_s'] / b['attention_s']:.2f}x, {rest(r) / rest(b):.2f}x |"
            )
    return "\n".join(md) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="model folder or Hub id (default: the embedded model)"
    )
    p.add_argument("--contexts", default="2048,8192,32768")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument(
        "--steps",
        type=int,
        default=8,
        help="measured decode steps per method (after 2 warm-up steps)",
    )
    p.add_argument(
        "--rows",
        type=int,
        default=0,
        help="decode this many sequences as one batch (default: one, no batch)",
    )
    p.add_argument(
        "--counts-only", action="store_true", help="leave the host build times out of the markdown"
    )
    p.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="time with the wall clock (default) or the thread's CPU time: on a busy "
        "machine the latter leaves out waiting for a core, as Python builds the graph on "
        "one thread (a step's evaluation is then only its CPU time on this thread)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the caches' updates and the attention calls within each build",
    )
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="suffix for the output files (step_graph_<tag>.md)")
    p.add_argument("--quick", action="store_true", help=f"tiny run for CI: {QUICK}")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.steps = QUICK["contexts"], QUICK["steps"]
    methods = args.methods.split(",")
    if methods[0] != PLAIN:
        methods = [PLAIN] + [m for m in methods if m != PLAIN]
    paths = args.paths.split(",")
    bad = [x for x in paths if x not in PATHS]
    if bad:
        p.error(f"--paths: {bad} not in {PATHS}")
    from kvarn_mlx.loader import load

    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    model, _ = load(args.model)
    rows = []
    for path in paths:
        for ctx in (int(c) for c in args.contexts.split(",")):
            with metal_graph() if path == "metal" else contextlib.nullcontext():
                # The ops path's mx.compile traces (decode attention, tile quantization)
                # are made at a shape's first call: a long generation makes them at its
                # first steps and commits, so an uncounted pass makes them first.
                if path == "ops":
                    run(model, methods, ctx, args.steps, False, args.rows, clock)
                with timed_parts(clock) if args.breakdown else contextlib.nullcontext():
                    measured = run(model, methods, ctx, args.steps, True, args.rows, clock)
            for m, steps in zip(methods, measured):
                rows.append(summarize(path, ctx, m, steps, args.rows))
                r = rows[-1]
                print(
                    f"{path} {ctx} {m}: {r['primitives']} primitives, build "
                    f"{1000 * r['build_s']:.1f} ms"
                    + (
                        f", commit step {r['commit_primitives']} / "
                        f"{1000 * r['commit_build_s']:.1f} ms"
                        if "commit_primitives" in r
                        else ""
                    ),
                    file=sys.stderr,
                )
    name = args.model or "SmolLM2-135M-Instruct (embedded, float32)"
    meta = metadata(
        name, "python benchmarks/step_graph.py " + " ".join(sys.argv[1:] if argv is None else argv)
    )
    data = {"meta": meta, "steps": args.steps, "rows": rows, "layers": len(model.layers)}
    if args.rows:
        data["batch_rows"] = args.rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "step_graph" + (f"_{args.tag}" if args.tag else "")
    text = render(data, times=not args.counts_only)
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    print(text)
    return data


if __name__ == "__main__":
    main()
