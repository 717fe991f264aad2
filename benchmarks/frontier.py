"""The memory-quality frontier: mean KL to the plain cache against KV bytes per
token, KVarN's presets and mlx-lm's QuantizedKVCache on the same axes.

KL, top-1 agreement: from a fidelity run's json (python -m kvarn_mlx.eval
fidelity), at its longest context L. Bytes: every method's caches
(kvarn_mlx.eval.methods.make_caches on the same model) filled with L tokens of
float16 K/V of the model's shapes, in the run's chunks, and measured from the
arrays they hold (kvarn_mlx.memory): what a float16 model's cache holds. (The
fidelity run used float32 weights on CPU, so there the sink, the tail and
mlx-lm's scales are float32; its bytes are kept in the table too.) The x axis is
bytes per token of the layers whose cache grows with the context (sliding-window
layers hold a fixed window whatever the method).

A KVarN method is "on or below" mlx-lm's frontier at its byte budget when no
mlx-lm cache holding at most as many bytes has a lower mean KL.

    python benchmarks/frontier.py benchmarks/results/fidelity_presets_smollm2.json --name smollm2
    python benchmarks/frontier.py benchmarks/results/fidelity_presets_gemma3.json --name gemma3 \\
        --model embedded:gemma-3-270m
"""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvarn_mlx.eval.methods import cache_bytes, make_caches  # noqa: E402
from kvarn_mlx.eval.runner import meta_markdown, metadata, pyplot, write_results  # noqa: E402
from kvarn_mlx.loader import load  # noqa: E402


def is_mlx(name):
    return name.startswith("mlxq")


def layer_shapes(model):
    """(kv heads, head dim) of each layer's keys, from a one-token run on mlx-lm's plain cache."""
    caches = mlx_cache.make_prompt_cache(model)
    model(mx.array([[1]]), cache=caches)
    return [c.keys.shape[1:4:2] for c in caches]


def float16_bytes(model, name, tokens, chunk):
    """cache_bytes of method `name`'s caches holding `tokens` tokens of float16 K/V."""
    caches, shapes = make_caches(model, name), layer_shapes(model)
    for s in range(0, tokens, chunk):
        n = min(chunk, tokens - s)
        for c, (H, D) in zip(caches, shapes):
            k, v = (mx.random.normal((1, H, n, D)).astype(mx.float16) for _ in range(2))
            mx.eval(c.update_and_fetch(k, v))
            mx.eval(getattr(c, "held_arrays", list)())  # KVarN: the tiles quantized in this step
    return cache_bytes(caches)


def status(points):
    """Each point with `frontier`: for KVarN, the best mlx-lm KL at no more bytes and
    whether the point is on or below it; for mlx-lm, the best KVarN KL at no more bytes.
    `pareto`: no point of its own kind has fewer or equal bytes and a lower KL."""
    for p in points:
        others = [
            q
            for q in points
            if is_mlx(q["method"]) != is_mlx(p["method"])
            and q["bytes_per_token"] <= p["bytes_per_token"]
        ]
        best = min(others, key=lambda q: q["kl_mean"], default=None)
        p["best_other"] = best and best["method"]
        p["best_other_kl"] = best and best["kl_mean"]
        p["on_or_below_mlx"] = (
            None if is_mlx(p["method"]) else (best is None or p["kl_mean"] <= best["kl_mean"])
        )
        own = [q for q in points if is_mlx(q["method"]) == is_mlx(p["method"]) and q is not p]
        p["pareto"] = not any(
            q["bytes_per_token"] <= p["bytes_per_token"] and q["kl_mean"] < p["kl_mean"]
            for q in own
        )
    return points


def choose(points, plain, near_lossless_kl, usable_kl=0.1):
    """The recommended KVarN methods: fewest bytes with KL <= usable_kl; lowest KL at <= 1/2
    and <= 1/4 of the plain float16 cache's bytes; fewest bytes with KL <= near_lossless_kl."""
    kv = [p for p in points if not is_mlx(p["method"])]
    usable = [p for p in kv if p["kl_mean"] <= usable_kl]

    def best(budget):
        fit = [p for p in kv if p["bytes_per_token"] <= budget]
        return min(fit, key=lambda p: p["kl_mean"])["method"] if fit else None

    lossless = [p for p in kv if p["kl_mean"] <= near_lossless_kl]
    return {
        "most_context": min(usable, key=lambda p: (p["bytes_per_token"], p["kl_mean"]))["method"]
        if usable
        else None,
        "usable_kl": usable_kl,
        "best_at_half_memory": best(plain / 2),
        "best_at_quarter_memory": best(plain / 4),
        "near_lossless": min(lossless, key=lambda p: (p["bytes_per_token"], p["kl_mean"]))["method"]
        if lossless
        else None,
        "near_lossless_kl": near_lossless_kl,
    }


