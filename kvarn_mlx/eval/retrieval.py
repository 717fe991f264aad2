"""Retrieval at long context: passkey and multi-key needle-in-a-haystack.

A haystack of prose sentences (CPython's pydoc topics, no digits) with a needle
at a depth of 0-100% of it; the model answers greedily after the question, with
the answer's first words already given ("The secret number is"), and a trial
is right when the first number it writes is the key. Every method answers the
same prompts (seeded per task, length, depth and trial).

  passkey   one needle: "The secret number is 48213." (said twice)
  multikey  needles for several colors ("The secret number for red is 48213.");
            the question asks for one color, whose needle sits at the depth; the
            others sit at random depths

Prompts run as mlx-lm's generate_step runs them: the prompt but its last token
in chunks of --prefill-step-size (2048, mlx-lm's default), the last token, then
the answer one token at a time. A KVarN cache attends to its own chunk in full
precision, so with --attention dequant (mlx-lm's attention over the tokens it
holds) its first chunk computes exactly what the plain cache's does: its cache
is built from the plain run's keys and values of that chunk, bit for bit what
running the model would give, with far less compute. mlx-lm's QuantizedKVCache
attends to its own chunk quantized and runs the whole prompt.
"""

import json
import math
import random
import re
from functools import lru_cache

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ..cache import KVarNCache
from .methods import make_caches, method_bits
from .runner import (
    Progress,
    append_checkpoint,
    for_model,
    needs_queries,
    pyplot,
    read_checkpoint,
    reusable,
)

NAME = "retrieval"
HELP = "passkey / multi-key needle retrieval: accuracy by needle depth and context length"

TASKS = ("passkey", "multikey")
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black")
INTRO = {
    "passkey": "Below is some text. Somewhere in it is a secret number. "
    "Remember the secret number.\n\n",
    "multikey": "Below is some text. Somewhere in it are secret numbers for {n} colors. "
    "Remember them.\n\n",
}


def add_arguments(p):
    p.add_argument(
        "--methods",
        default="mlxq4,mlxq8,k2v2_g128,k4v2_g128,k4v4_g128,k8v8_g128,auto4v2",
        help="methods compared with the plain cache (always run, as the reference)",
    )
    p.add_argument("--tasks", default="passkey,multikey")
    p.add_argument(
        "--lengths", default="2048,4096,8192", help="prompt tokens (the context the answer reads)"
    )
    p.add_argument(
        "--depths", default="0,0.25,0.5,0.75,1", help="needle depths, fractions of the haystack"
    )
    p.add_argument("--trials", type=int, default=4, help="prompts per (task, length, depth)")
    p.add_argument("--keys", type=int, default=4, help="needles in a multikey prompt")
    p.add_argument("--digits", type=int, default=5, help="digits of a secret number")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument(
        "--checkpoint",
        default=None,
        help="jsonl of finished prompts: a run that stops resumes from it, and a run with more "
        "lengths, depths or trials, or fewer methods (same other settings), reuses it (default: "
        "none)",
    )


def run(args, model, tokenizer, methods, meta_md):
    """(result for the json, markdown, plot drawer) of one CLI run."""
    tasks = [t for t in args.tasks.split(",") if t]
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}: use {', '.join(TASKS)}")
    res = retrieval(
        model,
        tokenizer,
        methods,
        tasks,
        [int(x) for x in args.lengths.split(",")],
        [float(x) for x in args.depths.split(",")],
        args.trials,
        keys=args.keys,
        digits=args.digits,
        seed=args.seed,
        prefill_step_size=args.prefill_step_size,
        answer_tokens=args.answer_tokens,
        attention_mode=args.attention,
        checkpoint=args.checkpoint,
    )
    return res, markdown(res, meta_md), lambda folder: plots(res, folder)


# -- prompts ------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def sentences():
    """Prose sentences of CPython's pydoc topics: letters and punctuation only (no digits)."""
    from pydoc_data.topics import topics

    text = " ".join(" ".join(topics[k] for k in sorted(topics)).split())
    return [
        s
        for s in re.split(r"(?<=[.!?])\s+", text)
        if 30 < len(s) < 300 and s[0].isupper() and re.fullmatch(r"[A-Za-z ,.;:'()\-]+[.!?]", s)
    ]


def _encode(tokenizer, user, answer_start):
    if getattr(tokenizer, "has_chat_template", False):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True
        )
        return list(ids) + tokenizer.encode(answer_start, add_special_tokens=False)
    return tokenizer.encode(user + "\n\n" + answer_start)


