"""The precision tail's frontier: mean KL to the plain cache against KV bytes per
token, for presets with their newest N tokens kept in full precision
(KVarNConfig.tail_tokens; eval methods PRESET+tailN).

KL, top-1: from fidelity runs (python -m kvarn_mlx.eval fidelity), at each of
their contexts. Bytes/token: each method's caches filled with that many tokens
of float16 K/V of the model's shapes, measured from the
arrays they hold (kvarn_mlx.memory), for the layers whose cache grows with the
context (sliding-window layers hold a fixed window whatever the method); also at
--long contexts, where a fixed tail weighs less. The caches are filled with
zeros in 4,096-token chunks and never evaluated: array shapes alone fix the
bytes, and preallocated room is left out, so the chunks do not change them.

    python benchmarks/tail_frontier.py benchmarks/results/fidelity_tail_smollm2.json \\
        --name smollm2
"""

import argparse
import json
import re
import sys
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.frontier import kl_vs_bytes_axes, layer_shapes, plotted_kl  # noqa: E402
from kvarn_mlx.eval.methods import cache_bytes, make_caches, profile_method  # noqa: E402
from kvarn_mlx.eval.runner import meta_markdown, metadata, pyplot, write_results  # noqa: E402
from kvarn_mlx.loader import load  # noqa: E402


def split(method):
    """(preset, tail tokens) of PRESET+tailN (N = 0 without the variant); None for fp.
    A calibrated mix (PROFILE.json@PRESET) shows as mix@PRESET."""
    if method == "fp":
        return None
    m = re.fullmatch(r"(.+?)(?:\+tail(\d+))?", method)
    preset = m.group(1)
    if profile_method(preset):
        preset = "mix@" + preset.rpartition("@")[2]
    return preset, int(m.group(2) or 0)


def float16_bytes_per_token(model, method, tokens, chunk=4096):
    """Growing layers' bytes per token of `method`'s caches holding `tokens` float16 tokens."""
    caches, shapes = make_caches(model, method), layer_shapes(model)
    for s in range(0, tokens, chunk):
        n = min(chunk, tokens - s)
        for c, (H, D) in zip(caches, shapes):
            z = mx.zeros((1, H, n, D), mx.float16)
            c.update_and_fetch(z, z)
    return cache_bytes(caches)["growing_bytes"] / tokens


def collect(runs, model, long_contexts, methods=None):
    """Points of the first run's contexts (other runs add rows at those contexts; a
    method's row at a context is the first run's that has it)."""
    contexts = {r["context"] for r in runs[0]["result"]["rows"]}
    first = {}
    for run in runs:
        for r in run["result"]["rows"]:
            if r["context"] in contexts and (
                methods is None or r["method"] in methods or r["method"] == "fp"
            ):
                first.setdefault((r["method"], r["context"]), r)
    rows = list(first.values())
    points = []
    for L in sorted({r["context"] for r in rows}):
        plain = float16_bytes_per_token(model, "fp", L)
        for r in rows:
            if r["context"] != L or split(r["method"]) is None:
                continue
            preset, tail = split(r["method"])
            p = {
                "method": r["method"],
                "preset": preset,
                "tail": tail,
                "context": L,
                **{k: r[k] for k in ("kl_mean", "kl_p99", "top1_agree", "ppl_delta")},
                "bytes_per_token": float16_bytes_per_token(model, r["method"], L),
                "plain_bytes_per_token": plain,
                "run_bytes_per_token": (r.get("growing_bytes") or r["bytes"]) / L,
                "long": {n: float16_bytes_per_token(model, r["method"], n) for n in long_contexts},
            }
            points.append(p)
            print(
                f"{L} {r['method']}: {p['bytes_per_token']:.0f} bytes/token, KL {p['kl_mean']:.4f}",
                file=sys.stderr,
            )
    for p in points:  # on the frontier: no point of this context has <= bytes and a lower KL
        p["pareto"] = not any(
            q["context"] == p["context"]
            and q["bytes_per_token"] <= p["bytes_per_token"]
            and q["kl_mean"] < p["kl_mean"]
            for q in points
        )
        base = next(
            q
            for q in points
            if q["context"] == p["context"] and q["preset"] == p["preset"] and q["tail"] == 0
        )
        p["kl_vs_no_tail"] = p["kl_mean"] / base["kl_mean"]
        p["bytes_vs_no_tail"] = p["bytes_per_token"] / base["bytes_per_token"]
    return points


