"""KVarN on each architecture of tests/archmodels.py (tiny random-weight mlx-lm
models): the README's family table.

Per family: layers KVarN replaces, whether attention runs packed, held bytes
against the plain cache at N tokens (float16 model; float32 for MoE, which runs
float32 only on the CPU), and fidelity over 32 decode steps teacher-forced on
the plain cache's greedy tokens (top-1 agreement and mean KL to the plain
cache), with mlx-lm's 4-bit QuantizedKVCache alongside where mlx-lm can run it.
At 8 bits (once the config takes them): whether free-running greedy tokens
equal the plain cache's for 32 steps.

    python benchmarks/architectures.py [--tokens 600 4096] [--out benchmarks/results]
"""

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models import base
from mlx_lm.models.cache import CacheList, KVCache, make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import kvarn_mlx  # noqa: E402
from archmodels import FAMILIES, tiny_model  # noqa: E402
from kvarn_mlx import PRESETS, KVarNCache  # noqa: E402
from kvarn_mlx.eval.runner import meta_markdown, metadata  # noqa: E402
from models import tokens  # noqa: E402

MOE = {"qwen3_moe", "gpt_oss", "qwen3_next"}
SINK, PROMPT, STEPS = 16, 16 + 128 + 110, 32


def members(caches):
    return [m for c in caches for m in (c.caches if isinstance(c, CacheList) else (c,))]


def layers_replaced(model):
    plain, kvarn = make_prompt_cache(model), kvarn_mlx.make_cache(model, "k4v4_g128", sink=SINK)
    kinds = sorted({type(c).__name__ for c in members(plain)} - {"KVCache"})
    n = sum(isinstance(c, KVarNCache) for c in members(kvarn))
    return f"{n} / {len(plain)}" + (f" (others: {', '.join(kinds)})" if kinds else "")


def attention_path(model):
    cache = kvarn_mlx.make_cache(model, "k4v4_g128", sink=SINK)
    # Count the calls mlx-lm's patched attention entry point sends to packed attention.
    entry = sys.modules[base.scaled_dot_product_attention.__module__]
    calls, real = [], entry.packed_attention
    entry.packed_attention = lambda q, c, *a, **k: calls.append(1) or real(q, c, *a, **k)
    try:
        mx.eval(model(mx.array(tokens(PROMPT))[None], cache=cache))
    finally:
        entry.packed_attention = real
    if not any(isinstance(c, KVarNCache) for c in members(cache)):
        return "none quantized"
    return "packed" if calls else "dequantizing fallback"


def memory_ratio(family, N):
    model = tiny_model(family, mx.float32 if family in MOE else mx.float16)
    x = mx.array(tokens(N, seed=3))[None]
    kvarn, plain = kvarn_mlx.make_cache(model, "k4v4_g128", sink=SINK), make_prompt_cache(model)
    mx.eval(model(x, cache=kvarn), model(x, cache=plain))
    pairs = [(k, p) for k, p in zip(members(kvarn), members(plain)) if isinstance(k, KVarNCache)]
    if not pairs:
        return "-"
    held = sum(k.nbytes for k, _ in pairs)
    used = sum(p.keys[..., :N, :].nbytes + p.values[..., :N, :].nbytes for _, p in pairs)
    return f"{used / held:.2f}x"


def greedy(model, cache, prompt):
    return [
        int(t)
        for t, _ in generate_step(mx.array(prompt), model, max_tokens=STEPS, prompt_cache=cache)
    ]


def teacher_forced(model, cache, prompt, toks):
    """Log-probabilities of the steps that predict toks, feeding toks one by one."""
    out = [model(mx.array(prompt)[None], cache=cache)[0, -1]]
    for t in toks[:-1]:
        out.append(model(mx.array([[t]]), cache=cache)[0, -1])
    return np.stack([np.array(o - mx.logsumexp(o)) for o in out])


