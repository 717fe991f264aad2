"""Decode tokens/s and memory vs context for the plain cache, mlx-lm's
QuantizedKVCache and KVarN presets, in one run (so the ratios share the
machine's state), plus the per-tile quantization overhead as a fraction of
decode time.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/decode_speed.py --contexts 1024,4096,16384,32768
    python benchmarks/decode_speed.py --quick --out /tmp/ds   # tiny contexts (CI)
    python benchmarks/decode_speed.py --rows 4 --contexts 1024,2048,4096,8192 \
        --methods fp,k4v2_g128,auto4v2 --tag batch4         # batched decode

With --rows N, N sequences decode as one batch, joined as mlx-lm's
BatchGenerator joins them (`merge`: BatchKVCache for fp, BatchKVarNCache for
KVarN); the context is the longest row's, the others are shorter by steps of
context / (2 N) + 128 / N tokens (row_lengths): as in a server's batch, the rows
differ and complete their tiles at spread steps. Tokens/s
counts every row's token; the tile-overhead section (single caches) is left out.

Caches are filled with random K/V to the context length instead of a real
prefill (decode cost does not depend on the values; a 16K prefill takes many
minutes on CPU), then the model decodes --steps tokens through its real
attention path: packed attention for KVarN, mlx-lm's quantized attention for
QuantizedKVCache. The share of decode time spent quantizing tiles: the time
of the update that commits one tile in every layer (K/V projections and
attention not included), through the caches' own path (one dispatch.quantize
call for all layers, waiting_tiles.py; the Metal kernel where there is one), spread
over the G decode steps that fill it, against the measured decode step. CPU
caveat: MLX's CPU quantized matmul is slow and single-threaded while float32
matmul runs on OpenBLAS, so these ratios say nothing about Apple silicon, where
the quantized kernels are fast.
"""

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import QuantizedKVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvarn_mlx import dispatch, memory, quant  # noqa: E402
from kvarn_mlx.cache import KVarNCache  # noqa: E402
from kvarn_mlx.config import get_preset  # noqa: E402
from kvarn_mlx.eval.runner import Progress, meta_markdown, metadata, pyplot  # noqa: E402
from kvarn_mlx.integration import make_cache  # noqa: E402

METHODS = ("fp", "mlxq8", "mlxq4", "k8v8_g128", "k4v4_g128", "k4v2_g128", "k2v2_g128", "auto4v2")
QUICK = dict(contexts="160,300", steps=2)


def make(model, name):
    if name == "fp":
        return mlx_cache.make_prompt_cache(model)
    if name.startswith("mlxq"):
        return [QuantizedKVCache(group_size=64, bits=int(name[4:])) for _ in model.layers]
    return make_cache(model, name)


def fill(caches, H, D, ctx, chunk=1024, seed=0):
    """Append ctx random tokens to every layer's cache (float32, unit scale)."""
    key = mx.random.key(seed)
    for s in range(0, ctx, chunk):
        n = min(chunk, ctx - s)
        key, k1, k2 = mx.random.split(key, 3)
        k = mx.random.normal((1, H, n, D), key=k1)
        v = mx.random.normal((1, H, n, D), key=k2)
        for c in caches:
            out = c.update_and_fetch(k, v)
            # KVarNCache returns a lazy dequantized view: evaluate only what it stores.
            mx.eval(
                [x for x in c.state.values() if isinstance(x, mx.array)]
                if isinstance(c, KVarNCache)
                else out
            )


# The extra 128 / rows tokens spread the rows' tile boundaries over the steps, as
# in a server's batch: rows that complete their tiles at the same step would make
# the few measured steps all commit steps (waiting_tiles.py) or none.
def row_lengths(ctx, rows):
    """Tokens per batch row: the last row at the context, the others shorter by
    steps of context / (2 rows) + 128 / rows tokens."""
    step = ctx // (2 * rows) + 128 // rows
    return [ctx - (rows - 1 - i) * step for i in range(rows)]


def filled_batch(model, name, lengths, H, D):
    """The method's caches for one sequence per length, each filled alone, then
    joined as mlx-lm's BatchGenerator joins them (type(cache).merge per layer)."""
    seqs = []
    for i, n in enumerate(lengths):
        seqs.append(make(model, name))
        fill(seqs[-1], H, D, n, seed=i)
    return [type(layer[0]).merge(list(layer)) for layer in zip(*seqs)]


