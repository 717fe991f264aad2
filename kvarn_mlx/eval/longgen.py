"""Long generation: thousands of greedy tokens from reasoning-style questions.

Per prompt, the plain cache generates --steps tokens greedily (free-running);
each method then reads the same tokens (teacher-forced on that trajectory),
which gives its KL to the plain cache at every step and the first step where
its own greedy token differs: up to that step, its free-running output is the
plain cache's, token for token. The end-of-sequence tokens are masked out for
every cache alike, so each answer runs the whole length, as a long chain of
reasoning would (a small model may start repeating itself: the trajectory is
what the plain cache generates, whatever it is). The decode experiment's
machinery (decode.py), on chat prompts instead of pieces of a text.

The plain cache generates one token per step. The methods read the trajectory
in steps of many tokens, each ending where a KVarN tile completes (every 128
tokens for other caches): a query then reads exactly what it reads in one-token
decoding (tiles completed before its step quantized, the tokens after them in
full precision; mlx-lm's QuantizedKVCache quantizes every token anyway), up to
float rounding, at a fraction of the cost. Two kinds of query come one per step,
as in decoding: those after a tile completes until every layer has quantized it
(decoding spreads that over a few steps, kvarn_mlx/waiting_tiles.py, and the
layers whose turn has not come read the tile in full precision), and for the
"auto" presets those until every layer has chosen its key rotation (from its
first tile and the query after it: float rounding between step shapes can flip
a near tie there).
"""

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from ..cache import KVarNCache
from .decode import _greedy, _prefill_last
from .methods import make_caches, method_bits
from .runner import (
    Dequantized,
    Progress,
    append_checkpoint,
    for_model,
    kl,
    log_softmax,
    pyplot,
    read_checkpoint,
    reusable,
)

NAME = "longgen"
HELP = "long greedy generation: per-step KL on the plain cache's trajectory, first divergence"

QUESTIONS = (
    "A train leaves a station at 9:40 and travels 210 km at 84 km/h. Then it waits 25 minutes "
    "and travels another 150 km at 100 km/h. At what time does it arrive? Think step by step "
    "and check your work.",
    "Alice is older than Bob. Carol is younger than Bob but older than Dave. Erin is older than "
    "Alice. List the five people from oldest to youngest, explaining every step of your "
    "reasoning.",
    "Explain step by step how to find all prime numbers below 100 with the sieve of "
    "Eratosthenes, then list them and count them.",
    "A shop sells pencils at 3 for 2 dollars and notebooks at 5 dollars each. Sam buys 12 "
    "pencils and 4 notebooks and pays with a 50 dollar bill. How much change does he get? "
    "Reason carefully.",
    "Plan a week of study to learn the basics of Python programming. For each day, explain what "
    "to learn, why, and how to practice it, and justify the order.",
    "Why do we have seasons on Earth? Explain the reasoning in detail, correct two common "
    "misconceptions, and describe what would change if the Earth's axis were not tilted.",
    "Write a detailed proof that the square root of 2 is irrational, explaining each step, and "
    "then explain why the same argument fails for the square root of 4.",
    "You have 8 coins, one of which is heavier, and a balance scale. Explain, step by step, how "
    "to find the heavy coin in two weighings, and why one weighing is not enough.",
)
WINDOWS = (0, 256, 512, 1024, 2048, 4096)


def add_arguments(p):
    p.add_argument("--methods", default="k2v2_g128,k4v2_g128,k4v4_g128,k8v8_g128,mlxq4,mlxq8")
    p.add_argument("--steps", type=int, default=2048, help="generated tokens per prompt")
    p.add_argument(
        "--prompts", type=int, default=4, help=f"questions (the first N of {len(QUESTIONS)})"
    )
    p.add_argument("--chunk", type=int, default=2048, help="prompt tokens per prefill step")
    p.add_argument(
        "--checkpoint",
        default=None,
        help="jsonl of finished prompts: a run that stops resumes from it, and a run with the same "
        "settings and fewer methods reuses it (default: none)",
    )


def run(args, model, tokenizer, methods, meta_md):
    """(result for the json, markdown, plot drawer) of one CLI run."""
    if not 1 <= args.prompts <= len(QUESTIONS):
        raise ValueError(f"--prompts {args.prompts}: use 1 to {len(QUESTIONS)}")
    res = longgen(
        model,
        tokenizer,
        methods,
        args.steps,
        args.prompts,
        args.chunk,
        args.attention,
        args.checkpoint,
    )
    return res, markdown(res, meta_md), lambda folder: plots(res, folder)


