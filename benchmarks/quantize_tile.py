"""Time to quantize one tile per kv head of a 32-layer, 8-KV-head, D=128 model.

That is 32 * 8 K tiles and 32 * 8 V tiles of G=128 tokens: what one decode step
pays when every head's tail fills at once. MLX ops path: one batched call per
layer for K and one for V (all 8 heads), mx.eval per layer. numpy reference:
one tile at a time. Median of repeats after a warmup.

    python benchmarks/quantize_tile.py [--repeats 5] [--ref-repeats 1]
"""

import argparse
import os
import platform
import statistics
import time

import mlx.core as mx
import numpy as np

from kvarn_mlx import quant
from kvarn_mlx import reference as ref
from kvarn_mlx.config import get_preset

LAYERS, KV_HEADS, D = 32, 8, 128


def median_time(fn, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ref-repeats", type=int, default=1)
    args = p.parse_args()

    blas = os.environ.get("LD_PRELOAD", "")
    print(
        f"machine: {platform.platform()} {platform.machine()}, {os.cpu_count()} cpus, python "
        f"{platform.python_version()}"
    )
    print(
        f"mlx {mx.__version__}, device {mx.default_device()}, numpy {np.__version__}, OpenBLAS "
        f"preloaded: {'yes' if 'openblas' in blas else 'no'}"
    )
    print(
        f"model: {LAYERS} layers x {KV_HEADS} kv heads, D={D}; one K and one V tile per kv head\n"
    )

    rng = np.random.default_rng(0)
    print(
        f"{'preset':10} {'G':>4} {'ops path':>10} {'reference':>10} {'ratio':>7}  per tile (ops / "
        "ref)"
    )
    for name in ("k4v2_g128", "k2v2_g128"):
        cfg = get_preset(name)
        G = cfg.group_size
        # Per layer: [1 batch, 8 heads, 1 tile, G, D], in the model dtype.
        ks = [
            mx.array(rng.standard_normal((1, KV_HEADS, 1, G, D)).astype(np.float16))
            for _ in range(LAYERS)
        ]
        vs = [
            mx.array(rng.standard_normal((1, KV_HEADS, 1, G, D)).astype(np.float16))
            for _ in range(LAYERS)
        ]
        mx.eval(ks, vs)

        def ops():
            for k, v in zip(ks, vs):
                mx.eval(
                    quant.quantize_keys(k, cfg.k_bits, cfg.iters, scale_dtype=cfg.scale_dtype),
                    quant.quantize_values(v, cfg.v_bits, cfg.iters, scale_dtype=cfg.scale_dtype),
                )

        k_np = [np.array(k.astype(mx.float32))[0, :, 0] for k in ks]
        v_np = [np.array(v.astype(mx.float32))[0, :, 0] for v in vs]

        def reference():
            for k, v in zip(k_np, v_np):
                for h in range(KV_HEADS):
                    code, a, b, t = ref.quantize_key_tile(k[h], cfg.k_bits, cfg.iters)
                    ref.pack(code, cfg.k_bits)
                    code, a, b, c = ref.quantize_value_tile(v[h], cfg.v_bits, cfg.iters)
                    ref.pack(code, cfg.v_bits)

        t_ops = median_time(ops, args.repeats)
        t_ref = median_time(reference, args.ref_repeats)
        n = LAYERS * KV_HEADS
        print(
            f"{name:10} {G:4d} {t_ops * 1e3:8.1f}ms {t_ref * 1e3:8.1f}ms {t_ref / t_ops:6.1f}x  "
            f"{t_ops / n * 1e6:.0f}us / {t_ref / n * 1e6:.0f}us (K+V)"
        )


if __name__ == "__main__":
    main()