def make_prompt(tokenizer, task, length, depth, rng, keys=4, digits=5):
    """(token ids, the secret number, where its needle starts in tokens) of one prompt of about
    `length` tokens."""
    number = lambda: str(rng.randrange(10 ** (digits - 1), 10**digits))  # noqa: E731
    if task == "passkey":
        secret = number()
        needles = [(depth, f"The secret number is {secret}. The secret number is {secret}.")]
        intro, question, start = INTRO[task], "What is the secret number?", "The secret number is"
    else:
        colors = rng.sample(COLORS, keys)
        values = [number() for _ in colors]
        secret, asked = values[0], colors[0]
        needles = [(depth, f"The secret number for {asked} is {secret}.")]
        needles += [
            (rng.random(), f"The secret number for {c} is {v}.")
            for c, v in zip(colors[1:], values[1:])
        ]
        intro = INTRO[task].format(n=keys)
        question, start = (
            f"What is the secret number for {asked}?",
            f"The secret number for {asked} is",
        )
    frame = len(
        _encode(tokenizer, intro + " ".join(n for _, n in needles) + "\n\n" + question, start)
    )
    hay, n = [], 0
    pool = sentences()
    while True:
        s = rng.choice(pool)
        t = len(tokenizer.encode(" " + s, add_special_tokens=False))
        if frame + n + t > length:
            break
        hay.append(s)
        n += t
    # Needles go between sentences, the deepest last; ties keep the asked needle first.
    cuts = sorted(((round(d * len(hay)), i, text) for i, (d, text) in enumerate(needles)))
    parts, prev = [], 0
    for cut, _, text in cuts:
        parts += hay[prev:cut] + [text]
        prev = cut
    parts += hay[prev:]
    body = " ".join(parts)
    ids = _encode(tokenizer, intro + body + "\n\n" + question, start)
    asked = needles[0][1]
    where = len(_encode(tokenizer, intro + body[: body.index(asked)], ""))
    return ids, secret, where


def first_number(text):
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


# -- answering -------------------------------------------------------------------------------


def chunks(n_prompt, step):
    """mlx-lm's generate_step: the prompt but its last token in chunks of `step`, then the last
    token."""
    out, done = [], 0
    while n_prompt - done > 1:
        k = min(step, n_prompt - done - 1)
        out.append((done, done + k))
        done += k
    return out + [(done, n_prompt)]


def first_chunk_kv(caches):
    """Per layer, the keys and values a plain cache took in (every layer a KVCache), or None."""
    if not all(type(c) is KVCache for c in caches):
        return None
    return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]


def replayable(caches):
    """Whether a method's first chunk can be built from the plain cache's keys and values:
    every layer a KVarNCache, which attends to its own chunk in full precision, and none
    "auto" (its key-rotation choice reads the chunk's queries, which a replay does not have)."""
    return all(isinstance(c, KVarNCache) and not needs_queries(c) for c in caches)


def answer(model, ids, caches, step, n_answer, first_kv=None, on_first_chunk=None):
    """Greedy answer tokens for prompt ids with these caches, chunked as mlx-lm's generate_step.
    first_kv: the first chunk's keys and values per layer, fed to the caches instead of running
    it."""
    x = mx.array(ids)[None]
    parts = chunks(len(ids), step)
    for i, (a, b) in enumerate(parts):
        if i == 0 and first_kv is not None and b - a == first_kv[0][0].shape[2] and len(parts) > 1:
            for c, (k, v) in zip(caches, first_kv):
                c.update_and_fetch(k, v)
            mx.eval([c.state for c in caches])
            continue
        y = model(x[:, a:b], cache=caches)[0, -1]
        if i < len(parts) - 1:
            mx.eval([c.state for c in caches])
        if i == 0 and on_first_chunk is not None:
            on_first_chunk()
    out = []
    for _ in range(n_answer):
        t = mx.argmax(y)
        out.append(int(t.item()))
        y = model(t.reshape(1, 1), cache=caches)[0, -1]
    return out


def _key(task, L, depth, trial):
    return f"{task}|{L}|{depth}|{trial}"