def markdown(res, meta_md):
    L, plain, N = res["context"], res["plain_fp16_bytes_per_token"], res["long_context"]
    out = [
        f"# Memory-quality frontier: {res['model']}, {L} tokens\n",
        meta_md,
        "\nKL, top-1: "
        + "; then ".join(
            f"`{r['command']}` ({r['date']}, attention {r['attention']})"
            for r in res["fidelity_runs"]
        )
        + f" (a later run's rows replace an earlier one's; text {res['source']}, "
        f"{res['positions']}, float32 "
        f"weights). Bytes/token: each method's caches filled with {L} tokens of float16 "
        'K/V of the model\'s shapes and measured from the arrays held; "growing layers" leaves out '
        "sliding-window layers (a fixed window whatever the method). Plain float16 cache: "
        f"{plain:.0f} bytes/token "
        'in the growing layers. "mlx-lm best at <= bytes": the lowest mean KL of mlx-lm\'s '
        "QuantizedKVCache "
        "(group 64) at no more bytes; KVarN is on or below mlx-lm's frontier there when its KL is "
        "no higher. "
        "Pareto: no method of its own kind has fewer or equal bytes and a lower KL.\n",
        "| method | attention | K/V bits | KL mean | KL p99 | top-1 | bytes/token (growing layers) "
        "| vs plain fp16 | whole cache bytes/token | float32 run bytes/token | mlx-lm best at <= "
        "bytes | on/below "
        "mlx-lm | Pareto |" + (f" bytes/token at {N} tokens (vs plain) |" if N else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if N else ""),
    ]
    for p in sorted(res["points"], key=lambda p: p["bytes_per_token"]):
        other = (
            f"{p['best_other']} ({p['best_other_kl']:.3g})"
            if p["best_other"] and not is_mlx(p["method"])
            else ("none" if not is_mlx(p["method"]) else "")
        )
        on = "" if p["on_or_below_mlx"] is None else ("yes" if p["on_or_below_mlx"] else "**no**")
        out.append(
            f"| {p['method']} | {p['attention']} | {p['bits_kv']} | {p['kl_mean']:.3g} | "
            f"{p['kl_p99']:.3g} | {p['top1_agree']:.3f} | {p['bytes_per_token']:.0f} | "
            f"{plain / p['bytes_per_token']:.2f}x | {p['whole_bytes_per_token']:.0f} | "
            f"{p['run_bytes_per_token']:.0f} | {other} | {on} | {'yes' if p['pareto'] else ''} |"
            + (
                f" {p['long_bytes_per_token']:.0f} "
                f"({res['plain_fp16_long_bytes_per_token'] / p['long_bytes_per_token']:.2f}x) |"
                if N
                else ""
            )
        )
    out.append("\nmlx-lm's points against KVarN's (the lowest KVarN mean KL at no more bytes):\n")
    for p in res["points"]:
        if is_mlx(p["method"]):
            b = p["best_other"]
            out.append(
                f"- {p['method']}: {p['bytes_per_token']:.0f} bytes/token, KL {p['kl_mean']:.3g}; "
                + (
                    f"KVarN {b} at no more bytes: KL {p['best_other_kl']:.3g} (mlx-lm's KL is "
                    f"{p['kl_mean'] / max(p['best_other_kl'], 1e-12):.3g}x KVarN's)"
                    if b
                    else "no KVarN method at no more bytes"
                )
            )
    below = [p["method"] for p in res["points"] if p["on_or_below_mlx"] is False]
    out.append(
        "\nKVarN methods above mlx-lm's frontier: " + (", ".join(below) if below else "none") + "."
    )
    c = res["choices"]
    out.append(
        f"\nChoices by these numbers: most context (fewest bytes with mean KL <= {c['usable_kl']}) "
        f"{c['most_context']}; lowest KL at <= 1/2 of the plain cache's bytes "
        f"{c['best_at_half_memory']}; at <= 1/4 {c['best_at_quarter_memory']}; fewest bytes with "
        f"mean KL <= {c['near_lossless_kl']} {c['near_lossless']}."
    )
    return "\n".join(out) + "\n"


def plotted_kl(p):
    """A point's mean KL as drawn: floored so that a zero shows on the log axis."""
    return max(p["kl_mean"], 1e-6)


def kl_vs_bytes_axes(ax, tokens, title):
    """Label ax as a frontier (tail_frontier.py's too): mean KL to the plain cache, log
    scale, against KV bytes per token of the growing layers at `tokens` tokens."""
    ax.set(
        yscale="log",
        xlabel=f"KV bytes per token, growing layers, float16 K/V, {tokens} tokens (measured)",
        ylabel="mean KL to the plain cache (nats)",
        title=title,
    )


