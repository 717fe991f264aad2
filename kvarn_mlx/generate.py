"""python -m kvarn_mlx.generate: mlx_lm.generate with a KVarN KV cache.

Flags mirror mlx_lm.generate; --kv-preset picks the cache (fp16 = mlx-lm's
plain cache), --compare runs the same prompt with the plain cache as well.
--max-kv-bytes stops before the next step could take the cache past a budget.
--draft-model decodes speculatively (the draft keeps mlx-lm's plain cache).
Under `mlx.launch` with more than one rank, each rank loads its shard of the
model (tensor parallel, mlx-lm's sharded_load) and holds its kv heads' share
of the cache; rank 0 prints.
Ctrl-C stops the answer at the next token: the text so far, the stats and the
prompt cache (if asked for) are kept, and the exit code is 130.
"""

import argparse
import math
import os
import sys

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from . import budget, memory, prompt_cache
from . import profile as profiles
from .cache import KVarNCache
from .cli_support import INTERRUPTED, CtrlC, add_kv_flags, load_error, model_context
from .config import DEFAULT_PRESET, FP16, preset_error, tail_error
from .integration import make_cache, profile_mix
from .prompt_cache import PromptCacheError

DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100


class UsageError(ValueError):
    """Bad input; the message names the problem and the fix."""


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Generate text with a KVarN-quantized KV cache.")
    p.add_argument(
        "--model",
        default=None,
        help=(
            "Local MLX model folder or Hugging Face repo id (default: the embedded "
            "SmolLM2-135M-Instruct)"
        ),
    )
    p.add_argument(
        "--prompt", "-p", default=DEFAULT_PROMPT, help="Message for the model ('-' reads stdin)"
    )
    p.add_argument("--system-prompt", default=None, help="System prompt for the chat template")
    p.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="Use the raw prompt without the chat template",
    )
    p.add_argument(
        "--max-tokens",
        "-m",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="Maximum tokens to generate",
    )
    p.add_argument("--temp", type=float, default=0.0, help="Sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="Sampling top-p")
    p.add_argument("--seed", type=int, default=None, help="PRNG seed")
    add_kv_flags(p, context_default="the prompt plus --max-tokens")
    p.add_argument(
        "--kv-fp16-layers",
        default=None,
        metavar="I,J,...",
        help=(
            "Layers left in mlx-lm's plain cache whatever --kv-preset, e.g. 0,-1 (negative: from "
            "the end)"
        ),
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="Also run the prompt with mlx-lm's plain cache and compare",
    )
    p.add_argument(
        "--prompt-cache-file",
        default=None,
        help="Reuse the cache saved in this file (it keeps its own --kv-tail-tokens); if it does "
        "not exist, save the cache there afterwards ('.safetensors' is added when missing, as "
        "mlx-lm does)",
    )
    p.add_argument(
        "--prefill-step-size", type=int, default=2048, help="Prompt tokens per prefill step"
    )
    p.add_argument(
        "--max-kv-bytes",
        default=None,
        metavar="SIZE",
        help="Stop before the KV cache could hold more than SIZE (e.g. 2GB, 512MiB; K/M/G are "
        "powers of 1024), checked before every prompt chunk and every token; with --compare, for "
        "each cache; a --draft-model's own cache is not counted",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="A smaller model with the same tokenizer drafting tokens for speculative decoding",
    )
    p.add_argument(
        "--num-draft-tokens", type=int, default=3, help="Tokens the draft model proposes per step"
    )
    p.add_argument(
        "--allow-beyond-context",
        action="store_true",
        help="Keep generating past the model's context length (max_position_embeddings)",
    )
    p.add_argument(
        "--verbose",
        type=lambda s: s.lower() in ("1", "true", "yes"),
        default=True,
        help="Stream text and print the stats block (default true)",
    )
    return p


def check_args(args):
    """Raise UsageError for the first flag that cannot work (before any model is loaded)."""
    if preset_error(args.kv_preset):
        raise UsageError(f"--kv-preset: {preset_error(args.kv_preset)}")
    fp16_layers(args)
    kv_profile(args)
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens {args.max_tokens}: generate at least 1 token")
    if args.prefill_step_size < 1:
        raise UsageError(
            f"--prefill-step-size {args.prefill_step_size}: process at least 1 prompt token per "
            "step"
        )
    if args.kv_sink is not None and args.kv_sink < 0:
        raise UsageError(
            f"--kv-sink {args.kv_sink}: the number of leading tokens kept in full precision is 0 "
            "or more"
        )
    if args.kv_profile is None and tail_error(args.kv_preset, args.kv_tail_tokens):
        raise UsageError(
            f"--kv-tail-tokens {args.kv_tail_tokens}: "
            f"{tail_error(args.kv_preset, args.kv_tail_tokens)}"
        )
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise UsageError(f"--seed {args.seed}: use an integer from 0 to 2**64 - 1")
    if not (math.isfinite(args.temp) and args.temp >= 0):
        raise UsageError(f"--temp {args.temp}: use a finite temperature >= 0 (0 is greedy)")
    if not 0 <= args.top_p <= 1:  # NaN fails too
        raise UsageError(f"--top-p {args.top_p}: use a number from 0 to 1 (1 keeps every token)")
    if args.num_draft_tokens < 1:
        raise UsageError(
            f"--num-draft-tokens {args.num_draft_tokens}: the draft model proposes at least 1 token"
        )
    if args.max_kv_bytes is not None:
        try:
            budget.parse_size(args.max_kv_bytes)
        except ValueError as e:
            raise UsageError(f"--max-kv-bytes: {e}") from None


def kv_profile(args):
    """(profile path, bytes_like, max_kl, context) for make_cache, the profile's
    structure checked (no model needed), or Nones without --kv-profile."""
    if args.kv_profile is not None and args.kv_fp16_layers:
        raise UsageError(
            "--kv-fp16-layers and --kv-profile do not combine: the profile chooses every layer's "
            "widths"
        )
    try:
        return profiles.from_settings(args, DEFAULT_PRESET)
    except ValueError as e:
        raise UsageError(str(e)) from None


def fp16_layers(args):
    """--kv-fp16-layers as a list of layer indices ([] when not given)."""
    if args.kv_fp16_layers is None:
        return []
    try:
        return [int(i) for i in args.kv_fp16_layers.split(",")]
    except ValueError:
        raise UsageError(
            f"--kv-fp16-layers {args.kv_fp16_layers!r}: use layer indices separated by commas, "
            "e.g. 0,-1 (negative ones count from the last layer)"
        ) from None


def read_prompt(args):
    if args.prompt != "-":
        prompt = args.prompt.replace("\\n", "\n")
    elif mx.distributed.init().size() > 1:
        # Ranks would share (or lack) stdin: each must see the same prompt.
        raise UsageError(
            "--prompt - reads stdin, which mlx.launch does not give every rank alike; "
            'pass the text itself, e.g. --prompt "$(cat prompt.txt)"'
        )
    else:
        raw = getattr(sys.stdin, "buffer", None)
        if raw is None:  # a text stream without bytes underneath
            prompt = sys.stdin.read()
        else:
            data = raw.read()
            try:
                prompt = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(
                    f"stdin is not valid UTF-8 (byte {e.start} is 0x{data[e.start]:02x}); convert "
                    "it first, e.g. with `iconv -f latin1 -t utf-8`"
                ) from None
    if args.ignore_chat_template and not prompt.strip():
        raise UsageError(
            "empty prompt: with --ignore-chat-template the model needs some text to continue; pass "
            "--prompt TEXT"
        )
    return prompt


def build_prompt(tokenizer, prompt, system_prompt=None, ignore_chat_template=False):
    """Token ids for a user message, through the chat template when there is one."""
    if not ignore_chat_template and tokenizer.has_chat_template:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(prompt)


def load_model(spec):
    from .loader import ModelLoadError, load

    try:
        if mx.distributed.init().size() > 1:
            return load_shard(spec)
        return load(spec)
    except (ModelLoadError, RuntimeError, OSError, ValueError) as e:
        raise UsageError(load_error(spec, e)) from None


def load_shard(spec):
    """This rank's shard of the model (tensor parallel over every rank)."""
    from mlx_lm.utils import sharded_load

    from . import loader

    path = loader.embedded_path(spec) or spec
    return sharded_load(str(path), tensor_group=mx.distributed.init())


def context_limit(model, args, held, n_prompt):
    """max_tokens within the model's context, warning on stderr when the run would go beyond it."""
    limit = model_context(model)
    if not limit:
        return args.max_tokens
    what = f"{n_prompt}-token prompt" + (f" (after {held} cached tokens)" if held else "")
    if held + n_prompt >= limit:
        msg = f"the {what} is longer than the model's {limit}-token context"
        if not args.allow_beyond_context:
            raise UsageError(f"{msg}; shorten it, or pass --allow-beyond-context to run anyway")
        print(
            f"warning: {msg}; --allow-beyond-context: the output may be meaningless",
            file=sys.stderr,
        )
        return args.max_tokens
    if held + n_prompt + args.max_tokens > limit:
        msg = (
            f"the {what} + --max-tokens {args.max_tokens} go beyond the model's {limit}-token "
            "context"
        )
        if args.allow_beyond_context:
            print(f"warning: {msg}; --allow-beyond-context: generating past it", file=sys.stderr)
            return args.max_tokens
        room = limit - held - n_prompt
        print(
            f"warning: {msg}; stopping after {room} tokens (--allow-beyond-context goes on)",
            file=sys.stderr,
        )
        return room
    return args.max_tokens


class _StopPrefill(Exception):
    pass


def kv_budget(model, cache, args):
    """The --max-kv-bytes budget of this cache, or None."""
    if args.max_kv_bytes is None:
        return None
    return budget.KVBudget(
        model, cache, budget.parse_size(args.max_kv_bytes), args.prefill_step_size
    )


def check_prefill_budget(kv, done, total, step_size, whole=False):
    """Before the next prompt chunk (mlx-lm's generate_step: chunks of step_size while
    more than one token remains, then the last prompt token and the first generated
    token as two one-token steps, which add no more than one two-token step); with
    whole, before every chunk left of the prompt, as if none could be checked on the way."""
    left = total - done
    try:
        if whole:
            full, rest = divmod(left, step_size)
            kv.check(*[step_size] * full, *([rest] if rest else []), 2)
        elif left > 1:
            kv.check(min(step_size, left - 1))
        else:
            kv.check(2)
    except budget.BudgetExceeded as e:
        raise UsageError(
            f"--max-kv-bytes: the {total}-token prompt does not fit; after {done} prompt tokens "
            f"{e}. Raise --max-kv-bytes, shorten the prompt, or pick a smaller --kv-preset (python "
            "-m kvarn_mlx.plan shows how much context fits per cache)"
        ) from None


def run(
    model,
    tokenizer,
    prompt_ids,
    cache,
    args,
    max_tokens=None,
    ctrl_c=None,
    out=None,
    kv=None,
    draft=None,
):
    """Stream one generation into `out` (stdout) when verbose; returns (text, last response).
    Stops early when ctrl_c.pressed (last is None if that was before the first token), or
    before a step that could take the cache past the budget `kv` (budget.KVBudget): inside
    the prompt that is a UsageError, while generating a message on stderr. draft: a
    draft model for speculative decoding (its cache is a fresh plain one)."""
    out = out or sys.stdout
    sampler = make_sampler(args.temp, args.top_p)
    max_tokens = max_tokens or args.max_tokens

    def progress(done, total):
        if ctrl_c is not None and ctrl_c.pressed and done < total:
            raise _StopPrefill
        if kv is not None and done < total:
            check_prefill_budget(kv, done, total, args.prefill_step_size)
        if total > args.prefill_step_size:
            print(
                f"\rprefill {done}/{total} tokens",
                end="" if done < total else "\n",
                file=sys.stderr,
                flush=True,
            )

    text, last = "", None
    speculative, step = {}, 1
    if draft is not None:
        speculative = dict(draft_model=draft, num_draft_tokens=args.num_draft_tokens)
        cache = cache + make_prompt_cache(draft)
        step = args.num_draft_tokens + 1  # a verification step: the drafts and one more
        if (
            kv is not None
        ):  # mlx-lm's speculative decoding reports no prompt progress: the whole prompt now
            check_prefill_budget(kv, 0, len(prompt_ids), args.prefill_step_size, whole=True)
    stream = stream_generate(
        model,
        tokenizer,
        prompt_ids,
        max_tokens=max_tokens,
        sampler=sampler,
        prompt_cache=cache,
        prefill_step_size=args.prefill_step_size,
        prompt_progress_callback=progress,
        **speculative,
    )
    try:
        for r in stream:
            text += r.text
            last = r
            if args.verbose:
                print(r.text, end="", flush=True, file=out)
            if ctrl_c is not None and ctrl_c.pressed:
                break
            # The cache already holds this token: the next step adds the one after it
            # (or a verification step's tokens).
            if kv is not None and r.generation_tokens < max_tokens and r.finish_reason is None:
                try:
                    kv.check(step)
                except budget.BudgetExceeded as e:
                    if args.verbose:
                        print(file=out)
                    print(
                        f"stopped after {r.generation_tokens} generated tokens by --max-kv-bytes: "
                        f"{e}",
                        file=sys.stderr,
                    )
                    break
    except _StopPrefill:
        pass
    finally:
        stream.close()
    if args.verbose:
        print(file=out)
    return text, last


def mib(n):
    return f"{n / 2**20:.2f} MiB"


def context_tokens(cache):
    """Tokens of context the cache holds (every layer holds the same tokens)."""
    return max((int(getattr(c, "offset", 0)) for c in cache), default=0)


def print_stats(name, last, cache, out=None):
    """The stats block; returns memory.cache_bytes(cache)."""
    out = out or sys.stdout
    s = memory.cache_bytes(cache)
    dtype = memory.kv_dtype(cache)
    dtype_name = str(dtype).removeprefix("mlx.core.") if dtype is not None else "?"
    kvarn = [c for c in cache if isinstance(c, KVarNCache)]
    print("=" * 10, file=out)
    print(f"KV cache: {name}", file=out)
    if last is not None:
        print(
            f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens-per-sec", file=out
        )
        print(
            f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} "
            "tokens-per-sec",
            file=out,
        )
        print(f"Peak memory: {last.peak_memory:.3f} GB", file=out)
    room = f" ({mib(s['unused'])} of it preallocated room)" if s["unused"] else ""
    print(f"KV bytes held: {mib(s['held'])} for {context_tokens(cache)} tokens{room}", file=out)
    if not kvarn:
        print(
            f"  mlx-lm's plain cache, {dtype_name}; 2-byte (fp16) equivalent: {mib(s['fp16'])}",
            file=out,
        )
        return s
    if s["tiles"] == 0:
        c = kvarn[0]
        start = (
            memory.saving_starts_at(c.config, c.sink_k.shape[-1], dtype.size)
            if dtype is not None
            else None
        )
        where = f"; KVarN starts saving memory from token {start}" if start is not None else ""
        print(
            f"  no tile quantized yet: every token is held in {dtype_name}, as in mlx-lm's plain "
            f"cache{where}",
            file=out,
        )
        return s
    print(
        f"  mlx-lm's plain cache, {dtype_name}: {mib(s['plain'])} (KVarN holds "
        f"{s['ratio_plain']:.2f}x less)",
        file=out,
    )
    print(
        f"  2-byte (fp16) equivalent: {mib(s['fp16'])} (KVarN holds {s['ratio_fp16']:.2f}x less)",
        file=out,
    )
    print(f"Tiles quantized: {s['tiles']} per layer in {len(kvarn)}/{len(cache)} layers", file=out)
    tail = max(c.config.tail_tokens for c in kvarn)
    if tail:
        dense = sum(c.nbytes_breakdown()["sink_tail"] for c in kvarn)
        print(
            f"  held in {dtype_name}: the sink and the tail (the newest {tail} tokens and the "
            f"tile being filled), {mib(dense)}",
            file=out,
        )
    # A layer decides its key rotation at its first tile; before that there is nothing to report.
    decided = [
        c.key_rotation_summary() for c in kvarn if c.config.rotate_keys == "auto" and c.n_tiles
    ]
    decided = [d for d in decided if d is not None]
    if decided:
        print(
            f"Key rotation (auto): {sum(r for r, _ in decided)}/{sum(n for _, n in decided)} kv "
            f"heads rotated, decided in {len(decided)} layers",
            file=out,
        )
    return s


