"""python -m kvarn_mlx.generate: mlx_lm.generate with a KVarN KV cache.

Flags mirror mlx_lm.generate; --kv-preset picks the cache (fp16 = mlx-lm's
plain cache), --compare runs the same prompt with the plain cache as well.
"""

import argparse
import os
import sys

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm.sample_utils import make_sampler

from .cache import KVarNCache, make_cache
from .config import DEFAULT_PRESET, FP16, PRESETS

DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Generate text with a KVarN-quantized KV cache.")
    p.add_argument("--model", default=None,
                   help="Local MLX model folder or Hugging Face repo id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="Message for the model ('-' reads stdin)")
    p.add_argument("--system-prompt", default=None, help="System prompt for the chat template")
    p.add_argument("--ignore-chat-template", action="store_true", help="Use the raw prompt without the chat template")
    p.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS, help="Maximum tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="Sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="Sampling top-p")
    p.add_argument("--seed", type=int, default=None, help="PRNG seed")
    p.add_argument("--kv-preset", default=DEFAULT_PRESET,
                   help=f"KV cache: one of {', '.join([*PRESETS, FP16])} (default {DEFAULT_PRESET})")
    p.add_argument("--kv-sink", type=int, default=None, help="Leading tokens kept in full precision (default: one tile)")
    p.add_argument("--compare", action="store_true", help="Also run the prompt with the plain fp16 cache and compare")
    p.add_argument("--prompt-cache-file", default=None,
                   help="Reuse the cache saved in this file; if it does not exist, save the cache there afterwards")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="Prompt tokens per prefill step")
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                   help="Stream text and print the stats block (default true)")
    return p


def build_prompt(tokenizer, prompt, system_prompt=None, ignore_chat_template=False):
    """Token ids for a user message, through the chat template when there is one."""
    if not ignore_chat_template and tokenizer.has_chat_template:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(prompt)


def fp16_nbytes(c):
    """Bytes the tokens in cache layer c take as unpadded 2-byte keys and values."""
    if isinstance(c, KVarNCache):
        return c.fp16_nbytes()
    keys = getattr(c, "keys", None)
    if isinstance(keys, mx.array) and hasattr(c, "offset"):
        B, H, _, D = keys.shape
        return B * H * min(c.offset, keys.shape[2]) * (D + c.values.shape[-1]) * 2
    return c.nbytes


def kv_stats(cache):
    """Bytes held by the cache's arrays, its fp16-equivalent, and tiles quantized per layer."""
    held = sum(c.nbytes for c in cache)
    kvarn = [c for c in cache if isinstance(c, KVarNCache)]
    fp16 = sum(fp16_nbytes(c) for c in cache)
    tiles = kvarn[0].n_tiles if kvarn else 0
    unused = sum(c.nbytes_breakdown()["unused"] for c in kvarn)
    return {"held": held, "unused": unused, "fp16": fp16, "ratio": fp16 / held if held else 0.0, "tiles_per_layer": tiles,
            "kvarn_layers": len(kvarn), "layers": len(cache)}


def run(model, tokenizer, prompt_ids, cache, args, out=None):
    """Stream one generation into `out` (stdout) when verbose; returns (text, last response)."""
    out = out or sys.stdout
    sampler = make_sampler(args.temp, args.top_p)

    def progress(done, total):
        if total > args.prefill_step_size:
            print(f"\rprefill {done}/{total} tokens", end="" if done < total else "\n", file=sys.stderr, flush=True)

    text, last = "", None
    for r in stream_generate(model, tokenizer, prompt_ids, max_tokens=args.max_tokens, sampler=sampler,
                             prompt_cache=cache, prefill_step_size=args.prefill_step_size,
                             prompt_progress_callback=progress):
        text += r.text
        last = r
        if args.verbose:
            print(r.text, end="", flush=True, file=out)
    if args.verbose:
        print(file=out)
    return text, last