def held_bytes(caches):
    """Bytes the caches hold for their tokens (measured arrays, preallocated room left
    out); for batches, every array held (room and padding included)."""
    if not isinstance(caches[0], (KVarNCache, mlx_cache.KVCache, QuantizedKVCache)):
        return sum(c.nbytes for c in caches)
    b = memory.cache_bytes(caches)
    return b["held"] - b["unused"]


def decode_rates(model, all_caches, steps, warmup=2, rows=1):
    """Median seconds per decode step for each cache list, and of its graph
    building alone (the model call, Python: mlx-lm's generate_step builds the
    next step while this one evaluates, on the same CPU cores here), stepping
    the methods round-robin so that load from other processes hits them alike."""
    toks = [mx.array([[1]] * rows) for _ in all_caches]
    times = [[] for _ in all_caches]
    for i in range(warmup + steps):
        for j, caches in enumerate(all_caches):
            t0 = time.perf_counter()
            y = model(toks[j], cache=caches)
            toks[j] = mx.argmax(y[:, -1:], axis=-1)
            t1 = time.perf_counter()
            mx.eval(toks[j])
            if i >= warmup:
                times[j].append((time.perf_counter() - t0, t1 - t0))
    return [tuple(float(x) for x in np.median(t, axis=0)) for t in times]


def tile_overhead(n_layers, H, D, cfg, reps=5):
    """Seconds of the update that commits a tile in every layer (what decode pays
    every G tokens; the whole update, so a bound from above): the caches' own
    path, where the tiles a step leaves waiting are quantized together at the
    next update (kvarn_mlx/waiting_tiles.py); and the same without normalization
    iterations."""

    def once(c):
        G, S = c.group_size, c.sink_size
        caches = [KVarNCache(c) for _ in range(n_layers)]
        first = mx.random.normal((1, H, S + G, D))
        token = mx.random.normal((1, H, 1, D))
        mx.eval(first, token)

        def step():
            t0 = time.perf_counter()
            for x in caches:
                x.update_and_fetch(token, token)
            mx.eval([a for x in caches for a in x.held_arrays()])
            return time.perf_counter() - t0

        for x in caches:
            # the sink and a first tile ("auto": decided at the next update)
            x.update_and_fetch(first, first)
        out = []
        for _ in range(reps):
            while caches[0].n_tail < G:  # the tails fill: the next update commits
                step()
            out.append(step())
            assert caches[0].n_tail == 1
        return float(np.median(out))

    return once(cfg), once(replace(cfg, iters=0))


def per_layer_calls(n_layers, H, D, cfg, reps=5):
    """The same quantization as one dispatch.quantize call per layer in one graph
    (how a decode step committed its layers' tiles before waiting_tiles.py): the
    baseline of the one-call commit, in the same run."""
    x = mx.random.normal((1, H, 1, cfg.group_size, D))
    mx.eval(x)
    rotate = quant.can_rotate(D)

    def once():
        t0 = time.perf_counter()
        mx.eval(
            [
                dispatch.quantize(
                    x, x, cfg, bool(cfg.rotate_keys) and rotate, cfg.rotate_values and rotate
                ).arrays()
                for _ in range(n_layers)
            ]
        )
        return time.perf_counter() - t0

    once()
    return float(np.median([once() for _ in range(reps)]))


