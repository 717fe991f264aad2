r"""Time the KVarN Metal kernels against the MLX ops path and mlx-lm's fp16 attention.

    python benchmarks/kernels.py [--heads 32 --kv-heads 8 --head-dim 128 --preset k4v2_g128]

Decode attention (one query token) at 1K, 8K and 32K context:
  kernel  = kernels.packed_attention_metal (split-K over packed tiles + merge pass)
  ops     = attention.attend (the MLX ops path: mx.quantized_matmul over the packed tiles)
  fp16    = mx.fast.scaled_dot_product_attention over a float16 cache (what mlx-lm runs)
and tile quantization of one layer's prefill (kernel vs quant.quantize_keys/values).
Needs a Metal device: elsewhere it says so and exits 0.

    python benchmarks/kernels.py --chunks \
        [--contexts 1024,4096,8192 --lengths 1,2,4,8,16,64,512,2048]

Attention of a chunk of L query tokens over a filled cache, on any device:
  packed      = what attention.py runs without prefill.py: the kernel (L <= 8, Metal) or
                the ops path
  dequantized = prefill.attend_dequantized (tiles dequantized into a buffer, fused SDPA)
  plain       = mx.fast.scaled_dot_product_attention over float K/V (mlx-lm's plain cache)
and the smallest L from which the dequantized path is the faster one at every
context: prefill.MIN_QUERIES for this device type.
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
    p.add_argument(
        "--chunks",
        action="store_true",
        help="time chunk attention, packed vs dequantized (any device)",
    )
    p.add_argument(
        "--lengths", default="1,2,4,8,16,32,64,128,512,2048", help="chunk lengths for --chunks"
    )
    p.add_argument("--dtype", default="float16", help="K/V and query dtype for --chunks")
    a = p.parse_args(argv)
    if a.chunks:
        return chunks(a)

    import mlx.core as mx

    from kvarn_mlx import kernels, quant
    from kvarn_mlx.attention import attend
    from kvarn_mlx.config import get_preset
    from kvarn_mlx.tiles import StepView, Tiles

    if not (hasattr(mx, "metal") and mx.metal.is_available()):
        print(
            "benchmarks/kernels.py needs a Metal device (Apple silicon, macOS); nothing to time "
            "here."
        )
        return 0

    cfg = get_preset(a.preset)
    kb, vb, G = cfg.k_bits, cfg.v_bits, cfg.group_size
    S = G if cfg.sink is None else cfg.sink
    B, Hq, Hkv, D = 1, a.heads, a.kv_heads, a.head_dim
    scale = D**-0.5
    print(
        f"preset {a.preset}: K{kb} V{vb} G={G} sink={S}; B={B} Hq={Hq} Hkv={Hkv} D={D}; "
        f"{mx.default_device()}"
    )
    print(
        f"{'context':>8} {'kernel ms':>10} {'ops ms':>10} {'fp16 ms':>10} {'ops/kernel':>11} "
        f"{'kernel/fp16':>12}"
    )
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
        t_f = _timeit(
            lambda: mx.fast.scaled_dot_product_attention(q, K, V, scale=scale), iters=a.iters
        )
        print(
            f"{ctx:>8} {1e3 * t_k:>10.3f} {1e3 * t_o:>10.3f} {1e3 * t_f:>10.3f} {t_o / t_k:>11.2f} "
            f"{t_k / t_f:>12.2f}"
        )

    # Tile quantization of a layer's prefill: every tile of every kv head in one dispatch.
    ctx = 8192
    x = mx.random.normal((B, Hkv, ctx // G, G, D)).astype(mx.float16)
    mx.eval(x)
    for name, fk, fo, bits in (
        ("keys", kernels.quantize_keys_metal, quant.quantize_keys, kb),
        ("values", kernels.quantize_values_metal, quant.quantize_values, vb),
    ):
        t_k = _timeit(lambda: fk(x, bits, cfg.iters), iters=a.iters)
        t_o = _timeit(lambda: fo(x, bits, cfg.iters), iters=a.iters)
        print(
            f"quantize {name} ({ctx} tokens x {Hkv} kv heads): kernel {1e3 * t_k:.3f} ms, ops "
            f"{1e3 * t_o:.3f} ms, ops/kernel {t_o / t_k:.2f}"
        )
    return 0


def chunks(a):
    """Chunk attention, packed vs dequantized, over a cache filled through update_and_fetch."""
    import mlx.core as mx

    from kvarn_mlx import dispatch, kernels, prefill
    from kvarn_mlx.attention import attend
    from kvarn_mlx.cache import KVarNCache

    dtype = getattr(mx, a.dtype)
    B, Hq, Hkv, D = 1, a.heads, a.kv_heads, a.head_dim
    scale = D**-0.5
    lengths = [int(x) for x in a.lengths.split(",")]
    metal = dispatch.use_metal()
    print(
        f"chunk attention, preset {a.preset}; B={B} Hq={Hq} Hkv={Hkv} D={D} {a.dtype}; "
        f"{mx.default_device()}; packed = {'kernel for L <= 8, else ' if metal else ''}ops path; "
        f"median of {a.iters}"
    )
    print(
        f"{'context':>8} {'L':>6} {'packed ms':>10} {'dequant ms':>11} {'plain ms':>10} "
        f"{'packed/deq':>11} {'deq/plain':>10}"
    )

    def median_time(fn):
        mx.eval(fn())
        ts = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            mx.eval(fn())
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    faster = {}  # L -> dequantized faster at every context
    for ctx in (int(c) for c in a.contexts.split(",")):
        cache = KVarNCache(a.preset)
        for s in range(0, ctx, 2048):
            n = min(2048, ctx - s)
            kv = [mx.random.normal((B, Hkv, n, D)).astype(dtype) for _ in range(2)]
            mx.eval(cache.update_and_fetch(*kv), cache.held_arrays())
        for L in lengths:
            k, v = (mx.random.normal((B, Hkv, L, D)).astype(dtype) for _ in range(2))
            q = mx.random.normal((B, Hq, L, D)).astype(dtype)
            K, V = cache.update_and_fetch(k, v)  # keeps this chunk's view alive
            mx.eval(K, V, q, cache.held_arrays())
            view = cache.step_view()
            mask = "causal" if L > 1 else None
            if metal and L <= 8 and kernels.attention_unsupported(q, view) is None:
                t_p = median_time(lambda: kernels.packed_attention_metal(q, view, scale, L > 1))
            else:
                t_p = median_time(lambda: attend(q, view, scale, mask))
            t_d = median_time(lambda: prefill.attend_dequantized(q, view, scale, mask))
            t_f = median_time(
                lambda: mx.fast.scaled_dot_product_attention(q, K, V, scale=scale, mask=mask)
            )
            faster[L] = faster.get(L, True) and t_d < t_p
            print(
                f"{ctx:>8} {L:>6} {1e3 * t_p:>10.2f} {1e3 * t_d:>11.2f} {1e3 * t_f:>10.2f} "
                f"{t_p / t_d:>11.2f} {t_d / t_f:>10.2f}",
                flush=True,
            )
            cache.trim(L)
            K = V = view = None  # release this chunk's view before the next
    ok = [L for L in lengths if all(faster[x] for x in lengths if x >= L)]
    device = mx.default_device().type.name
    print(
        f"dequantized faster at every context from L = {ok[0] if ok else 'none measured'} on; "
        f"prefill.MIN_QUERIES[{device!r}] is {prefill.MIN_QUERIES.get(device)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
