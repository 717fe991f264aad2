"""Measured KV bytes per token for every preset, from the arrays a cache holds.

Fills one layer's KVarNCache (1 batch row, 1 kv head, float16 K/V, sink 128)
and mlx-lm's KVCache with the same tokens and divides held bytes by tokens.

    python benchmarks/bytes_per_token.py [--tokens 32896]
"""

import argparse

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvarn_mlx import PRESETS, KVarNCache


def fill(cache, tokens, D, chunk=4096):
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        k = mx.random.normal((1, 1, n, D)).astype(mx.float16)
        cache.update_and_fetch(k, mx.random.normal((1, 1, n, D)).astype(mx.float16))
        mx.eval(cache.state if isinstance(cache, KVarNCache) else (cache.keys, cache.values))
    return cache


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128 + 256 * 128)
    args = p.parse_args()
    print(f"| preset | D | bytes/token/kv head (tiles only) | bytes/token/kv head (whole cache, {args.tokens} tokens) | vs fp16 KVCache |")
    print("|---|---|---|---|---|")
    for D in (64, 128):
        plain = fill(KVCache(), args.tokens, D)
        for name in PRESETS:
            c = fill(KVarNCache(name), args.tokens, D)
            b = c.nbytes_breakdown()
            tile_tokens = c.n_tiles * c.config.group_size
            per_tile_token = (b["codes"] + b["scales"]) / tile_tokens
            print(f"| {name} | {D} | {per_tile_token:.2f} | {c.nbytes / args.tokens:.2f} | "
                  f"{plain.nbytes / c.nbytes:.2f}x |")
        print(f"| fp16 KVCache | {D} | - | {plain.nbytes / args.tokens:.2f} | 1.00x |")


if __name__ == "__main__":
    main()