def render(data):
    md = [
        "# Decode speed and memory vs context\n",
        meta_markdown(data["meta"]),
        f"\nTokens/s from the median seconds per decode step over {data['steps']} steps (after 2 "
        "warm-up steps), caches filled with random K/V to the context. fp = mlx-lm KVCache "
        "holding the model's float32 K/V; mlxqB = mlx-lm QuantizedKVCache (group 64, B bits, "
        "its own quantized attention, no sink/tail); KVarN presets use packed attention. "
        "Methods decode round-robin, one step each in turn, so load from other processes hits "
        "all alike (absolute tok/s are noisy when other jobs share the machine, ratios less "
        "so). Cache bytes are measured from the held arrays; 'vs fp16' compares with a 2-byte "
        "fp16 KVCache (half the float32 one). Process peak memory is in the json. **CPU "
        "caveat**: MLX's CPU quantized matmul is slow and single-threaded while float32 matmul "
        "runs on OpenBLAS here (KVarN splits its tiles over two CPU streams); these ratios do "
        "not predict Apple-silicon speed. 'Graph ms' is the part of the step spent in the model "
        "call, where Python builds the step's graph (the cache update and attention ops) before "
        "anything is evaluated.\n",
    ]
    if data.get("batch_rows"):
        n = data["batch_rows"]
        md.append(
            f"Batched: {n} sequences decoding together (mlx-lm's merge: BatchKVCache for fp, "
            "BatchKVarNCache for KVarN); 'context' is the longest row, the others are shorter by "
            f"steps of context / {2 * n} + {128 // n} tokens (row_lengths: tile boundaries at "
            "spread steps). Tok/s counts every row's token; "
            "graph ms is the whole batch step's; cache MiB is every array held, the room and "
            "padding up to the longest row included.\n"
        )
    md += [
        "| context | method | tok/s | speed vs fp | graph ms | graph vs fp | cache MiB | "
        "smaller than fp (float32) | smaller than fp16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        graph = (
            f"{1000 * r['build_s']:.1f} | {r['build_vs_fp']:.2f}x" if "build_s" in r else "- | -"
        )
        md.append(
            f"| {r['context']} | {r['method']} | {r['tokens_per_s']:.2f} | "
            f"{r['speed_vs_fp']:.2f}x | {graph} | {r['cache_bytes'] / 2**20:.1f} | "
            f"{r['bytes_vs_fp']:.2f}x | {r['bytes_vs_fp'] / 2:.2f}x |"
        )
    if not data["overhead"]:
        return "\n".join(md) + "\n"
    md += [
        "\n## Tile-quantization overhead\n",
        "Time of the cache updates that quantize one tile in every layer (rotation + "
        "normalization + RTN + packing, K and V; the whole update, so a bound from above), "
        "through the caches' own path (all layers' waiting tiles in one call, "
        f"kvarn_mlx/waiting_tiles.py; dispatch.quantize: {data.get('quantize_path', 'MLX ops')}), "
        "spread over the G decode steps that fill it, as a fraction of the measured decode "
        "step time at that context. "
        "The paper reports 0.18% for the 8 normalization iterations on GPU.\n",
        "'One call per layer' is the same quantization as one dispatch.quantize call per layer "
        "in one graph, "
        "how a step committed its layers' tiles before the one-call commit (same run).\n",
        "| method | context | one tile, all layers (s) | one call per layer (s) | same, iters=0 "
        "(s) | fraction of decode | normalization alone |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in data["overhead"]:
        md.append(
            f"| {o['method']} | {o['context']} | {o['tile_s_all_layers']:.4f} | "
            f"{o['tile_s_per_layer_calls']:.4f} | {o['tile_s_all_layers_iters0']:.4f} | "
            f"{100 * o['fraction_of_decode']:.2f}% | {100 * o['normalization_fraction']:.2f}% |"
        )
    return "\n".join(md) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--contexts", default="1024,4096,16384,32768")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument(
        "--tag", default=None, help="suffix for the output files (decode_speed_<tag>.md)"
    )
    p.add_argument(
        "--rows",
        type=int,
        default=0,
        help="decode this many sequences as one batch (default: one, no batch)",
    )
    p.add_argument("--quick", action="store_true", help=f"tiny run for CI: {QUICK}")
    p.add_argument("--render", default=None, help="only rewrite the markdown from this json")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.steps = QUICK["contexts"], QUICK["steps"]
    if args.render:
        data = json.loads(Path(args.render).read_text())
        data.setdefault("steps", 8)
        text = render(data) + "".join(f"\n![{f}]({f})\n" for f in data.get("plots", []))
        Path(args.render).with_suffix(".md").write_text(text)
        return print(text)
    from kvarn_mlx.loader import load

    model, _ = load(args.model)
    name = args.model or "SmolLM2-135M-Instruct (embedded, float32)"
    a = model.args
    H, D = a.num_key_value_heads, a.head_dim or a.hidden_size // a.num_attention_heads
    contexts = [int(c) for c in args.contexts.split(",")]
    methods = args.methods.split(",")
    if methods[0] != "fp":
        p.error("--methods: the first must be fp, the baseline of every ratio")
    if args.rows and any(m.startswith("mlxq") for m in methods):
        p.error("--rows: mlx-lm's QuantizedKVCache does not batch; leave mlxq* out")
    rows = []
    bar = Progress(len(contexts) * len(methods), "decode speed")
    n_rows = max(args.rows, 1)
    for ctx in contexts:
        all_caches = []
        for m in methods:
            if args.rows:
                all_caches.append(filled_batch(model, m, row_lengths(ctx, args.rows), H, D))
            else:
                all_caches.append(make(model, m))
                fill(all_caches[-1], H, D, ctx)
        mx.reset_peak_memory()
        secs = decode_rates(model, all_caches, args.steps, rows=n_rows)
        for m, caches, (sec, build) in zip(methods, all_caches, secs):
            rows.append(
                {
                    "context": ctx,
                    "method": m,
                    "s_per_token": sec / n_rows,
                    "tokens_per_s": n_rows / sec,
                    "build_s": build,
                    "cache_bytes": held_bytes(caches),
                }
            )
        rows[-1]["peak_memory_all_methods"] = mx.get_peak_memory()
        del all_caches
        bar.step(len(methods))
    for r in rows:
        base = next(b for b in rows if b["context"] == r["context"] and b["method"] == "fp")
        r["speed_vs_fp"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["build_vs_fp"] = r["build_s"] / base["build_s"]
        r["bytes_vs_fp"] = base["cache_bytes"] / r["cache_bytes"]

    overhead = []
    for m in methods:
        if m == "fp" or m.startswith("mlxq") or args.rows:
            continue
        cfg = get_preset(m)
        full, no_norm = tile_overhead(len(model.layers), H, D, cfg)
        per_layer = per_layer_calls(len(model.layers), H, D, cfg)
        for r in rows:
            if r["method"] == m:
                per_tok = full / cfg.group_size
                overhead.append(
                    {
                        "method": m,
                        "context": r["context"],
                        "tile_s_all_layers": full,
                        "tile_s_per_layer_calls": per_layer,
                        "tile_s_all_layers_iters0": no_norm,
                        "fraction_of_decode": per_tok / r["s_per_token"],
                        "normalization_fraction": (full - no_norm)
                        / cfg.group_size
                        / r["s_per_token"],
                    }
                )

    meta = metadata(
        name,
        "python benchmarks/decode_speed.py " + " ".join(sys.argv[1:] if argv is None else argv),
    )
    path = (
        "Metal kernel" + (" (MSL emulator)" if dispatch.emulated() else "")
        if dispatch.use_metal()
        else "MLX ops"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "decode_speed" + (f"_{args.tag}" if args.tag else "")
    md = render(
        {
            "meta": meta,
            "rows": rows,
            "overhead": overhead,
            "steps": args.steps,
            "quantize_path": path,
            "batch_rows": args.rows,
        }
    ).split("\n")
    plt = pyplot()
    plots = []
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for m in methods:
            rr = [r for r in rows if r["method"] == m]
            axes[0].plot([r["context"] for r in rr], [r["tokens_per_s"] for r in rr], "o-", label=m)
            axes[1].plot(
                [r["context"] for r in rr], [r["cache_bytes"] / 2**20 for r in rr], "o-", label=m
            )
        axes[0].set(
            xscale="log",
            yscale="log",
            xlabel="context",
            ylabel="decode tokens/s",
            title="decode speed (CPU)",
        )
        axes[1].set(
            xscale="log",
            yscale="log",
            xlabel="context",
            ylabel="KV cache MiB (measured)",
            title="cache memory",
        )
        for ax in axes:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=110)
        plots.append(f"{stem}.png")
        md.append(f"\n![{stem}.png]({stem}.png)")
    text = "\n".join(md) + "\n"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "rows": rows,
                "overhead": overhead,
                "plots": plots,
                "steps": args.steps,
                "quantize_path": path,
                "batch_rows": args.rows,
            },
            indent=1,
        )
    )
    print(text)


if __name__ == "__main__":
    main()