def print_stats(name, last, cache, out=None):
    out = out or sys.stdout
    s = kv_stats(cache)
    print("=" * 10, file=out)
    print(f"KV cache: {name}", file=out)
    if last is not None:
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens-per-sec", file=out)
        print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tokens-per-sec", file=out)
        print(f"Peak memory: {last.peak_memory:.3f} GB", file=out)
    room = f" ({s['unused'] / 2**20:.2f} MiB of it preallocated room)" if s["unused"] else ""
    print(f"KV bytes held: {s['held'] / 2**20:.2f} MiB{room} vs fp16-equivalent {s['fp16'] / 2**20:.2f} MiB "
          f"({s['ratio']:.2f}x)", file=out)
    if s["kvarn_layers"]:
        print(f"Tiles quantized: {s['tiles_per_layer']} per layer in {s['kvarn_layers']}/{s['layers']} layers",
              file=out)
    decided = [c.key_rotation_summary() for c in cache
               if isinstance(c, KVarNCache) and c.config.rotate_keys == "auto"]
    decided = [d for d in decided if d is not None]
    if decided:
        print(f"Key rotation (auto): {sum(r for r, _ in decided)}/{sum(n for _, n in decided)} kv heads rotated, "
              f"decided in {len(decided)} layers", file=out)
    return s


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    if args.kv_preset not in PRESETS and args.kv_preset != FP16:
        sys.exit(f"error: unknown --kv-preset {args.kv_preset!r}; valid: {', '.join([*PRESETS, FP16])}")
    if args.seed is not None:
        mx.random.seed(args.seed)

    from .loader import ModelLoadError, load

    try:
        model, tokenizer = load(args.model)
    except ModelLoadError as e:
        sys.exit(f"error: {e}")

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt.replace("\\n", "\n")
    prompt_ids = build_prompt(tokenizer, prompt, args.system_prompt, args.ignore_chat_template)

    cache_file = args.prompt_cache_file
    if cache_file and os.path.exists(cache_file):
        try:
            cache = load_prompt_cache(cache_file)
        except Exception as e:  # mlx raises plain RuntimeError/ValueError on damaged files
            sys.exit(f"error: cannot load prompt cache {cache_file!r} ({e}); delete it or pass another file")
        if len(cache) != len(make_prompt_cache(model)):
            sys.exit(f"error: prompt cache {cache_file!r} was made for a model with {len(cache)} layers")
    else:
        cache = make_cache(model, args.kv_preset, sink=args.kv_sink)

    name = "loaded from file" if cache_file and os.path.exists(cache_file) else args.kv_preset
    text, last = run(model, tokenizer, prompt_ids, cache, args)
    if args.verbose:
        print_stats(name, last, cache)
    else:  # as mlx_lm.generate: just the text
        print(text)
    if cache_file and not os.path.exists(cache_file):
        save_prompt_cache(cache_file, cache, {"model": args.model or "embedded:SmolLM2-135M-Instruct"})
        print(f"Saved the prompt cache to {cache_file}", file=sys.stderr)

    if args.compare:
        mx.reset_peak_memory()
        print("\n--- same prompt, plain fp16 KV cache ---")
        ref_cache = make_cache(model, FP16)
        ref_text, ref_last = run(model, tokenizer, prompt_ids, ref_cache, args)
        if not args.verbose:
            print(ref_text)
        print_stats(FP16, ref_last, ref_cache)
        if last is not None and ref_last is not None:
            held = kv_stats(cache)["held"]
            ref_held = kv_stats(ref_cache)["held"]
            print(f"Measured: plain cache holds {ref_held / 2**20:.2f} MiB, KVarN {held / 2**20:.2f} MiB "
                  f"({ref_held / held:.2f}x less); generation speed ratio KVarN/plain "
                  f"{last.generation_tps / ref_last.generation_tps:.2f}")


if __name__ == "__main__":
    main()