def markdown(res, meta_md):
    out = [
        f"# The precision tail: KL against KV bytes, {res['model']}\n",
        meta_md,
        "\nKL, top-1: "
        + "; ".join(f"`{r['command']}` ({r['date']})" for r in res["fidelity_runs"])
        + f" (teacher-forced, text {res['source']}, {res['positions']}, prefill in "
        f"{res['chunk']}-token chunks, float32 weights). Bytes/token: each method's caches "
        "filled with that many tokens of float16 K/V of the model's shapes and measured "
        "from the arrays held, growing layers only (sliding-window layers hold a fixed window "
        "whatever the method); the float32 run's own bytes are in the json. KL and bytes "
        'ratios are against the same preset without a tail. "Pareto": no method at this '
        "context holds fewer or equal bytes with a lower mean KL.\n",
    ]
    longs = res["long_contexts"]
    for L in sorted({p["context"] for p in res["points"]}):
        pts = [p for p in res["points"] if p["context"] == L]
        out.append(
            f"\n## {L} tokens (plain float16 cache: {pts[0]['plain_bytes_per_token']:.0f} "
            "bytes/token)\n"
        )
        out.append(
            "| preset | tail | KL mean | KL p99 | top-1 | KL vs no tail | bytes/token | vs plain "
            "| bytes vs no tail |" + "".join(f" bytes/token at {n} |" for n in longs) + " Pareto |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|" + "---|" * len(longs) + "---|")
        for p in sorted(pts, key=lambda p: (p["preset"], p["tail"])):
            out.append(
                f"| {p['preset']} | {p['tail']} | {p['kl_mean']:.4g} | {p['kl_p99']:.3g} | "
                f"{p['top1_agree']:.3f} | {p['kl_vs_no_tail']:.2f} | {p['bytes_per_token']:.0f} | "
                f"{p['plain_bytes_per_token'] / p['bytes_per_token']:.2f}x | "
                f"{p['bytes_vs_no_tail']:.2f} |"
                + "".join(f" {p['long'][n]:.0f} |" for n in longs)
                + (" yes |" if p["pareto"] else " |")
            )
    return "\n".join(out) + "\n"


def plot(res, folder):
    plt = pyplot()
    if plt is None:
        return []
    contexts = sorted({p["context"] for p in res["points"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6.5 * len(contexts), 4.8), squeeze=False)
    for ax, L in zip(axes[0], contexts):
        pts = [p for p in res["points"] if p["context"] == L]
        for preset in dict.fromkeys(p["preset"] for p in pts):
            pp = sorted((p for p in pts if p["preset"] == preset), key=lambda p: p["tail"])
            x, y = [p["bytes_per_token"] for p in pp], [plotted_kl(p) for p in pp]
            ax.plot(x, y, "o-", label=preset)
            for p in pp:
                ax.annotate(str(p["tail"]), (p["bytes_per_token"], plotted_kl(p)), fontsize=7)
        kl_vs_bytes_axes(ax, L, f"{res['model']}, {L} tokens (labels: tail tokens)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    f = folder / "tail_frontier.png"
    fig.savefig(f, dpi=110)
    plt.close("all")
    return [f]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("fidelity_json", type=Path, nargs="+", help="fidelity runs of one model")
    p.add_argument("--name", required=True, help="suffix of the result files (tail_<name>)")
    p.add_argument("--model", default=None, help="the runs' model (default: embedded SmolLM2)")
    p.add_argument(
        "--long", default="16384,32768", help="contexts to measure bytes/token at as well"
    )
    p.add_argument(
        "--methods",
        default=None,
        help="the runs' methods to show, comma-separated (default: all; e.g. another run's "
        "wider presets for comparison)",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    runs = [json.loads(f.read_text()) for f in args.fidelity_json]
    model, _ = load(args.model)
    longs = [int(n) for n in args.long.split(",") if n]
    res = {
        "model": runs[0]["meta"]["model"],
        "source": runs[0]["result"]["source"],
        "positions": runs[0]["result"]["positions"],
        "chunk": runs[0]["result"]["chunk"],
        "fidelity_runs": [
            {"command": r["meta"]["command"], "date": r["meta"]["date"]} for r in runs
        ],
        "long_contexts": longs,
        "points": collect(runs, model, longs, args.methods and set(args.methods.split(","))),
    }
    meta = metadata(
        res["model"],
        "python benchmarks/tail_frontier.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    write_results(
        args.out,
        "tail",
        args.name,
        meta,
        res,
        markdown(res, meta_markdown(meta)),
        lambda folder: plot(res, folder),
    )
    return res


if __name__ == "__main__":
    main()
