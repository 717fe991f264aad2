"""KV memory against context, each preset labelled with its measured quality.

Fills one attention layer shaped like most Mac models' (8 kv heads of dim 128,
float16 K/V, one sequence) with the same random tokens for every cache, and
reads the bytes each holds (kvarn_mlx.memory's figure: every array, room
included) at each context on the way. The legend gives each cache's mean KL to
the plain cache from the committed frontier tables (teacher-forced, 1,024
tokens; frontier_smollm2.json and frontier_gemma3.json), so one picture shows
memory and quality together. A model holds one such layer per attention layer
(36 in Qwen3-4B), which the right-hand axis shows.

    python benchmarks/memory_vs_context.py [--contexts 1024 2048 ...] [--out benchmarks/results]
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvarn_mlx import KVarNCache, get_preset
from kvarn_mlx.eval.runner import meta_markdown, metadata, pyplot

HEADS, D, LAYERS = 8, 128, 36
RESULTS = Path(__file__).parent / "results"
# (label, name in the frontier tables, cache factory)
CACHES = [
    ("plain KVCache", None, KVCache),
    ("mlx-lm 8-bit", "mlxq8", lambda: QuantizedKVCache(group_size=64, bits=8)),
    ("mlx-lm 4-bit", "mlxq4", lambda: QuantizedKVCache(group_size=64, bits=4)),
    ("k8v8_g128", "k8v8_g128", lambda: KVarNCache(get_preset("k8v8_g128"))),
    ("k4v4_g128", "k4v4_g128", lambda: KVarNCache(get_preset("k4v4_g128"))),
    ("auto4v2 (default)", "auto4v2", lambda: KVarNCache(get_preset("auto4v2"))),
    ("auto2", "auto2", lambda: KVarNCache(get_preset("auto2"))),
]


def measure(make, contexts, chunk=1024):
    """Bytes the cache holds after each context in `contexts` (ascending)."""
    mx.random.seed(0)
    cache, out, filled = make(), [], 0
    for target in contexts:
        while filled < target:
            n = min(chunk, target - filled)
            k = mx.random.normal((1, HEADS, n, D)).astype(mx.float16)
            v = mx.random.normal((1, HEADS, n, D)).astype(mx.float16)
            cache.update_and_fetch(k, v)
            mx.eval(cache.held_arrays() if isinstance(cache, KVarNCache) else cache.state)
            filled += n
        out.append(cache.nbytes)
    return out


def kl_of(name):
    """Mean KL of `name` on each embedded model in the committed frontier tables."""
    out = {}
    for model, stem in (("SmolLM2", "frontier_smollm2"), ("Gemma-3", "frontier_gemma3")):
        points = json.loads((RESULTS / f"{stem}.json").read_text())["result"]["points"]
        hit = [r["kl_mean"] for r in points if r["method"] == name]
        if hit:
            out[model] = hit[0]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768]
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    contexts = sorted(args.contexts)
    rows = []
    for label, name, make in CACHES:
        rows.append((label, measure(make, contexts), kl_of(name) if name else {}))
        print(label, rows[-1][1], rows[-1][2], flush=True)

    command = "python benchmarks/memory_vs_context.py " + " ".join(
        ["--contexts", *map(str, contexts)]
    )
    meta = metadata("one layer: 8 kv heads, D=128, float16 K/V", command)
    plain = rows[0][1]
    lines = [
        "# KV memory against context, with each cache's quality",
        "",
        meta_markdown(meta),
        "",
        f"One attention layer of {HEADS} kv heads of dim {D}, float16 K/V, one sequence, filled "
        "with random tokens; bytes held (every array, room included). A model holds one such "
        f"layer per attention layer ({LAYERS} in Qwen3-4B). KL: mean KL to the plain cache from "
        "frontier_smollm2.md and frontier_gemma3.md (teacher-forced, 1,024 tokens).",
        "",
        "| cache | KL SmolLM2 / Gemma-3 | "
        + " | ".join(f"{c:,} tok" for c in contexts)
        + " | smaller than plain at the longest |",
        "|---|---|" + "---|" * len(contexts) + "---|",
    ]
    for label, held, kl in rows:
        q = " / ".join(f"{v:.2g}" for v in kl.values()) or "0"
        mib = " | ".join(f"{b / 2**20:.1f} MiB" for b in held)
        lines.append(f"| {label} | {q} | {mib} | {plain[-1] / held[-1]:.2f}x |")
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_vs_context.md").write_text(text)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, held, kl in rows:
        q = ", ".join(f"{m} KL {v:.2g}" for m, v in kl.items())
        ax.plot(
            contexts,
            [b / 2**20 for b in held],
            marker="o",
            label=f"{label} ({q})" if q else label,
            linestyle="--"
            if label.startswith("plain")
            else ":"
            if label.startswith("mlx-lm")
            else "-",
        )
    ax.set_xticks(contexts, [f"{c // 1024}K" if c >= 4096 else "" for c in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(f"KV MiB per layer ({HEADS} kv heads, D={D})")
    right = ax.secondary_yaxis(
        "right", functions=(lambda y: y * LAYERS / 1024, lambda y: y * 1024 / LAYERS)
    )
    right.set_ylabel(f"GiB for {LAYERS} layers (Qwen3-4B)")
    ax.set_title("KV cache memory against context (measured), quality in the legend")
    ax.legend(fontsize=7.5)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / "memory_vs_context.png", dpi=120)
    print(text)


if __name__ == "__main__":
    main()
