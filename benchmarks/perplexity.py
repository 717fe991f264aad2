"""Perplexity of a model (plain cache) on CPython's pydoc_data/topics.py text.

The file is tokenized once; each window holds the next `--window` tokens. For a
tokenizer that starts sequences with BOS (Gemma) each window is BOS plus
`--window - 1` text tokens, as llama.cpp's perplexity tool does: without BOS
Gemma's first positions are far off. Every next-token prediction in a window
counts.

    python benchmarks/perplexity.py [--model embedded:gemma-3-270m] [--windows 16] [--window 512]
"""

import argparse
import math
import pydoc_data.topics
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from kvarn_mlx.loader import load


def windows(tok, n, size):
    """`n` token windows of `size` over the text, each led by BOS if the
    tokenizer adds one."""
    text = Path(pydoc_data.topics.__file__).read_text()
    ids = tok.encode(text, add_special_tokens=False)
    lead = tok.encode("", add_special_tokens=True)  # [bos] or []
    step = size - len(lead)
    if len(ids) < n * step:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {n} windows of {step}")
    return [lead + ids[i * step : (i + 1) * step] for i in range(n)]


def perplexity(model, tok, n=16, size=512):
    nll, count = 0.0, 0
    for w in windows(tok, n, size):
        x = mx.array(w)[None]
        logits = model(x[:, :-1])
        nll += nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum").item()
        count += x.shape[1] - 1
    return math.exp(nll / count), count


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="as kvarn_mlx.loader.load (default: the embedded default)"
    )
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--window", type=int, default=512)
    args = p.parse_args()
    model, tok = load(args.model)
    t = time.perf_counter()
    ppl, count = perplexity(model, tok, args.windows, args.window)
    bos = "BOS + " if tok.encode("", add_special_tokens=True) else ""
    print(
        f"perplexity {ppl:.3f} over {count} predictions ({args.windows} windows of "
        f"{bos}{args.window - bool(bos)} tokens), {time.perf_counter() - t:.0f} s"
    )


if __name__ == "__main__":
    main()
