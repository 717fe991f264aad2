"""What the "auto" key-rotation decision costs, against decode time.

The decision runs once per layer, at the first quantized tiles: the first key
tiles are quantized a second time (unrotated) and both variants' attention over
them is compared with the step's queries. This times that extra work per layer
(all layers summed) against the measured time of one decode step.

    python benchmarks/auto_rotation_overhead.py [--model PATH] [--prompt-tokens 1024] [--gen 1000]
"""

import argparse
import platform
import pydoc_data.topics
import statistics
import time

import mlx.core as mx

import kvarn_mlx
from kvarn_mlx import rotation
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.loader import load


def timed(fn, reps=5):
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument(
        "--gen", type=int, default=1000, help="decode steps the one-time cost is spread over"
    )
    args = p.parse_args()
    model, tok = load(args.model)
    ids = tok.encode(open(pydoc_data.topics.__file__).read())[: args.prompt_tokens]

    cache = kvarn_mlx.make_cache(model, "auto2")
    for i in range(0, len(ids), 256):
        mx.eval(model(mx.array(ids[i : i + 256])[None], cache=cache))

    # Decode step time on this cache.
    step = timed(lambda: model(mx.array([[ids[-1]]]), cache=cache), reps=7)
    for c in cache:
        c.trim(7)

    # The decision's extra work, per layer, replayed on one tile of real keys.
    layers = [c for c in cache if isinstance(c, KVarNCache)]
    rotated = sum(c.key_rotation_summary()[0] for c in layers)
    heads = sum(c.key_rotation_summary()[1] for c in layers)
    extra = 0.0
    for c in layers:
        k, _ = c.dequantized()
        G, S = c.config.group_size, c.config.sink_size
        k_tiles = k[..., S : S + G, :].reshape(k.shape[0], k.shape[1], 1, G, k.shape[3])
        q = (
            k[..., S + G :, :][..., :256, :] * k.shape[3] ** -0.5
        )  # stand-in queries, as many rows as a prefill chunk

        def decide():
            return rotation.decide(rotation.candidates(k_tiles, c.config, 0), c.config.k_bits, q)

        extra += timed(decide, reps=3) - timed(
            lambda: kvarn_mlx.quant.quantize_keys(k_tiles, c.config.k_bits), reps=3
        )
    print(f"machine: {platform.platform()}, mlx {mx.__version__}, device {mx.default_device()}")
    print(f"decode step: {1e3 * step:.1f} ms at {len(ids)} tokens")
    print(
        f"decision extra work, all {len(layers)} layers: {1e3 * extra:.1f} ms (= "
        f"{extra / step:.2f} decode steps; {100 * extra / (step * args.gen):.3f}% of {args.gen} "
        "decode steps)"
    )
    print(f"state per kv head: one bool; kv heads that kept key rotation: {rotated}/{heads}")


if __name__ == "__main__":
    main()