def retrieval(
    model,
    tokenizer,
    methods,
    tasks,
    lengths,
    depths,
    trials,
    keys=4,
    digits=5,
    seed=0,
    prefill_step_size=2048,
    answer_tokens=8,
    attention_mode="dequant",
    checkpoint=None,
):
    methods = ["fp"] + [m for m in methods if m != "fp"]
    settings = dict(
        tasks=tasks,
        lengths=lengths,
        depths=depths,
        trials=trials,
        keys=keys,
        digits=digits,
        seed=seed,
        prefill_step_size=prefill_step_size,
        answer_tokens=answer_tokens,
        methods=methods,
        attention=attention_mode,
    )
    # A record depends on these settings and on its own task, length, depth and trial, so a
    # checkpoint serves any run that shares them (more lengths, depths or trials, or fewer methods).
    shared = {
        k: settings[k]
        for k in (
            "keys",
            "digits",
            "seed",
            "prefill_step_size",
            "answer_tokens",
            "methods",
            "attention",
        )
    }
    done = _load_checkpoint(checkpoint, shared)
    jobs = [(t, L, d, j) for t in tasks for L in lengths for d in depths for j in range(trials)]
    bar = Progress(len(jobs), "retrieval")
    for task, L, depth, j in jobs:
        key = _key(task, L, depth, j)
        if key in done:
            bar.step()
            continue
        rng = random.Random(f"{seed}|{key}")
        ids, secret, where = make_prompt(tokenizer, task, L, depth, rng, keys, digits)
        rec = {
            "task": task,
            "length": L,
            "depth": depth,
            "trial": j,
            "tokens": len(ids),
            "needle_at": where,
            "secret": secret,
            "answers": {},
        }
        first_kv = []
        for name in methods:
            caches = make_caches(model, name)
            # Exact in dequant mode only: there the first chunk attends with mlx-lm's own attention,
            # as the plain cache does (packed attention may round differently and decides
            # "auto" key rotations with the chunk's queries).
            exact = (
                attention_mode == "dequant"
                and first_kv
                and first_kv[0] is not None
                and replayable(caches)
            )
            replay = first_kv[0] if exact else None
            grab = (
                (lambda caches=caches: first_kv.append(first_chunk_kv(caches)))
                if name == "fp"
                else None
            )
            out = answer(
                model,
                ids,
                for_model(caches, attention_mode),
                prefill_step_size,
                answer_tokens,
                replay,
                grab,
            )
            text = tokenizer.decode(out)
            rec["answers"][name] = {"text": text, "right": first_number(text) == secret}
        done[key] = rec
        if checkpoint:
            append_checkpoint(checkpoint, {"settings": shared, "record": rec})
        bar.step()
    records = [done[_key(*job)] for job in jobs]
    return {
        **settings,
        "records": records,
        "summary": summarize(records, methods, tasks, lengths, depths),
    }


def _load_checkpoint(path, shared):
    """Records made with the same settings and at least these methods (answers of the others
    dropped)."""
    done = {}
    want = json.loads(json.dumps(shared))
    for row in read_checkpoint(path):
        if reusable(row["settings"], want):
            r = dict(row["record"])
            r["answers"] = {m: r["answers"][m] for m in want["methods"]}
            done[_key(r["task"], r["length"], r["depth"], r["trial"])] = r
    return done


# -- statistics --------------------------------------------------------------------------------


