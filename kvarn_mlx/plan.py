"""python -m kvarn_mlx.plan: how much context fits in memory, per KV cache.

For a model (its config.json and its weight files' sizes; the weights are never
read, model_info.py) and a memory budget, prints the weights' bytes, the KV cache's
bytes per token and the longest context that fits, for mlx-lm's plain cache, its 8-
and 4-bit QuantizedKVCache and each KVarN preset. `--context N` says which fit N tokens.

Bytes come from the caches themselves (byte_models.py): the model's mlx-lm class is
built lazily to make its prompt cache and push one token through it, which gives every
layer's cache class, kv heads, head dims and dtype; small real caches of those classes
and shapes give each layer's growth rule. Room depends on the order the tokens came in
(prompt chunks, decode steps); the planner counts the most any order leaves, so a
context that "fits" fits whatever the prompt's length.

Quality (plan_kl.py): each cache's mean KL to the plain cache where it is known,
measured (the embedded models) or predicted by --profile, which also adds the
calibrated mix; --max-kl keeps the caches within that KL.

--json prints one object:
  model, model_type, dtype           the model, its mlx-lm type, the KV dtype planned
  dtype_note                         why the dtype was assumed, or null
  layers                             its cache layers, in words
  max_position_embeddings            from config.json, or null
  weights_bytes, weights_source      the weights' bytes and where they were read
  budget_bytes, budget_source        the memory budget and where it came from
  overhead_bytes                     the allowance (--overhead)
  kv_budget_bytes                    budget - weights - allowance
  prefill_step_size, context, max_kl the options (context, max_kl: null when not given)
  kl_source                          what the KLs are (measured where, predicted from
                                     which profile), or null when none is known
  mix                                the calibrated mix (mix.Mix.summary(): widths per
                                     layer, tile bytes per token, predicted_kl, target),
                                     or null
  caches                             one object per cache:
    cache, note, warning             its name, what it is, a caveat or null
    kl, kl_source                    mean KL to the plain cache and "measured",
                                     "predicted" or "reference"; null, null if unknown
    within_max_kl                    (with --max-kl) kl <= max_kl, or null if unknown
    error                            why the cache does not apply (then none below)
    bytes_per_token                  bytes each further token adds
    longest_context                  the most tokens that fit, or null (no limit)
    kv_bytes_at_context, fits_context  (with --context) the most the caches can hold
                                     at any step up to that many tokens, and whether
                                     it is within kv_budget_bytes
  longest_context_at_max_kl          (with --max-kl) {cache, tokens} of the cache within
                                     the KL that fits the longest context, or null
"""

import argparse
import json
import logging
import math
import os
import sys
import textwrap
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from . import plan_kl
from .byte_models import (
    DTYPES,
    MLX_KV_GROUP_SIZE,
    PREFILL_STEP_SIZE,
    PlanError,
    byte_model,
    flat_caches,
    human,
    longest_context,
    model_layers,
    parse_bytes,
)
from .cache import KVarNCache
from .config import DEFAULT_PRESET, PRESETS, default_tail_words, tail_error
from .model_info import config_dtype, lazy_model, parameter_bytes, read_model

MLX_KV_BITS = (8, 4)
# Activations of a prefill chunk and the runtime: a stated allowance, not a
# measurement (override with --overhead). It does not grow with the context.
DEFAULT_OVERHEAD = "1GiB"


def machine_budget():
    """(bytes, where they come from): on a Mac, Metal's working-set limit for the
    GPU (what MLX can keep resident); elsewhere the machine's RAM."""
    if mx.metal.is_available():
        info = mx.device_info()
        limit, ram = info["max_recommended_working_set_size"], info["memory_size"]
        return limit, (
            f"this Mac's GPU working-set limit ({limit / ram:.0%} of {human(ram)} unified memory; "
            "macOS lets the GPU wire about 2/3-3/4 of it by default)"
        )
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram, "this machine's RAM"


# -- the caches compared ------------------------------------------------------------------


def _quiet_make_cache(model, preset, **overrides):
    from .integration import make_cache

    log = logging.getLogger("kvarn_mlx")
    level = log.level
    log.setLevel(logging.ERROR)  # make_cache says which layers it leaves; the table shows it
    try:
        return make_cache(model, preset, **overrides)
    finally:
        log.setLevel(level)


