"""The planner's KV bytes against the bytes caches hold (results/plan_bound.md).

For each model, each cache the planner lists and each context n, the caches are
filled as mlx_lm.generate fills them: the prompt's first n - 1 tokens in chunks of
2,048, token n in the first generation step, then --decode one-token steps. After
every step the bytes held are measured from the arrays (memory.cache_bytes). The
planner's figure (plan.py, byte_models.py: the most any order of steps can leave
held up to that many tokens) is compared with them twice:
  - at every step: held <= the planner's bytes at that step's context (the bound);
  - at the end: the planner's bytes at the last context over the most held at any
    step (the ratio; 1.00 is exact). At these contexts the sink and whole tiles
    end exactly at n, so token n finishes a tile that waits in the tail for its
    commit turn during the first decode steps (waiting_tiles.py): the most is held
    then, and that is what the planner must cover.

Three ways to fill:
  --fill random  keys and values of the model's real shapes, random, each layer's
                 update_and_fetch called in layer order at every step as the model
                 calls them, evaluated after each step. No weights are read (the
                 model class is built from config.json, as the planner does).
  --fill zeros   the same with zeros left unevaluated: nothing is computed, the
                 caches' arrays still take their shapes (every cache, model and
                 context in minutes).
  --fill model   the model itself, weights loaded, prefilling pydoc text and
                 decoding greedily (kvarn_mlx's patched attention, as generate).
Held bytes depend on shapes only, not on values (the `auto` presets' key-rotation
choice changes flags, not array shapes): --report compares the random and model
fills' bytes after every step with the zeros fill's.

    python benchmarks/plan_bound.py --model embedded:qwen2.5-coder-1.5b --fill zeros \
        --contexts 4096 16384 32768 --out benchmarks/results/plan_bound_qwen_zeros.json
    python benchmarks/plan_bound.py --model M --fill model --contexts 4096 \
        --caches auto4v2 k2v2_g128 --out ...
    python benchmarks/plan_bound.py --report benchmarks/results/plan_bound_*.json \
        --out benchmarks/results/plan_bound.md
"""

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from kvarn_mlx import byte_models, memory, model_info, plan
from kvarn_mlx.atomic_json import write_json

CHUNK = byte_models.PREFILL_STEP_SIZE


def build_caches(model, name, tail_tokens=None):
    """The caches the CLIs build for cache `name` of the planner's table (a KVarN
    preset with tail_tokens, as --kv-tail-tokens sets it; None: make_cache's default)."""
    if name.startswith("plain"):
        return make_prompt_cache(model)
    if name.startswith("mlx-lm"):
        bits = int(name.split()[1].split("-")[0])
        return [
            QuantizedKVCache(byte_models.MLX_KV_GROUP_SIZE, bits) if type(c) is KVCache else c
            for c in make_prompt_cache(model)
        ]
    return plan._quiet_make_cache(model, name, tail_tokens=tail_tokens)


def steps(n, decode):
    """Token counts of each step: chunks of the first n - 1 tokens, then one at a time."""
    out = [min(CHUNK, n - 1 - i) for i in range(0, n - 1, CHUNK)]
    return out + [1] * (1 + decode)


def fill_arrays(model, caches, counts, random=True, seed=0):
    """Feed keys and values of each layer's shape step by step, layer after layer:
    random and evaluated, or zeros left unevaluated (array bytes follow from shapes,
    so nothing needs computing). Yield (tokens so far, bytes held) after each step."""
    layers = byte_models.model_layers(model)
    flat = [c for c, _ in byte_models.flat_caches(caches)]
    key, total = mx.random.key(seed), 0
    for L in counts:
        for layer, c in zip(layers, flat):
            if layer.kind == "state":
                continue
            dt = byte_models.DTYPES[layer.dtype]
            shapes = (1, layer.heads, L, layer.k_dim), (1, layer.heads, L, layer.v_dim)
            if random:
                key, k1, k2 = mx.random.split(key, 3)
                k, v = (mx.random.normal(s, key=x).astype(dt) for s, x in zip(shapes, (k1, k2)))
            else:
                k, v = (mx.zeros(s, dt) for s in shapes)
            c.update_and_fetch(k, v)
            if random:
                mx.eval(c.state)
        total += L
        yield total, memory.cache_bytes(flat)["held"]