class NoEOS:
    """The model with its end-of-sequence logits pushed far down (float32 and finite, so KL stays
    defined)."""

    def __init__(self, model, eos_ids):
        self.model, self.eos, self.drop = model, sorted(eos_ids), None

    def __call__(self, x, cache=None):
        logits = self.model(x, cache=cache).astype(mx.float32)
        if self.drop is None:
            drop = np.zeros(logits.shape[-1], np.float32)
            drop[self.eos] = -1e9
            self.drop = mx.array(drop)
        return logits + self.drop


def prompt_ids(tokenizer, question):
    if getattr(tokenizer, "has_chat_template", False):
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True
            )
        )
    return tokenizer.encode(question)


def longgen(
    model,
    tokenizer,
    methods,
    steps=2048,
    prompts=4,
    chunk=2048,
    attention_mode="dequant",
    checkpoint=None,
):
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)
    run_model = NoEOS(model, eos)
    settings = {"steps": steps, "chunk": chunk, "methods": methods, "attention": attention_mode}
    done = {}
    # A prompt finished with the same settings and at least these methods is reused.
    for row in read_checkpoint(checkpoint):
        if reusable(row["settings"], settings):
            done[row["question"]] = row
    res = {
        "steps": steps,
        "prompts": [],
        "chunk": chunk,
        "eos_masked": sorted(eos),
        "methods": {
            m: {"kl_per_prompt": [], "first_divergence": [], "agreement": []} for m in methods
        },
    }
    for j, question in enumerate(QUESTIONS[:prompts]):
        row = done.get(question) or _one_prompt(
            run_model, model, tokenizer, question, methods, steps, chunk, attention_mode, f"p{j}"
        )
        if checkpoint and question not in done:
            append_checkpoint(checkpoint, {"settings": settings, **row})
        res["prompts"].append(row["prompt"])
        for name in methods:
            r, m = res["methods"][name], row["methods"][name]
            r["kl_per_prompt"].append(np.array(m["kl"]))
            r["first_divergence"].append(m["first_divergence"])
            r["agreement"].append(m["agreement"])
    for r in res["methods"].values():
        r["kl"] = np.mean(r["kl_per_prompt"], axis=0)
        r["first_divergence_median"] = float(
            np.median([steps if d is None else d for d in r["first_divergence"]])
        )
    return res


def _one_prompt(
    run_model, model, tokenizer, question, methods, steps, chunk, attention_mode, label
):
    """The plain cache's trajectory for one question, then every method teacher-forced on it."""
    ids = prompt_ids(tokenizer, question)
    traj, ref_lp = _greedy(
        run_model, ids, mlx_cache.make_prompt_cache(model), steps, chunk, f"{label} fp"
    )
    row = {
        "question": question,
        "methods": {},
        "prompt": {
            "question": question,
            "prompt_tokens": len(ids),
            "fp_text_start": tokenizer.decode(traj[:200]),
            "fp_text_end": tokenizer.decode(traj[-100:]),
            "fp_distinct_tokens_last_512": len(set(traj[-512:])),
        },
    }
    for name in methods:
        caches = make_caches(model, name)
        ends = step_ends(caches, len(ids), steps - 1)
        kls, first_div, agree = forced_steps(
            run_model,
            ids,
            for_model(caches, attention_mode),
            ends,
            traj,
            ref_lp,
            chunk,
            f"{label} {name}",
        )
        row["methods"][name] = {
            "kl": kls,
            "first_divergence": first_div,
            "agreement": float(np.mean(agree)),
        }
    return row