def kvarn_kinds(caches):
    """Per cache layer (in model_layers' order) of caches make_cache built: the
    KVarNConfig where it put a KVarNCache, "plain" where it left the layer as it is."""
    return [c.config if isinstance(c, KVarNCache) else "plain" for c, _ in flat_caches(caches)]


def run_fails(model, caches, then=None):
    """Why two tokens through the model with these caches raise, or None (lazy:
    nothing is computed). then(caches) runs between the tokens."""
    try:
        model(mx.array([[0]]), cache=caches)
        if then is not None:
            then(caches)
        model(mx.array([[0]]), cache=caches)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def quantize_like_mlx_lm(caches, bits):
    """mlx_lm.generate --kv-bits: top-level caches with to_quantized become
    QuantizedKVCache (leaving here, with a warning, those that cannot)."""
    for i, c in enumerate(caches):
        if hasattr(c, "to_quantized"):
            try:
                caches[i] = c.to_quantized(group_size=MLX_KV_GROUP_SIZE, bits=bits)
            except NotImplementedError:
                pass


def _mlx_quantizes_windows():
    try:
        RotatingKVCache(max_size=4).to_quantized()
    except NotImplementedError:
        return False
    return True


@dataclass
class CachePlan:
    """One cache kind for the whole model: a byte model per cache layer, in the
    order of model_layers (identical layers share one)."""

    name: str
    note: str  # what the cache is
    warning: str = None
    models: list = None
    error: str = None

    @property
    def per_token(self):
        return sum(m.per_token for m in self.models)

    def peak(self, n):
        """The most bytes the model's caches hold at any point up to n tokens."""
        return sum(m.peak(n) for m in self.models)


def _cache_plan(name, note, layers, kinds, prefill, warning=None, error=None):
    """A CachePlan from each layer's cache kind (see byte_model), or the error that
    makes the cache not applicable to this model."""
    built = {}
    if error is None:
        try:
            for key in zip(layers, kinds):
                if key not in built:
                    built[key] = byte_model(*key, prefill)
        except ValueError as e:
            error = str(e)
    if error is not None:
        return CachePlan(name, note, warning, error=error)
    return CachePlan(name, note, warning, [built[key] for key in zip(layers, kinds)])


def cache_plans(config, dtype, prefill=PREFILL_STEP_SIZE, model=None, tail_tokens=None):
    """CachePlan per cache compared: plain (model dtype, and float16 if that differs),
    mlx-lm 8- and 4-bit, each KVarN preset (with tail_tokens, None: make_cache's default)."""
    model = model or lazy_model(config, dtype)
    layers = model_layers(model)
    plain = ["plain"] * len(layers)
    plans = [_cache_plan(f"plain ({dtype})", "mlx-lm KVCache", layers, plain, prefill)]
    if DTYPES[dtype].size != 2:
        fp16 = model_layers(lazy_model(config, "float16"))
        plans.append(
            _cache_plan("plain (float16)", "mlx-lm KVCache in float16", fp16, plain, prefill)
        )

    warning = None
    if any(l.kind == "window" and l.top_level for l in layers) and not _mlx_quantizes_windows():
        warning = (
            "mlx-lm cannot quantize RotatingKVCache (sliding-window) layers: they are counted "
            "plain here, but mlx_lm.generate --kv-bits stops with NotImplementedError once they "
            "reach quantized_kv_start"
        )
    for bits in MLX_KV_BITS:
        fails = run_fails(model, make_prompt_cache(model), lambda c: quantize_like_mlx_lm(c, bits))
        kinds = [bits if l.kind == "kv" and l.top_level else "plain" for l in layers]
        plans.append(
            _cache_plan(
                f"mlx-lm {bits}-bit",
                f"QuantizedKVCache, group {MLX_KV_GROUP_SIZE}",
                layers,
                kinds,
                prefill,
                warning,
                fails and f"the model raises with mlx-lm's QuantizedKVCache ({fails})",
            )
        )

    for p in PRESETS:
        caches = _quiet_make_cache(model, p, tail_tokens=tail_tokens)
        fails = run_fails(model, caches)
        plans.append(
            _cache_plan(
                p,
                "KVarNCache where make_cache puts one",
                layers,
                kvarn_kinds(caches),
                prefill,
                error=fails and f"the model raises with this KVarN cache ({fails})",
            )
        )
    return plans