def wilson(k, n, z=1.96):
    """The 95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # All right (or all wrong) bounds the interval at exactly 1 (0); rounding may miss it by an ulp.
    return (0.0 if k == 0 else max(0.0, centre - half), 1.0 if k == n else min(1.0, centre + half))


def summarize(records, methods, tasks, lengths, depths):
    """Per task and method: right / trials overall, per length and per (depth, length) cell,
    the Wilson interval, and the prompts it got wrong that the plain cache got right (and back)."""
    out = {}
    for task in tasks:
        rows = [r for r in records if r["task"] == task]
        out[task] = {}
        for m in methods:
            right = [r["answers"][m]["right"] for r in rows]
            k, n = sum(right), len(right)
            cells = {
                f"{d}|{L}": [
                    sum(
                        r["answers"][m]["right"]
                        for r in rows
                        if r["depth"] == d and r["length"] == L
                    ),
                    sum(1 for r in rows if r["depth"] == d and r["length"] == L),
                ]
                for d in depths
                for L in lengths
            }
            per_length = {
                str(L): [
                    sum(r["answers"][m]["right"] for r in rows if r["length"] == L),
                    sum(1 for r in rows if r["length"] == L),
                ]
                for L in lengths
            }
            lost = sum(r["answers"]["fp"]["right"] and not r["answers"][m]["right"] for r in rows)
            gained = sum(r["answers"][m]["right"] and not r["answers"]["fp"]["right"] for r in rows)
            out[task][m] = {
                "right": k,
                "trials": n,
                "accuracy": k / n if n else float("nan"),
                "wilson95": wilson(k, n),
                "per_length": per_length,
                "cells": cells,
                "lost_vs_fp": lost,
                "gained_vs_fp": gained,
            }
        fp_low, fp_high = out[task]["fp"]["wilson95"]
        for m in methods:
            out[task][m]["within_fp_interval"] = fp_low <= out[task][m]["accuracy"] <= fp_high
    return out


# -- output ------------------------------------------------------------------------------------


def markdown(res, meta_md):
    lengths, s = res["lengths"], res["summary"]
    mean_tokens = {
        L: np.mean([r["tokens"] for r in res["records"] if r["length"] == L]) for L in lengths
    }
    out = [
        "# Retrieval (passkey, multi-key needle in a haystack)\n",
        meta_md,
        f"\nPrompts of about {', '.join(str(L) for L in lengths)} tokens (mean "
        f"{', '.join(f'{mean_tokens[L]:.0f}' for L in lengths)}), needle depths "
        f"{', '.join(f'{d:.0%}' for d in res['depths'])} of the haystack, {res['trials']} "
        f"prompts per (task, length, depth), seed {res['seed']}; the same prompts for every "
        f"method. Secret numbers of {res['digits']} digits; multikey: {res['keys']} needles, one "
        f"asked. Greedy answer of {res['answer_tokens']} tokens after the primed answer start; "
        "right = its first number is the secret. Prefill in chunks of "
        f"{res['prefill_step_size']} as mlx-lm's generate_step. Interval: 95% Wilson. 'lost' = "
        "prompts the plain cache (fp) answered right and the method did not; 'gained' = the "
        "reverse.\n",
    ]
    for task in res["tasks"]:
        out += [
            f"\n## {task}\n",
            "| method | K/V bits | right / trials | accuracy | 95% interval | "
            + " | ".join(f"{L} tokens" for L in lengths)
            + " | lost | gained | within fp's interval |",
            "|---|---|---|---|---|" + "---|" * len(lengths) + "---|---|---|",
        ]
        for m, r in s[task].items():
            lo, hi = r["wilson95"]
            per = " | ".join(f"{k}/{n}" for k, n in (r["per_length"][str(L)] for L in lengths))
            out.append(
                f"| {m} | {method_bits(m)} | {r['right']}/{r['trials']} | {r['accuracy']:.3f} | "
                f"[{lo:.3f}, {hi:.3f}] | {per} | {r['lost_vs_fp']} | {r['gained_vs_fp']} | "
                f"{'yes' if r['within_fp_interval'] else 'NO'} |"
            )
    methods = list(next(iter(s.values())))
    wrong = [r for r in res["records"] if not all(a["right"] for a in r["answers"].values())]
    if wrong:
        out += [
            f"\nPrompts some method got wrong ({len(wrong)} of {len(res['records'])}; the first "
            "60), each method's answer where it was wrong:\n",
            "| task | length | depth | trial | secret | " + " | ".join(methods) + " |",
            "|---|---|---|---|---|" + "---|" * len(methods),
        ]
        for r in wrong[:60]:
            cells = [
                "right"
                if r["answers"][m]["right"]
                else "`"
                + r["answers"][m]["text"].replace("|", "\\|").replace("\n", " ").strip()
                + "`"
                for m in methods
            ]
            out.append(
                f"| {r['task']} | {r['length']} | {r['depth']:.0%} | {r['trial']} | {r['secret']} "
                "| " + " | ".join(cells) + " |"
            )
    return "\n".join(out) + "\n"


def plots(res, outdir):
    """A depth-by-length accuracy heat map per method, one figure per task."""
    plt = pyplot()
    if plt is None:
        return []
    files = []
    lengths, depths = res["lengths"], res["depths"]
    for task in res["tasks"]:
        methods = list(res["summary"][task])
        cols = min(4, len(methods))
        rows = math.ceil(len(methods) / cols)
        fig, axes = plt.subplots(
            rows,
            cols,
            figsize=(
                2.2 + max(1.6, 1.1 * len(lengths)) * cols,
                1.2 + max(1.8, 0.45 * len(depths)) * rows,
            ),
            squeeze=False,
        )
        for ax in axes.flat[len(methods) :]:
            ax.axis("off")
        for pos, (ax, m) in enumerate(zip(axes.flat, methods)):
            cells = res["summary"][task][m]["cells"]
            acc = np.array(
                [
                    [cells[f"{d}|{L}"][0] / max(cells[f"{d}|{L}"][1], 1) for L in lengths]
                    for d in depths
                ]
            )
            im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for i, d in enumerate(depths):
                for j, L in enumerate(lengths):
                    k, n = cells[f"{d}|{L}"]
                    ax.text(j, i, f"{k}/{n}", ha="center", va="center", fontsize=7)
            r = res["summary"][task][m]
            ax.set_title(f"{m}: {r['right']}/{r['trials']}", fontsize=9)
            ax.set_xticks(
                range(len(lengths)),
                [f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths],
                fontsize=7,
            )
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
            if pos + cols >= len(methods):  # the bottom panel of its column
                ax.set_xlabel("context (tokens)", fontsize=7)
            if pos % cols == 0:
                ax.set_ylabel("needle depth", fontsize=7)
        fig.colorbar(im, ax=axes, shrink=0.6, label="accuracy")
        fig.suptitle(
            f"{task} retrieval: right / trials per needle depth and context length", fontsize=10
        )
        f = outdir / f"retrieval_{task}.png"
        fig.savefig(f, dpi=110, bbox_inches="tight")
        plt.close(fig)
        files.append(f)
    return files
