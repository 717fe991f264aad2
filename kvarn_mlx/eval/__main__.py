"""python -m kvarn_mlx.eval: how close a quantized KV cache stays to full precision.

Subcommands
  fidelity      teacher-forced logits over real text vs the plain-cache run:
                mean / p99 KL, top-1 agreement, perplexity delta, per context length.
  accumulation  the KVarN paper's pseudo-decode: per layer, mean absolute error
                of the attention output vs full precision, by position,
                "accumulated" (chunked prefill) next to "static" (one-shot).
  decode        greedy decoding: steps until the first token that differs from the
                full-precision run, and per-step KL on the full-precision trajectory.
  longgen       thousands of greedy tokens from reasoning-style questions: per-step
                KL on the plain cache's trajectory, top-1 agreement, first divergence.
  retrieval     passkey and multi-key needle-in-a-haystack: accuracy by needle
                depth and context length, with 95% intervals and heat maps.
  tasks         HumanEval pass@1 per cache through batched generation, each
                answer tested in a sandbox; the paired difference to the plain
                cache with an exact 95% interval, alone or after a long context.

By default (--attention dequant) the model sees each quantized cache as a plain
one holding its dequantized K/V, and mlx-lm's attention
(mx.fast.scaled_dot_product_attention) runs over them: the same numbers as the
packed path up to float rounding, and about twice as fast on CPU at 2K tokens.
The auto presets always take the packed path: their per-head key-rotation
choice reads the step's queries, which only that path hands the cache (with
the keys standing in, Gemma-3-270M's auto2 had KL 0.54; with the queries 0.038).
--attention packed is the product's path: kvarn_mlx's packed attention (and
mlx-lm's quantized attention for mlxqB).
"""

import argparse
import sys

from . import accumulation, decode, fidelity, longgen, methods, retrieval, tasks
from .runner import (
    ATTENTION_MODES,
    CheckpointError,
    meta_markdown,
    metadata,
    read_checkpoint,
    write_results,
)

EXPERIMENTS = {m.NAME: m for m in (fidelity, accumulation, decode, longgen, retrieval, tasks)}


def setup_arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m kvarn_mlx.eval",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1] + "\n" + methods.__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--model",
        default=None,
        help="MLX model folder or HF repo (default: embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--out", default="benchmarks/results", help="results folder")
    p.add_argument("--tag", default="", help="suffix for result file names")
    p.add_argument(
        "--attention",
        choices=ATTENTION_MODES,
        default="dequant",
        help="attention over dequantized K/V (fast on CPU, default) or the packed path",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, experiment in EXPERIMENTS.items():
        experiment.add_arguments(sub.add_parser(name, help=experiment.HELP))
    return p


def main(argv=None, model=None, tokenizer=None, model_name=None):
    """Run one experiment and write its results; returns the result written to the json."""
    argv = sys.argv[1:] if argv is None else argv
    args = setup_arg_parser().parse_args(argv)
    names = [m for m in args.methods.split(",") if m]
    for m in names:
        methods.method_bits(m)  # fail early on unknown names
    try:  # and on a --checkpoint no eval wrote, before the model loads
        read_checkpoint(getattr(args, "checkpoint", None))
    except CheckpointError as e:
        raise SystemExit(f"kvarn_mlx.eval: {e}") from None
    if model is None:
        from ..loader import load

        model, tokenizer = load(args.model)
        model_name = args.model or "SmolLM2-135M-Instruct (embedded, float32)"
    meta = metadata(model_name, "python -m kvarn_mlx.eval " + " ".join(argv))
    # An experiment that always takes one path (tasks: the batched, packed one) says so.
    meta["attention"] = getattr(EXPERIMENTS[args.cmd], "ATTENTION", args.attention)
    try:
        result, md, draw = EXPERIMENTS[args.cmd].run(
            args, model, tokenizer, names, meta_markdown(meta)
        )
    except fidelity.StateError as e:
        raise SystemExit(f"kvarn_mlx.eval: {e}") from None
    write_results(args.out, args.cmd, args.tag, meta, result, md, draw)
    return result


if __name__ == "__main__":
    main()