# -- the plan --------------------------------------------------------------------------------


def describe_layers(layers):
    counts = {}
    for l in layers:
        if l.kind == "state":
            key = f"{l.cls} (fixed state)"
        else:
            shape = f"{l.heads} kv head{'s' if l.heads > 1 else ''} x head dim {l.k_dim}" + (
                f"/{l.v_dim}" if l.v_dim != l.k_dim else ""
            )
            key = (
                f"full attention, {shape}"
                if l.kind == "kv"
                else f"sliding window {l.window}, {shape}"
            )
        counts[key] = counts.get(key, 0) + 1
    return f"{len(layers)} cache layers: " + "; ".join(f"{n} {k}" for k, n in counts.items())


def mix_plan(model, layers, quality, prefill):
    """The CachePlan of a profile's calibrated mix (plan_kl.Quality), or of why
    there is none."""
    name, note = "calibrated mix", "per-layer widths from the profile"
    if quality.mix is None:
        return CachePlan(name, note, error=quality.mix_error)
    note = f"per-layer widths from the profile, {quality.mix.target}"
    kinds = kvarn_kinds(_quiet_make_cache(model, quality.mix_configs))
    return _cache_plan(name, note, layers, kinds, prefill)


def plan(
    info,
    budget,
    budget_source,
    overhead,
    context=None,
    dtype=None,
    prefill=PREFILL_STEP_SIZE,
    max_kl=None,
    quality=None,
    tail_tokens=None,
):
    """Everything the CLI prints, as a dict (the --json output). quality: the KLs
    to quote (plan_kl.Quality), or None. tail_tokens: the presets' (--kv-tail-tokens;
    None: make_cache's default)."""
    dtype = dtype or config_dtype(info.config)
    dtype_note = None
    if dtype is None:
        dtype, dtype_note = "float16", "config.json names no dtype: float16 assumed (set --dtype)"
    model = lazy_model(info.config, dtype)
    layers = model_layers(model)
    plans = cache_plans(info.config, dtype, prefill, model, tail_tokens)
    kl = dict(quality.kl) if quality else {}
    if quality and quality.reference in (None, f"plain ({dtype})"):
        kl[f"plain ({dtype})"] = (0.0, "reference")
    if quality and (quality.mix is not None or quality.mix_error):
        plans.append(mix_plan(model, layers, quality, prefill))
        if quality.mix is not None:
            kl["calibrated mix"] = (quality.mix_kl, "predicted")
    weights = info.weights_bytes
    if weights is None:
        weights = parameter_bytes(model, info.config)
    available = budget - weights - overhead
    cfg = {**(info.config.get("text_config") or {}), **info.config}
    out = {
        "model": info.name,
        "model_type": info.config.get("model_type"),
        "dtype": dtype,
        "dtype_note": dtype_note,
        "layers": describe_layers(layers),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "weights_bytes": weights,
        "weights_source": info.weights_source,
        "budget_bytes": budget,
        "budget_source": budget_source,
        "overhead_bytes": overhead,
        "kv_budget_bytes": available,
        "prefill_step_size": prefill,
        "kv_tail_tokens": tail_tokens,
        "context": context,
        "max_kl": max_kl,
        "kl_source": quality.source if quality else None,
        "mix": quality.mix.summary() if quality and quality.mix else None,
        "caches": [],
        "longest_context_at_max_kl": None,
    }
    for c in plans:
        value, source = kl.get(c.name, (None, None))
        row = {"cache": c.name, "note": c.note, "warning": c.warning}
        row.update(kl=value, kl_source=source)
        if max_kl is not None:
            row["within_max_kl"] = None if value is None else value <= max_kl
        if c.error:
            out["caches"].append({**row, "error": c.error})
            continue
        row.update(
            bytes_per_token=c.per_token,
            longest_context=longest_context(c.peak, c.per_token, available),
        )
        if context is not None:
            row.update(
                kv_bytes_at_context=c.peak(context), fits_context=c.peak(context) <= available
            )
        out["caches"].append(row)
    if max_kl is not None:
        within = [r for r in out["caches"] if r.get("within_max_kl") and "error" not in r]
        if within:
            best = max(
                within,
                key=lambda r: (
                    float("inf") if r["longest_context"] is None else r["longest_context"]
                ),
            )
            out["longest_context_at_max_kl"] = {
                "cache": best["cache"],
                "tokens": best["longest_context"],
            }
    return out