def print_comparison(cache, ref_cache, last, ref_last, out=None):
    """KVarN against the plain cache: bytes held, bytes per token of context
    (preallocated room left out: the plain cache adds room 256 tokens at a time), and speed."""
    out = out or sys.stdout
    kvarn, plain = memory.cache_bytes(cache), memory.cache_bytes(ref_cache)
    per_token = [
        (s["held"] - s["unused"]) / max(1, context_tokens(c))
        for s, c in ((plain, ref_cache), (kvarn, cache))
    ]
    print(
        f"Measured, held: plain {mib(plain['held'])}, KVarN {mib(kvarn['held'])}; plain/KVarN "
        f"{plain['held'] / kvarn['held']:.2f}x",
        file=out,
    )
    print(
        f"Measured, per token without preallocated room: plain {per_token[0]:.0f} bytes, KVarN "
        f"{per_token[1]:.0f} bytes; plain/KVarN {per_token[0] / per_token[1]:.2f}x",
        file=out,
    )
    if last is not None and ref_last is not None:
        print(
            "Generation speed ratio KVarN/plain: "
            f"{last.generation_tps / ref_last.generation_tps:.2f}",
            file=out,
        )


def _one_line(e):
    return " ".join(str(e).splitlines())


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    try:
        return generate(args)
    except (UsageError, PromptCacheError) as e:
        sys.exit(f"error: {_one_line(e)}")
    except KeyboardInterrupt:  # outside the generation (e.g. while loading the model)
        print("\ninterrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)


def generate(args):
    check_args(args)
    prompt = read_prompt(args)
    cache_file = reuse = None
    if args.prompt_cache_file:
        cache_file = prompt_cache.cache_path(args.prompt_cache_file)
        reuse = cache_file.exists()
        # Both checks read no model: a bad file or folder fails before the work starts.
        if reuse:
            prompt_cache.check_file(cache_file)
        else:
            prompt_cache.check_writable(cache_file)
    if args.seed is not None:
        mx.random.seed(args.seed)

    if mx.distributed.init().rank() > 0:  # every rank computes; rank 0 prints
        sys.stdout = open(os.devnull, "w")
    model, tokenizer = load_model(args.model)
    draft = load_model(args.draft_model)[0] if args.draft_model else None
    prompt_ids = build_prompt(tokenizer, prompt, args.system_prompt, args.ignore_chat_template)
    if len(prompt_ids) == 0:
        raise UsageError("the prompt has no tokens; pass some text with --prompt")
    identity = prompt_cache.model_identity(args.model, model, tokenizer) if cache_file else None
    if reuse:
        cache, _ = prompt_cache.load(cache_file, identity)
        name = f"loaded from {cache_file.name}"
    held = getattr(cache[0], "offset", 0) if reuse and cache else 0
    max_tokens = context_limit(model, args, held, len(prompt_ids))
    if not reuse:
        profile, bytes_like, max_kl, context = kv_profile(args)
        if max_kl is not None:  # holds over what this run can reach: prompt and new tokens
            context = context or len(prompt_ids) + max_tokens
        if profile is not None:
            try:
                mix = profile_mix(model, profile, bytes_like, max_kl, context)[0]
                cache = make_cache(
                    model,
                    profile=profile,
                    bytes_like=bytes_like,
                    max_kl=max_kl,
                    context=context,
                    sink=args.kv_sink,
                    tail_tokens=args.kv_tail_tokens,
                )
            except ValueError as e:
                raise UsageError(f"--kv-profile: {e}") from None
            name = f"per-layer widths from {profile}"
            if args.verbose:
                print(mix.describe(), file=sys.stderr)
        else:
            try:
                cache = make_cache(
                    model,
                    args.kv_preset,
                    sink=args.kv_sink,
                    tail_tokens=args.kv_tail_tokens,
                    fp16_layers=fp16_layers(args),
                )
            except ValueError as e:
                if not args.kv_fp16_layers:
                    raise
                raise UsageError(
                    f"--kv-fp16-layers {args.kv_fp16_layers}: {e}"
                ) from None  # a layer the model lacks
            name = args.kv_preset + (
                f", layers {args.kv_fp16_layers} plain" if args.kv_fp16_layers else ""
            )
            tails = [c.config.tail_tokens for c in cache if isinstance(c, KVarNCache)]
            tail = max(tails, default=0)
            if tail:
                name += f", newest {tail} tokens in full precision"

    with CtrlC() as ctrl_c:
        text, last = run(
            model,
            tokenizer,
            prompt_ids,
            cache,
            args,
            max_tokens,
            ctrl_c,
            kv=kv_budget(model, cache, args),
            draft=draft,
        )
    if ctrl_c.pressed:
        print("interrupted: stopped the generation", file=sys.stderr)
    if args.verbose:
        print_stats(name, last, cache)
    else:  # as mlx_lm.generate: just the text
        print(text)
    if cache_file and not reuse:
        if last is None:  # stopped inside the prompt: the cache holds part of it
            print(
                f"not saving the prompt cache to {cache_file}: the prompt was not fully processed",
                file=sys.stderr,
            )
        else:
            prompt_cache.save(cache_file, cache, identity)
            print(f"Saved the prompt cache to {cache_file}", file=sys.stderr)
    if ctrl_c.pressed:
        sys.exit(INTERRUPTED)

    if args.compare:
        mx.reset_peak_memory()
        print("\n--- same prompt, mlx-lm's plain KV cache (--kv-preset fp16) ---")
        ref_cache = make_cache(model, FP16)
        with CtrlC() as ctrl_c:
            ref_text, ref_last = run(
                model,
                tokenizer,
                prompt_ids,
                ref_cache,
                args,
                max_tokens,
                ctrl_c,
                kv=kv_budget(model, ref_cache, args),
                draft=draft,
            )
        if not args.verbose:
            print(ref_text)
        print_stats(FP16, ref_last, ref_cache)
        print_comparison(cache, ref_cache, last, ref_last)
        if ctrl_c.pressed:
            sys.exit(INTERRUPTED)


if __name__ == "__main__":
    main()
