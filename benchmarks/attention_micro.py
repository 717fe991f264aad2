"""Attention-only decode microbenchmark at realistic shapes (32 query heads,
8 KV heads, D=128, one query token), separating attention cost from weights.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/attention_micro.py --contexts 1024,4096,16384

fp32 / fp16: mx.fast.scaled_dot_product_attention over float K/V; mlxqB:
mlx-lm's quantized_scaled_dot_product_attention (group 64); KVarN presets:
kvarn_mlx.packed_attention over a filled KVarNCache (128-token sink, full
tiles, empty tail). CPU caveat: MLX's CPU quantized matmul is slow and float16
has no fast CPU path, so on this machine the float32 path wins by a wide
margin; the numbers do not predict Apple-silicon speed.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import quantized_scaled_dot_product_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvarn_mlx.attention import packed_attention  # noqa: E402
from kvarn_mlx.cache import KVarNCache  # noqa: E402
from kvarn_mlx.eval.runner import meta_markdown, metadata  # noqa: E402

HQ, HKV, D = 32, 8, 128


def bench(fn, reps):
    mx.eval(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--presets", default="k4v4_g128,k4v2_g128,k2v2_g128")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    scale = D**-0.5
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        q = mx.random.normal((1, HQ, 1, D))
        k = mx.random.normal((1, HKV, ctx, D))
        v = mx.random.normal((1, HKV, ctx, D))
        mx.eval(q, k, v)
        res = {}
        res["fp32"] = bench(
            lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale), args.reps
        )
        q16, k16, v16 = q.astype(mx.float16), k.astype(mx.float16), v.astype(mx.float16)
        res["fp16"] = bench(
            lambda: mx.fast.scaled_dot_product_attention(q16, k16, v16, scale=scale), args.reps
        )
        for bits in (4, 2):
            kq, vq = (
                mx.quantize(k, group_size=64, bits=bits),
                mx.quantize(v, group_size=64, bits=bits),
            )
            mx.eval(kq, vq)
            res[f"mlxq{bits}"] = bench(
                lambda: quantized_scaled_dot_product_attention(
                    q, kq, vq, scale=scale, mask=None, group_size=64, bits=bits
                ),
                args.reps,
            )
        for preset in args.presets.split(","):
            c = KVarNCache(preset)
            for s in range(0, ctx, 2048):
                c.update_and_fetch(k[:, :, s : s + 2048], v[:, :, s : s + 2048])
                mx.eval([x for x in c.state.values() if isinstance(x, mx.array)])
            c.update_and_fetch(
                k[:, :, :0], v[:, :, :0]
            )  # a 0-token step: attention sees every tile
            res[preset] = bench(lambda: packed_attention(q, c, scale), args.reps)
        for m, t in res.items():
            rows.append(
                {
                    "context": ctx,
                    "method": m,
                    "ms": 1000 * t,
                    "vs_fp32": t / res["fp32"],
                    "vs_fp16": t / res["fp16"],
                }
            )
        print(ctx, {m: f"{1000 * t:.2f}ms" for m, t in res.items()}, file=sys.stderr)
    meta = metadata(
        f"attention only: {HQ} query heads, {HKV} kv heads, D={D}, 1 query token",
        "python benchmarks/attention_micro.py " + " ".join(sys.argv[1:]),
    )
    md = [
        "# Attention-only decode microbenchmark\n",
        meta_markdown(meta),
        f"\nMedian of {args.reps} calls. Time ratio > 1 means slower than the float path. **CPU "
        "caveat**: MLX's CPU quantized matmul is slow and float16 has no fast CPU path; Apple "
        "silicon will differ.\n",
        "| context | method | ms | time vs fp32 | time vs fp16 |",
        "|---|---|---|---|---|",
    ]
    md += [
        f"| {r['context']} | {r['method']} | {r['ms']:.2f} | {r['vs_fp32']:.2f}x | "
        f"{r['vs_fp16']:.2f}x |"
        for r in rows
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_micro.md").write_text("\n".join(md) + "\n")
    (out / "attention_micro.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()