def plot(res, folder):
    plt = pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(9, 6))
    kinds = {
        "KVarN": lambda m: "+" not in m and not is_mlx(m),
        "KVarN, fp8 scales": lambda m: "+fp8" in m,
        "KVarN, boundary layers plain": lambda m: "+fp16" in m,
        "mlx-lm QuantizedKVCache": is_mlx,
    }
    style = {
        "KVarN": "o",
        "KVarN, fp8 scales": "^",
        "KVarN, boundary layers plain": "s",
        "mlx-lm QuantizedKVCache": "X",
    }
    pts = res["points"]
    for label, keep in kinds.items():
        pp = [p for p in pts if keep(p["method"])]
        if pp:
            ax.scatter(
                [p["bytes_per_token"] for p in pp],
                [plotted_kl(p) for p in pp],
                marker=style[label],
                s=60 if is_mlx(pp[0]["method"]) else 30,
                label=label,
                zorder=3,
            )
        for p in pp:
            ax.annotate(
                p["method"],
                (p["bytes_per_token"], plotted_kl(p)),
                fontsize=6,
                xytext=(3, 2),
                textcoords="offset points",
            )
    for mlx, color in ((True, "C3"), (False, "C0")):  # each side's Pareto frontier
        pp = sorted(
            (p for p in pts if is_mlx(p["method"]) == mlx and p["pareto"]),
            key=lambda p: p["bytes_per_token"],
        )
        ax.plot(
            [p["bytes_per_token"] for p in pp],
            [plotted_kl(p) for p in pp],
            "-",
            color=color,
            alpha=0.5,
            drawstyle="steps-post",
            label=f"{'mlx-lm' if mlx else 'KVarN'} frontier",
        )
    ax.axvline(
        res["plain_fp16_bytes_per_token"], color="k", ls="--", lw=1, label="plain float16 cache"
    )
    kl_vs_bytes_axes(ax, res["context"], f"{res['model']}: memory vs fidelity")
    ax.legend(fontsize=7)
    fig.tight_layout()
    f = folder / "frontier.png"
    fig.savefig(f, dpi=120)
    plt.close("all")
    return [f]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "fidelity_json",
        type=Path,
        nargs="+",
        help=(
            "fidelity runs of one model and text; a later run's rows replace an earlier one's of "
            "the same method"
        ),
    )
    p.add_argument("--name", required=True, help="suffix of the result files (frontier_<name>)")
    p.add_argument(
        "--model",
        default=None,
        help="the model of the fidelity run (default: the embedded SmolLM2)",
    )
    p.add_argument("--near-lossless-kl", type=float, default=1e-3)
    p.add_argument(
        "--usable-kl", type=float, default=0.1, help="the most-context choice's largest mean KL"
    )
    p.add_argument(
        "--long-context",
        type=int,
        default=None,
        help="also measure bytes/token at this many tokens (where the sink and tail weigh less)",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    runs = [json.loads(f.read_text()) for f in args.fidelity_json]
    fid = runs[0]
    L = max(r["context"] for r in fid["result"]["rows"])
    rows = {
        r["method"]: {**r, "attention": run["meta"].get("attention")}
        for run in runs
        for r in run["result"]["rows"]
        if r["context"] == L
    }.values()
    model, _ = load(args.model)
    points, plain = [], None
    for r in rows:
        b = float16_bytes(model, r["method"], L, fid["result"]["chunk"])
        N = args.long_context
        long = (
            float16_bytes(model, r["method"], N, fid["result"]["chunk"])["growing_bytes"] / N
            if N
            else None
        )
        if r["method"] == "fp":
            plain, plain_long = b["growing_bytes"] / L, long
            continue
        points.append(
            {
                **{
                    k: r[k]
                    for k in (
                        "method",
                        "bits_kv",
                        "kl_mean",
                        "kl_p99",
                        "top1_agree",
                        "ppl_delta",
                        "attention",
                    )
                },
                "bytes_per_token": b["growing_bytes"] / L,
                "whole_bytes_per_token": b["bytes"] / L,
                "run_bytes_per_token": r["bytes"] / L,
                "long_bytes_per_token": long,
            }
        )
        print(
            f"{r['method']}: {points[-1]['bytes_per_token']:.0f} bytes/token, KL "
            f"{r['kl_mean']:.4f}",
            file=sys.stderr,
        )
    res = {
        "model": fid["meta"]["model"],
        "context": L,
        "source": fid["result"]["source"],
        "positions": fid["result"]["positions"],
        "fidelity_runs": [
            {
                "command": run["meta"]["command"],
                "date": run["meta"]["date"],
                "attention": run["meta"].get("attention"),
            }
            for run in runs
        ],
        "plain_fp16_bytes_per_token": plain,
        "points": status(points),
        "long_context": args.long_context,
        "plain_fp16_long_bytes_per_token": plain_long,
    }
    res["choices"] = choose(points, plain, args.near_lossless_kl, args.usable_kl)
    meta = metadata(
        res["model"],
        "python benchmarks/frontier.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    write_results(
        args.out,
        "frontier",
        args.name,
        meta,
        res,
        markdown(res, meta_markdown(meta)),
        lambda folder: plot(res, folder),
    )
    return res


if __name__ == "__main__":
    main()