def step_ends(caches, start, n, size=128):
    """Where the teacher-forced steps over cache positions [start, start + n) end: for a
    KVarN cache where a tile completes (sink + k tiles), so no query of a step comes after
    a tile the step completed, and the token before, so that the tile completes in a
    decoding step; for other caches every `size` tokens. forced_steps cuts them into
    one-token steps where decoding_alone says so."""
    kv = next((c for c in caches if isinstance(c, KVarNCache)), None)
    if kv is None:
        ends = range(start + size, start + n, size)
    else:
        S, G = kv.config.sink_size, kv.config.group_size
        tiles = (S + k * G for k in range(1, (start + n - S) // G + 1))
        ends = [e for t in tiles for e in (t - 1, t) if start < e < start + n]
    return [*ends, start + n] if n else []


def decoding_alone(caches):
    """Whether the next query needs a step of its own to read what it reads in one-token
    decoding: a KVarN cache holds a completed tile that decoding quantizes at one of the
    next steps (a few layers a step), or an "auto" cache has yet to choose its key
    rotation."""
    for c in caches:
        c = c.cache if isinstance(c, Dequantized) else c
        if isinstance(c, KVarNCache) and (c.leaving_tiles() or c.choosing_key_rotation):
            return True
    return False


def forced_steps(model, ids, caches, ends, traj, ref_lp, chunk, label):
    """Teacher-forced on traj in steps ending at cache positions `ends`, one token per step
    where decoding_alone says so: per step of the trajectory, the KL to ref_lp
    and whether the greedy token is the trajectory's; returns (KLs, first step that
    differs or None, agreements)."""
    P = len(ids)
    y = _prefill_last(model, ids, caches, chunk, label)
    kls, agree = [], []

    def score(i, logits):  # logits [n, V] predicting traj[i : i + n]
        lp = log_softmax(logits)
        ref = mx.stack(ref_lp[i : i + lp.shape[0]])
        k = kl(ref, lp)
        same = mx.argmax(lp, axis=-1) == mx.array(traj[i : i + lp.shape[0]])
        mx.eval(k, same)
        kls.extend(np.maximum(np.array(k), 0.0).tolist())
        agree.extend(np.array(same).tolist())

    score(0, y[None])
    a = P
    bar = Progress(ends[-1] - a if ends else 0, f"{label} forced")
    for e in ends:
        while a < e:
            b = a + 1 if decoding_alone(caches) else e
            score(a - P + 1, model(mx.array(traj[a - P : b - P])[None], cache=caches)[0])
            bar.step(b - a)
            a = b
    first_div = next((i for i, ok in enumerate(agree) if not ok), None)
    return kls, first_div, agree


def windows(steps):
    edges = [w for w in WINDOWS if w < steps] + [steps]
    return list(zip(edges[:-1], edges[1:]))


def markdown(res, meta_md):
    steps, P = res["steps"], len(res["prompts"])
    wins = windows(steps)
    out = [
        f"# Long generation ({steps} greedy tokens per prompt)\n",
        meta_md,
        f"\n{P} reasoning-style questions through the chat template (prompt tokens: "
        f"{', '.join(str(p['prompt_tokens']) for p in res['prompts'])}); the plain cache "
        f"generates {steps} tokens greedily, end-of-sequence masked out (for every cache alike) "
        "so each answer runs the whole length. Each method reads the same tokens "
        "(teacher-forced): KL to the plain cache per step, averaged over prompts; top-1 "
        "agreement = share of steps whose greedy token equals the plain cache's; first "
        "divergence = the first step whose greedy token differs (the method's free-running "
        "output equals the plain cache's up to it; 'none' = never within the steps). With sink "
        "128 and 128-token tiles, generated tokens are quantized once the tail fills.\n",
        "| method | K/V bits | first divergence per prompt | median | top-1 agreement | KL mean "
        "| KL p99 | " + " | ".join(f"KL steps {a}-{b}" for a, b in wins) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(wins),
    ]
    for name, r in res["methods"].items():
        kls = np.asarray(r["kl"])
        fd = ", ".join("none" if d is None else str(d) for d in r["first_divergence"])
        out.append(
            f"| {name} | {method_bits(name)} | {fd} | {r['first_divergence_median']:.0f} | "
            f"{np.mean(r['agreement']):.3f} | {kls.mean():.4f} | {np.percentile(kls, 99):.3f} | "
            + " | ".join(f"{kls[a:b].mean():.4f}" for a, b in wins)
            + " |"
        )
    out.append(
        "\nThe plain cache's answers (first 200 and last 100 tokens; distinct tokens among the "
        "last 512 show whether it loops):\n"
    )
    for p in res["prompts"]:
        start = p["fp_text_start"].replace("\n", " ")
        end = p["fp_text_end"].replace("\n", " ")
        out.append(
            f"- **{p['question']}**  \n  start: {start!r}  \n  end: {end!r}  \n"
            f"  distinct tokens in the last 512: {p['fp_distinct_tokens_last_512']}"
        )
    return "\n".join(out) + "\n"


def plots(res, outdir, smooth=64):
    plt = pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(8, 4.8))
    k = np.ones(smooth) / smooth
    for name, r in res["methods"].items():
        y = np.convolve(r["kl"], k, mode="valid")
        ax.plot(
            smooth // 2 + np.arange(len(y)),
            np.maximum(y, 1e-7),
            label=f"{name} (agreement {np.mean(r['agreement']):.2f}, first divergence median "
            f"{r['first_divergence_median']:.0f})",
        )
    ax.set(
        xlabel="generated token",
        ylabel=f"KL to the plain cache (nats, {smooth}-step mean)",
        yscale="log",
        title="long generation, teacher-forced on the plain cache's tokens "
        f"({len(res['prompts'])} prompts)",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    f = outdir / "longgen_kl.png"
    fig.savefig(f, dpi=110)
    plt.close(fig)
    return [f]