def format_plan(p):
    ctx = p["context"]
    lines = [
        f"model      {p['model']} ({p['model_type']}, {p['dtype']})",
        f"           {p['layers']}",
        f"weights    {human(p['weights_bytes'])} ({p['weights_source']})",
        f"budget     {human(p['budget_bytes'])} ({p['budget_source']})",
        f"KV budget  {human(p['kv_budget_bytes'])} = budget - weights - "
        f"{human(p['overhead_bytes'])} allowance for activations and the runtime (--overhead)",
    ]
    if p["kv_budget_bytes"] <= 0:
        lines.append(
            "note       the weights and the allowance alone exceed the budget: no context fits"
        )
    if p["dtype_note"]:
        lines.append(f"note       {p['dtype_note']}")
    if p["max_position_embeddings"]:
        lines.append(
            f"context    the model takes up to {p['max_position_embeddings']:,} tokens "
            "(max_position_embeddings)"
        )
        if ctx is not None and ctx > p["max_position_embeddings"] and p["kl_source"]:
            lines += textwrap.wrap(
                f"note       --context {ctx:,} is past the model's context: the plain cache's "
                "own output degrades there and every cache's KL to it jumps, the calibrated "
                "mixes' most; KLs quoted at it are less reliable (docs/results.md, \"Predicting "
                'the KL at a context")',
                100,
                subsequent_indent=" " * 11,
            )
    if p["mix"]:
        widths = {}
        for kv in p["mix"]["widths"].values():
            widths[kv] = widths.get(kv, 0) + 1
        common = ", ".join(f"{kv} x{n}" for kv, n in sorted(widths.items(), key=lambda t: -t[1]))
        lines.append(f"mix        calibrated mix ({p['mix']['target']}): {common}")
    lines.append("")
    max_kl = p["max_kl"]
    head = f"{'cache':<18} {'KV bytes/token':>14} {'longest context':>16}"
    if ctx is not None:
        head += f" {f'KV at {ctx:,}':>16} {'fits':>5}"
    head += f" {'mean KL':>9}  from"
    lines += [head, "-" * len(head)]
    warnings, above, unknown = [], [], []
    for r in p["caches"]:
        if max_kl is not None and not r["within_max_kl"]:
            (unknown if r["kl"] is None else above).append(r["cache"])
            continue
        if "error" in r:
            lines.append(f"{r['cache']:<18} not applicable: {r['error']}")
            continue
        n = r["longest_context"]
        line = (
            f"{r['cache']:<18} {human(r['bytes_per_token']):>14} "
            f"{'no limit' if n is None else f'{n:,}':>16}"
        )
        if ctx is not None:
            line += (
                f" {human(r['kv_bytes_at_context']):>16} {'yes' if r['fits_context'] else 'no':>5}"
            )
        kl = "-" if r["kl"] is None else f"{r['kl']:.2g}"
        line += f" {kl:>9}  {r['kl_source'] or 'not measured for this model'}"
        lines.append(line)
        if r["warning"] and r["warning"] not in warnings:
            warnings.append(r["warning"])
    if max_kl is not None:
        best = p["longest_context_at_max_kl"]
        if best is None:
            lines.append(f"no cache has a known mean KL <= {max_kl:g}")
        else:
            n = "no limit" if best["tokens"] is None else f"{best['tokens']:,} tokens"
            lines.append(f"longest context at mean KL <= {max_kl:g}: {n} ({best['cache']})")
        if above:
            lines += textwrap.wrap(
                f"left out, mean KL above {max_kl:g}: {', '.join(above)}",
                100,
                subsequent_indent="  ",
            )
        if unknown:
            lines += textwrap.wrap(
                f"left out, KL not measured for this model: {', '.join(unknown)}",
                100,
                subsequent_indent="  ",
            )
    legend = (
        "KV bytes/token: what each further token adds (sliding-window and recurrent layers add "
        "nothing). Longest context (and KV at a context): the most every cache layer can hold "
        "at any step up to that many tokens, whatever the order of prompt chunks and decode "
        "steps: sink, tail buffer (with a finished tile waiting for its commit turn) and "
        "preallocated room included, with prompts prefilled in chunks of "
        f"{p['prefill_step_size']:,} tokens at most; KVarN presets "
        + (
            "as make_cache and the commands build them, the newest tokens in full precision "
            f"({default_tail_words()})"
            if p["kv_tail_tokens"] is None
            else f"with the newest {p['kv_tail_tokens']:,} tokens in full precision"
        )
        + " (--kv-tail-tokens). The allowance does not grow with the "
        "context: transient buffers of a long prefill that do (a chunk's attention scores where "
        "attention is not fused) are not in it. Mean KL: to the plain cache, of the presets "
        "without a tail (which lowered it in every measurement), "
        + (p["kl_source"] or "none known for this model (--profile PROFILE.json predicts them)")
        + "."
    )
    lines += ["", *textwrap.wrap(legend, 100)]
    for w in warnings:
        lines += textwrap.wrap(f"note: {w}", 100, subsequent_indent="      ")
    return "\n".join(lines)


