"""Time the KVarN Metal kernels against the MLX ops path and mlx-lm's fp16 attention.

    python benchmarks/kernels.py [--heads 32 --kv-heads 8 --head-dim 128 --preset k4v2_g128]

Decode attention (one query token) at 1K, 8K and 32K context:
  kernel  = kernels.packed_attention_metal (split-K over packed tiles + merge pass)
  ops     = attention.attend (the MLX ops path: mx.quantized_matmul over the packed tiles)
  fp16    = mx.fast.scaled_dot_product_attention over a float16 cache (what mlx-lm runs)
and tile quantization of one layer's prefill (kernel vs quant.quantize_keys/values).
Needs a Metal device: elsewhere it says so and exits 0.
"""

import argparse
import sys
import time


def _timeit(fn, warmup=3, iters=20):
    import mlx.core as mx

    for _ in range(warmup):
        mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - t0) / iters


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--preset", default="k4v2_g128")
    p.add_argument("--contexts", default="1024,8192,32768")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args(argv)

    import mlx.core as mx

    from kvarn_mlx import kernels, quant
    from kvarn_mlx.attention import attend
    from kvarn_mlx.config import get_preset
    from kvarn_mlx.tiles import StepView, Tiles

    if not (hasattr(mx, "metal") and mx.metal.is_available()):
        print("benchmarks/kernels.py needs a Metal device (Apple silicon, macOS); nothing to time here.")
        return 0

    cfg = get_preset(a.preset)
    kb, vb, G = cfg.k_bits, cfg.v_bits, cfg.group_size
    S = G if cfg.sink is None else cfg.sink
    B, Hq, Hkv, D = 1, a.heads, a.kv_heads, a.head_dim
    scale = D**-0.5
    print(f"preset {a.preset}: K{kb} V{vb} G={G} sink={S}; B={B} Hq={Hq} Hkv={Hkv} D={D}; {mx.default_device()}")
    print(f"{'context':>8} {'kernel ms':>10} {'ops ms':>10} {'fp16 ms':>10} {'ops/kernel':>11} {'kernel/fp16':>12}")
    for ctx in (int(c) for c in a.contexts.split(",")):
        n = (ctx - S) // G
        T = ctx - S - n * G
        k = mx.random.normal((B, Hkv, n, G, D)).astype(mx.float16)
        v = mx.random.normal((B, Hkv, n, G, D)).astype(mx.float16)
        kq = kernels.quantize_keys_metal(k, kb, cfg.iters)
        vq = kernels.quantize_values_metal(v, vb, cfg.iters)
        sink_k, sink_v = (mx.random.normal((B, Hkv, S, D)).astype(mx.float16) for _ in range(2))
        tail_k, tail_v = (mx.random.normal((B, Hkv, T, D)).astype(mx.float16) for _ in range(2))
        q = mx.random.normal((B, Hq, 1, D)).astype(mx.float16)
        K = mx.random.normal((B, Hkv, ctx, D)).astype(mx.float16)
        V = mx.random.normal((B, Hkv, ctx, D)).astype(mx.float16)
        mx.eval(kq, vq, sink_k, sink_v, tail_k, tail_v, q, K, V)
        view = StepView(sink_k, sink_v, Tiles(*kq, *vq), n, tail_k, tail_v, kb, vb)
        t_k = _timeit(lambda: kernels.packed_attention_metal(q, view, scale), iters=a.iters)
        t_o = _timeit(lambda: attend(q, view, scale), iters=a.iters)
        t_f = _timeit(lambda: mx.fast.scaled_dot_product_attention(q, K, V, scale=scale), iters=a.iters)
        print(f"{ctx:>8} {1e3 * t_k:>10.3f} {1e3 * t_o:>10.3f} {1e3 * t_f:>10.3f} {t_o / t_k:>11.2f} {t_k / t_f:>12.2f}")

    # Tile quantization of a layer's prefill: every tile of every kv head in one dispatch.
    ctx = 8192
    x = mx.random.normal((B, Hkv, ctx // G, G, D)).astype(mx.float16)
    mx.eval(x)
    for name, fk, fo, bits in (("keys", kernels.quantize_keys_metal, quant.quantize_keys, kb),
                               ("values", kernels.quantize_values_metal, quant.quantize_values, vb)):
        t_k = _timeit(lambda: fk(x, bits, cfg.iters), iters=a.iters)
        t_o = _timeit(lambda: fo(x, bits, cfg.iters), iters=a.iters)
        print(f"quantize {name} ({ctx} tokens x {Hkv} kv heads): kernel {1e3 * t_k:.3f} ms, "
              f"ops {1e3 * t_o:.3f} ms, ops/kernel {t_o / t_k:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
