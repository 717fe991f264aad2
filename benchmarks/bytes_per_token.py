r"""Measured KV bytes per token for every preset, from the arrays a cache holds.

Fills one layer's cache (1 batch row, 1 kv head, float16 K/V) with the same
tokens for every KVarN preset (sink 128), the same presets with fp8 scales
where they apply (codes of at most 4 bits), mlx-lm's QuantizedKVCache at 2, 4
and 8 bits (group 64) and mlx-lm's plain KVCache, then divides the bytes each
holds (room included) by the tokens. Tile bytes per token are the tiles'
codes and scales over the tokens in them (docs/algorithm.md, "Storage and
bytes per token").

    python benchmarks/bytes_per_token.py [--tokens 4096 32896] [--dims 64 128 256] \
        [--out benchmarks/results]
"""

import argparse
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvarn_mlx import PRESETS, KVarNCache
from kvarn_mlx.config import FP8_MAX_BITS


def fill(cache, tokens, D, chunk=4096):
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        k = mx.random.normal((1, 1, n, D)).astype(mx.float16)
        out = cache.update_and_fetch(k, mx.random.normal((1, 1, n, D)).astype(mx.float16))
        mx.eval(out, cache.held_arrays() if isinstance(cache, KVarNCache) else [])
    return cache


def caches():
    """(name, factory) of every cache measured, KVarN presets first."""
    for name, config in PRESETS.items():
        yield name, lambda c=config: KVarNCache(c)
    for name, config in PRESETS.items():
        if max(config.k_bits, config.v_bits) <= FP8_MAX_BITS:
            yield f"{name} fp8", lambda c=config: KVarNCache(replace(c, scale_dtype="fp8"))
    for bits in (2, 4, 8):
        yield f"mlx-lm {bits}-bit", lambda b=bits: QuantizedKVCache(group_size=64, bits=b)


def table(tokens, dims):
    lines = [
        f"Bytes per token per kv head, {tokens} tokens, float16 K/V, one layer, one kv head "
        "(`python benchmarks/bytes_per_token.py`): measured from the arrays each cache holds.",
        "",
        "| cache | D | tiles: bytes/token | whole cache: bytes/token | plain KVCache / this |",
        "|---|---|---|---|---|",
    ]
    for D in dims:
        plain = fill(KVCache(), tokens, D)
        for name, make in caches():
            c = fill(make(), tokens, D)
            if isinstance(c, KVarNCache):
                b = c.nbytes_breakdown()
                tiles = f"{(b['codes'] + b['scales']) / (c.n_tiles * c.config.group_size):.2f}"
            else:
                tiles = "-"
            lines.append(
                f"| {name} | {D} | {tiles} | {c.nbytes / tokens:.2f} | "
                f"{plain.nbytes / c.nbytes:.2f}x |"
            )
            print(lines[-1], flush=True)
        lines.append(f"| plain KVCache (float16) | {D} | - | {plain.nbytes / tokens:.2f} | 1.00x |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 128 + 256 * 128])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--out", type=Path, help="write bytes_per_token_<tokens>.md into this folder")
    args = p.parse_args()
    for tokens in args.tokens:
        text = table(tokens, args.dims)
        if args.out:
            (args.out / f"bytes_per_token_{tokens}.md").write_text(text)


if __name__ == "__main__":
    main()
