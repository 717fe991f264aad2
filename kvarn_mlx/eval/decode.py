"""Greedy decoding: steps until a method's first token that differs from the
full-precision run, and per-step KL on the full-precision trajectory."""

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from .methods import make_caches, method_bits
from .runner import Progress, for_model, kl, log_softmax, pyplot, run_chunks, tokens

NAME = "decode"
HELP = "greedy decode: first divergence and per-step KL"


def add_arguments(p):
    p.add_argument("--methods", default="kivi2,rot2,kvarn2,k4v2_g128")
    p.add_argument("--prompt-len", type=int, default=384)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--text", default="licenses")
    p.add_argument(
        "--prompts", type=int, default=1, help="prompts (consecutive pieces of the text)"
    )


def run(args, model, tokenizer, methods, meta_md):
    """(result for the json, markdown, plot drawer) of one CLI run."""
    res = decode(
        model,
        tokenizer,
        methods,
        args.prompt_len,
        args.steps,
        args.text,
        prompts=args.prompts,
        attention_mode=args.attention,
    )
    return res, markdown(res, meta_md), lambda folder: plots(res, folder)


def decode(
    model,
    tokenizer,
    methods,
    prompt_len=384,
    steps=256,
    source="licenses",
    chunk=256,
    prompts=1,
    attention_mode="dequant",
):
    """Per prompt (consecutive prompt_len-token pieces of the text): the fp greedy
    trajectory, then each method teacher-forced on it."""
    all_ids = tokens(tokenizer, source, prompt_len * prompts)
    res = {
        "prompt_len": prompt_len,
        "steps": steps,
        "source": source,
        "prompts": prompts,
        "methods": {m: {"kl_per_prompt": [], "first_divergence": []} for m in methods},
    }
    for j in range(prompts):
        ids = all_ids[j * prompt_len : (j + 1) * prompt_len]
        tag = f"p{j} " if prompts > 1 else ""
        traj, ref_lp = _greedy(
            model, ids, mlx_cache.make_prompt_cache(model), steps, chunk, f"{tag}fp"
        )
        for name in methods:
            caches = for_model(make_caches(model, name), attention_mode)
            kls, first_div, _ = _forced(model, ids, caches, traj, ref_lp, chunk, f"{tag}{name}")
            res["methods"][name]["kl_per_prompt"].append(np.array(kls))
            res["methods"][name]["first_divergence"].append(first_div)
    for r in res["methods"].values():
        r["kl"] = np.mean(r["kl_per_prompt"], axis=0)
        # No divergence within the steps counts as `steps` (a lower bound) for the median.
        r["first_divergence_median"] = float(
            np.median([steps if d is None else d for d in r["first_divergence"]])
        )
    return res


def _prefill_last(model, ids, caches, chunk, label):
    last = []
    run_chunks(
        model, ids, caches, chunk, lambda s, lg: last.append(lg[-1]), label=f"{label} prefill"
    )
    return last[-1]


def _greedy(model, ids, caches, steps, chunk, label):
    y = _prefill_last(model, ids, caches, chunk, label)
    traj, ref_lp = [], []
    bar = Progress(steps, f"{label} decode")
    for _ in range(steps):
        lp = log_softmax(y)
        tok = mx.argmax(lp)
        mx.eval(lp, tok)
        traj.append(int(tok.item()))
        ref_lp.append(lp)
        y = model(tok.reshape(1, 1), cache=caches)[0, -1]
        bar.step()
    return traj, ref_lp


def _forced(model, ids, caches, traj, ref_lp, chunk, label):
    """Per step of the trajectory: KL to ref_lp and whether the greedy token is the trajectory's;
    returns (KLs, first step that differs or None, agreements)."""
    y = _prefill_last(model, ids, caches, chunk, label)
    kls, first_div, agree = [], None, []
    bar = Progress(len(traj), f"{label} decode")
    for i, t in enumerate(traj):
        lp = log_softmax(y)
        k = kl(ref_lp[i], lp)
        top = mx.argmax(lp)
        mx.eval(k, top)
        kls.append(max(float(k.item()), 0.0))
        agree.append(int(top.item()) == t)
        if first_div is None and not agree[-1]:
            first_div = i
        # Teacher-forced on the fp trajectory: identical to free-running up to the first divergence.
        y = model(mx.array([[t]]), cache=caches)[0, -1]
        bar.step()
    return kls, first_div, agree


def markdown(res, meta_md):
    P = res.get("prompts", 1)
    out = [
        f"# Decode (greedy, text: {res['source']})\n",
        meta_md,
        f"\n{P} prompt(s) of {res['prompt_len']} tokens (consecutive pieces of the text), "
        f"{res['steps']} greedy steps each. First divergence: the first step whose greedy token "
        "differs from the full-precision run's (free-running and teacher-forced decoding agree "
        "up to that step; 'none' = no divergence within the steps, counted as the step count in "
        "the median). KL: per step on the full-precision trajectory (teacher-forced), averaged "
        "over prompts. With sink 128 and 128-token tiles, tokens generated after the prompt are "
        "quantized once the tail fills.\n",
        "| method | K/V bits | first divergence per prompt | median | KL mean | KL p99 | KL "
        "mean, steps < 128 | KL mean, steps >= 128 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res["methods"].items():
        kl = np.asarray(r["kl"])
        fd = ", ".join("none" if d is None else str(d) for d in r["first_divergence"])
        late = kl[128:].mean() if len(kl) > 128 else float("nan")
        out.append(
            f"| {name} | {method_bits(name)} | {fd} | {r['first_divergence_median']:.0f} | "
            f"{kl.mean():.4f} | {np.percentile(kl, 99):.3f} | {kl[:128].mean():.4f} | {late:.4f} |"
        )
    return "\n".join(out) + "\n"


def plots(res, outdir, smooth=16):
    plt = pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    k = np.ones(smooth) / smooth
    for name, r in res["methods"].items():
        ax.plot(
            res["prompt_len"] + np.arange(len(r["kl"])),
            np.maximum(np.convolve(r["kl"], k, mode="same"), 1e-7),
            label=f"{name} (first divergence, median {r['first_divergence_median']:.0f})",
        )
    ax.set(
        xlabel="position (tokens)",
        ylabel=f"KL to fp (nats, {smooth}-step mean)",
        yscale="log",
        title=f"teacher-forced decode on the fp trajectory ({res.get('prompts', 1)} prompts)",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    f = outdir / "decode_kl.png"
    fig.savefig(f, dpi=110)
    plt.close("all")
    return [f]