def setup_arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m kvarn_mlx.plan",
        description="How much context fits in memory, for the plain, mlx-lm quantized and "
        "KVarN KV caches.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="Local model folder (with config.json) or Hugging Face repo id; "
        "reads only config.json and the weight files' sizes "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--memory",
        default=None,
        help="Memory budget, e.g. 24GB (powers of 1024). "
        "Default: on a Mac the GPU's working-set limit, elsewhere the machine's RAM",
    )
    p.add_argument(
        "--overhead",
        default=DEFAULT_OVERHEAD,
        help="Allowance for activations, the runtime and transient buffers "
        f"(default {DEFAULT_OVERHEAD})",
    )
    p.add_argument(
        "--context", type=int, default=None, help="Also say which caches fit this many tokens"
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="The dtype the model runs in (default: config.json's)",
    )
    p.add_argument(
        "--prefill-step-size",
        type=int,
        default=PREFILL_STEP_SIZE,
        help="Prompt tokens per prefill step, as in generate "
        "(sliding-window layers hold one chunk more)",
    )
    p.add_argument(
        "--max-kl",
        type=float,
        default=None,
        help="Keep the caches whose mean KL to the plain cache (measured, or predicted by "
        "--profile) is at most this, and say the longest context at that KL",
    )
    p.add_argument(
        "--profile",
        default=None,
        help="The model's calibration profile (python -m kvarn_mlx.calibrate): predicted KL "
        "per preset and the calibrated mix (loads the model's weights to check the profile)",
    )
    p.add_argument(
        "--kv-tail-tokens",
        type=int,
        default=None,
        metavar="N",
        help="The KVarN presets' newest tokens kept in full precision, as generate's flag "
        f"(default: make_cache's, {default_tail_words()})",
    )
    p.add_argument("--json", action="store_true", help="Print the plan as JSON")
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    try:
        if args.context is not None and args.context < 1:
            raise PlanError(f"--context {args.context}: give a number of tokens, at least 1")
        if args.prefill_step_size < 1:
            raise PlanError(f"--prefill-step-size {args.prefill_step_size} must be at least 1")
        if problem := tail_error(DEFAULT_PRESET, args.kv_tail_tokens):
            raise PlanError(f"--kv-tail-tokens: {problem}")
        if args.memory is None:
            budget, source = machine_budget()
        else:
            budget, source = parse_bytes(args.memory), "from --memory"
        overhead = parse_bytes(args.overhead)
        from .loader import ModelLoadError

        try:
            info = read_model(args.model)
        except ModelLoadError as e:
            raise PlanError(str(e)) from e
        if args.max_kl is not None and not (math.isfinite(args.max_kl) and args.max_kl > 0):
            raise PlanError(f"--max-kl {args.max_kl}: give a KL in nats > 0, e.g. 0.005")
        quality = plan_kl.measured(info)
        if args.profile is not None:
            quality = plan_kl.with_profile(
                args.profile, args.model, args.max_kl, quality, args.context
            )
        p = plan(
            info,
            budget,
            source,
            overhead,
            args.context,
            args.dtype,
            args.prefill_step_size,
            args.max_kl,
            quality,
            args.kv_tail_tokens,
        )
    except PlanError as e:
        sys.exit(f"error: {e}")
    print(json.dumps(p, indent=2) if args.json else format_plan(p))


if __name__ == "__main__":
    main()