def fidelity(model, make):
    prompt = tokens(PROMPT, seed=4)
    toks = greedy(model, make_prompt_cache(model), prompt)
    ref = teacher_forced(model, make_prompt_cache(model), prompt, toks)
    try:
        got = teacher_forced(model, make(), prompt, toks)
    except (
        ValueError,
        TypeError,
    ):  # mlx-lm 4-bit: no sinks, no head dim 96, no mx.fast callers, no CacheList
        return "n/a"
    kl = (np.exp(ref) * (ref - got)).sum(-1).mean()
    return f"{(got.argmax(-1) == np.array(toks)).sum()}/{STEPS}, KL {kl:.1e}"


def mlx_lm_4bit(model):
    caches = make_prompt_cache(model)
    if not any(type(c) is KVCache for c in caches):
        raise ValueError(
            "mlx-lm's --kv-bits quantizes top-level KVCache layers only (not those inside a "
            "CacheList)"
        )
    return [c.to_quantized(group_size=64, bits=4) if type(c) is KVCache else c for c in caches]


def greedy_8bit(model):
    if "k8v8_g128" not in PRESETS:
        return "needs 8-bit widths"
    prompt = tokens(PROMPT, seed=4)
    got = greedy(model, kvarn_mlx.make_cache(model, "k8v8_g128", sink=SINK), prompt)
    plain = list(
        generate_step(
            mx.array(prompt), model, max_tokens=STEPS, prompt_cache=make_prompt_cache(model)
        )
    )
    first = next((i for i, (a, (b, _)) in enumerate(zip(got, plain)) if a != int(b)), None)
    if first is None:
        return "equal"
    logprobs = np.sort(np.array(plain[first][1]))
    gap = (logprobs[-1] - logprobs[-2]) / (logprobs[-1] - logprobs[0])
    return (
        f"equal to step {first}, where the plain cache's top two are {gap:.1e} of the logit range "
        "apart"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[600, 4096])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    mem = " | ".join(f"memory vs plain, {n} tokens" for n in args.tokens)
    lines = [
        f"| family | mlx-lm class | KVarN layers / all | attention | {mem} | k4v4: top-1 "
        "agreement, KL (teacher-forced) | mlx-lm 4-bit: same | k8v8: 32 greedy tokens |",
        "|" + "---|" * (7 + len(args.tokens)),
    ]
    for family, cfg in FAMILIES.items():
        model = tiny_model(family)
        module = cfg["model_type"] + (
            f" ({cfg['text_config']['model_type']})" if "text_config" in cfg else ""
        )
        row = [
            family,
            f"mlx_lm.models.{module}",
            layers_replaced(model),
            attention_path(model),
            *(memory_ratio(family, n) for n in args.tokens),
            fidelity(model, lambda: kvarn_mlx.make_cache(model, "k4v4_g128", sink=SINK)),
            fidelity(model, lambda: mlx_lm_4bit(model)),
            greedy_8bit(model),
        ]
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    meta = metadata(
        "tiny random-weight models of tests/archmodels.py",
        "python benchmarks/architectures.py " + " ".join(sys.argv[1:]),
    )
    intro = (
        "Sink 16 tokens, tiles of 128. Memory: held bytes of the KVarN k4v4 layers against the "
        "plain cache's same layers holding the same tokens; float16 models, except MoE "
        "(qwen3_moe, gpt_oss, qwen3_next) in float32, which mlx runs float32 only on the CPU. "
        f"Fidelity: 32 decode steps after a {PROMPT}-token prompt, teacher-forced on the plain "
        "cache's greedy tokens. Random weights leave many near-tied logits: these numbers check "
        "the integration per architecture, not the quality a trained model would see (the model "
        "cards measure that). mlx-lm 4-bit n/a: mlx-lm raises on that model, or (falcon_h1) its "
        "--kv-bits leaves the KVCache inside a CacheList unquantized.\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    md = ["# KVarN across architectures\n", meta_markdown(meta), intro, *lines]
    (args.out / "architectures.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