def prompt_tokens(tokenizer, n):
    """n tokens of CPython's pydoc topics, repeated if they run out."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))
    while len(ids) < n:
        ids = ids + ids
    return mx.array(ids[:n])


def fill_model(model, tokenizer, caches, n, counts):
    """The model's own prefill of n prompt tokens and greedy decoding; yield
    (tokens so far, bytes held) after each step."""
    prompt = prompt_tokens(tokenizer, n)
    flat = [c for c, _ in byte_models.flat_caches(caches)]
    total, y = 0, None
    for L in counts:
        x = prompt[total : total + L] if total < n else y
        logits = model(x[None], cache=caches)
        y = mx.argmax(logits[0, -1:], axis=-1)
        mx.eval(y, [c.state for c in flat])
        total += L
        yield total, memory.cache_bytes(flat)["held"]


def run(args):
    info = model_info.read_model(args.model)
    dtype = model_info.config_dtype(info.config) or "float16"
    lazy = model_info.lazy_model(info.config, dtype)
    tail = args.tail_tokens
    plans = plan.cache_plans(info.config, dtype, model=lazy, tail_tokens=tail)
    plans = {p.name: p for p in plans if p.error is None}
    names = args.caches or list(plans)
    unknown = [c for c in names if c not in plans]
    if unknown:
        sys.exit(f"error: the planner lists no cache {unknown} for this model: {list(plans)}")
    model = tokenizer = None
    if args.fill == "model":
        from kvarn_mlx.integration import patch
        from kvarn_mlx.loader import load

        model, tokenizer = load(args.model)
        patch()
    rows = []
    for n in args.contexts:
        counts = steps(n, args.decode)
        for name in names:
            if name == "plain (float16)":
                continue  # the model runs in its own dtype; float16 is the planner's aside
            t0 = time.time()
            caches = build_caches(model or lazy, name, tail)
            if args.fill == "model":
                held = list(fill_model(model, tokenizer, caches, n, counts))
            else:
                held = list(fill_arrays(lazy, caches, counts, random=args.fill == "random"))
            bound = plans[name].peak
            over = [(t, h, bound(t)) for t, h in held if h > bound(t)]
            end = held[-1][0]
            most = max(h for _, h in held)
            rows.append(
                dict(
                    cache=name,
                    context=n,
                    end=end,
                    planner=bound(end),
                    most_held=most,
                    final_held=held[-1][1],
                    ratio=bound(end) / most,
                    ratio_final=bound(end) / held[-1][1],
                    bound_holds=not over,
                    over=over[:3],
                    held=held,
                    seconds=round(time.time() - t0, 1),
                )
            )
            r = rows[-1]
            print(
                f"{n:>6} {name:<18} planner {r['planner']:>12,} most {most:>12,} "
                f"{r['ratio']:.4f}x (final {r['ratio_final']:.3f}x) "
                f"{'ok' if not over else 'BOUND BROKEN'} {r['seconds']}s",
                flush=True,
            )
            del caches
            mx.clear_cache()
    return {
        "model": info.name,
        "dtype": dtype,
        "fill": args.fill,
        "decode": args.decode,
        "tail_tokens": tail,
        "prefill_step_size": CHUNK,
        "command": shlex.join(["python", "benchmarks/plan_bound.py", *sys.argv[1:]]),
        "rows": rows,
    }


def report(files):
    """Markdown of result files: per model, planner / most held for each cache and
    context, and whether each fill's per-step bytes equal the zeros fill's."""
    runs = [json.loads(Path(f).read_text()) for f in files]
    models = list(dict.fromkeys((r["model"], r.get("tail_tokens", 0)) for r in runs))
    lines = [
        "# The planner's KV bytes against the bytes caches hold",
        "",
        "Each cache filled as mlx_lm.generate fills it: the prompt's first n - 1 tokens in "
        "chunks of 2,048, token n, then 8 one-token steps; bytes held measured from the arrays "
        "after every step (memory.cache_bytes). Each cell: the planner's bytes at the last "
        "context (n + 8) over the most held at any step (>= 1 is a bound; 1 is exact), and in "
        "brackets over the bytes held after the last step. At these contexts token n finishes "
        "a tile, which waits in the tail for its commit turn during the first decode steps "
        "(waiting_tiles.py): the most is held then. `bound` says whether held <= the planner's "
        "bytes at every step's own context. Sliding-window layers (Gemma-3) hold a prefill "
        "chunk beside their window until the next step trims it, hence the large bracketed "
        "figures there. The 1,024 column, where present, is the context of the runs with the "
        "model itself.",
        "",
        "Commands:",
        "",
        *[f"    {r['command']}" for r in runs],
        "",
    ]
    for model, tail in models:
        mine = [r for r in runs if (r["model"], r.get("tail_tokens", 0)) == (model, tail)]
        zeros_runs = [r for r in mine if r["fill"] == "zeros"]
        if not zeros_runs:
            continue
        zeros = {**zeros_runs[0], "rows": [row for r in zeros_runs for row in r["rows"]]}
        contexts = sorted({row["context"] for row in zeros["rows"]})
        caches = list(dict.fromkeys(row["cache"] for row in zeros["rows"]))
        cell = {(row["cache"], row["context"]): row for row in zeros["rows"]}
        lines += [
            f"## {model} ({zeros['dtype']}; caches filled with unevaluated zeros"
            + (
                "; KVarN presets with make_cache's default tail)"
                if tail is None
                else f"; KVarN presets with tail_tokens={tail})"
                if tail
                else ")"
            ),
            "",
            "| cache | " + " | ".join(f"{n:,}" for n in contexts) + " | bound |",
            "|---|" + "---|" * (len(contexts) + 1),
        ]
        for c in caches:
            rows = [cell[c, n] for n in contexts if (c, n) in cell]
            lines.append(
                f"| {c} | "
                + " | ".join(
                    f"{cell[c, n]['ratio']:.3f} ({cell[c, n]['ratio_final']:.3f})"
                    if (c, n) in cell
                    else ""
                    for n in contexts
                )
                + f" | {'holds' if all(r['bound_holds'] for r in rows) else 'BROKEN'} |"
            )
        worst = max((r for r in zeros["rows"] if r["context"] >= 4096), key=lambda r: r["ratio"])
        lines += [
            "",
            f"From 4,096 tokens on, largest ratio: {worst['ratio']:.4f} ({worst['cache']} at "
            f"{worst['context']:,}); smallest: {min(r['ratio'] for r in zeros['rows']):.4f}.",
            "",
        ]
        for other in mine:
            if other["fill"] == "zeros":
                continue
            same = [
                row["held"] == cell[row["cache"], row["context"]]["held"]
                for row in other["rows"]
                if (row["cache"], row["context"]) in cell
            ]
            what = {
                "random": "random keys and values, evaluated after every step",
                "model": "the model itself prefilling pydoc text and decoding greedily",
            }[other["fill"]]
            lines += [
                f"Filled with {what} ({len(same)} runs at "
                f"{', '.join(f'{n:,}' for n in sorted({r['context'] for r in other['rows']}))}: "
                f"{', '.join(dict.fromkeys(r['cache'] for r in other['rows']))}): the bytes held "
                f"after every step equal the zeros fill's in {sum(same)} of {len(same)} runs.",
                "",
            ]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="as python -m kvarn_mlx.plan's --model")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--decode", type=int, default=8, help="one-token steps after token n")
    p.add_argument("--caches", nargs="+", default=None, help="default: every cache listed")
    p.add_argument("--fill", choices=("random", "zeros", "model"), default="random")
    p.add_argument(
        "--tail-tokens",
        type=int,
        default=None,
        help="the KVarN presets' tail_tokens (default: make_cache's, config.DEFAULT_TAIL_TOKENS)",
    )
    p.add_argument("--out", required=True, help="JSON results file (with --report: markdown)")
    p.add_argument("--report", nargs="+", default=None, help="write the markdown of these results")
    args = p.parse_args(argv)
    if args.report:
        Path(args.out).write_text(report(args.report) + "\n")
        return
    logging.getLogger("kvarn_mlx").setLevel(logging.ERROR)
    out = run(args)
    write_json(Path(args.out), out)


if __name__ == "__main__":
    main()
