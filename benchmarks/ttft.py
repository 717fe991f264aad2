"""Time to first token and decode speed against context, for the plain cache,
mlx-lm's 4- and 8-bit QuantizedKVCache and the KVarN presets, in one run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/ttft.py --contexts 2048,4096,8192
    python benchmarks/ttft.py --quick --out /tmp/ttft     # tiny contexts (CI)

Every method runs mlx-lm's own generate_step (what `kvarn_mlx.generate` and
mlx-lm's CLI run): the prompt is prefilled in --chunk-token steps with the
cache evaluated after each, then greedy decoding. Time to first token (TTFT)
is from the call until the first token is out; decode step i is the time
between tokens i and i+1, so steps 1-3 show any one-time cost a prefill
leaves behind. Decode tokens/s is from the median of the steps after the
third. mlx-lm's quantized caches run the way its CLI makes them (kv_bits,
group 64, quantized from the first prefill step on). The prompt is the start
of CPython's pydoc_data/topics.py. Methods run one after another for each
context, alternating the order between repeats; ratios are against the plain
cache at the same context in the same run.

--separate runs each method (and context) in a process of its own, so the
process's peak memory (ru_maxrss: model weights, the prefill's transient
buffers and the cache, everything) is that method's alone:

    python benchmarks/ttft.py --model embedded:gemma-3-270m --contexts 32512 \\
        --steps 255 --separate --tag gemma
"""

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvarn_mlx import PRESETS, make_cache, memory  # noqa: E402
from kvarn_mlx.eval.runner import meta_markdown, metadata, pyplot, tokens  # noqa: E402

PLAIN = "plain"
MLX_QUANTIZED = {"mlxq4": 4, "mlxq8": 8}
# The presets of the default run: the paper's widths, 8 bits, the small tile and the
# "auto" ones (the default preset among them); --methods all runs every preset.
KVARN = ("k2v2_g128", "k4v2_g128", "k4v4_g128", "k8v8_g128", "k4v2_g64", "auto2", "auto4v2")
QUICK = dict(contexts="160,400", chunk=128, steps=5)


def methods_default():
    return [PLAIN, *MLX_QUANTIZED, *(m for m in KVARN if m in PRESETS)]


def methods_all():
    return [PLAIN, *MLX_QUANTIZED, *PRESETS]


def run_one(model, ids, method, chunk, steps):
    """One generation: TTFT, the seconds between consecutive tokens, peak memory and cache bytes."""
    if method == PLAIN:
        cache, kw = mlx_cache.make_prompt_cache(model), {}
    elif method in MLX_QUANTIZED:
        cache = mlx_cache.make_prompt_cache(model)
        kw = dict(kv_bits=MLX_QUANTIZED[method], kv_group_size=64, quantized_kv_start=0)
    else:
        cache, kw = make_cache(model, method), {}
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    prefill_done = []
    c0, t0 = time.process_time(), time.perf_counter()
    gen = generate_step(
        mx.array(ids),
        model,
        prompt_cache=cache,
        max_tokens=steps + 1,
        prefill_step_size=chunk,
        sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
        prompt_progress_callback=lambda done, total: prefill_done.append(time.perf_counter()),
        **kw,
    )
    out, cpu_ttft = [], None
    for token, _ in gen:
        out.append((time.perf_counter(), int(token)))
        if cpu_ttft is None:
            cpu_ttft = time.process_time() - c0
    times = [t for t, _ in out]
    steady = mx.get_active_memory()  # weights + the cache, transients released
    return {
        "steady_memory": steady,
        "process_rss_after": rss_now(),
        "ttft_s": times[0] - t0,
        "ttft_cpu_s": cpu_ttft,
        "decode_step_s": list(np.diff(times)),
        "tokens": [tok for _, tok in out],
        "peak_memory": mx.get_peak_memory(),
        "cache_bytes": memory.cache_bytes(cache)["held"],
    }


def warm_up(model, ids, methods, chunk):
    """A short generation per method before anything is timed: the model's weights
    load lazily on first use, which would otherwise land in the first method's TTFT."""
    for m in methods:
        run_one(model, ids[: min(len(ids), 2 * 128 + 40)], m, chunk, 2)


def rss_now():
    """This process's resident memory now in bytes (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def rss_peak():
    """This process's peak resident memory in bytes (ru_maxrss: bytes on macOS, KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else 1024 * peak


def run_separate(a, method, context):
    """run_one in a fresh process (this script with --worker) for a process peak of its own."""
    argv = [
        sys.executable,
        __file__,
        "--worker",
        "--methods",
        method,
        "--contexts",
        str(context),
        "--chunk",
        str(a.chunk),
        "--steps",
        str(a.steps),
        "--text",
        a.text,
    ]
    if a.model:
        argv += ["--model", a.model]
    res = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def worker(a, model, tok):
    """One method at one context in this process; its run as JSON on stdout."""
    (ctx,), (method,) = [int(c) for c in a.contexts.split(",")], a.methods.split(",")
    ids = tokens(tok, a.text, ctx)
    warm_up(model, ids, [method], a.chunk)
    loaded = rss_peak()
    r = run_one(model, ids, method, a.chunk, a.steps)
    r.update(process_peak=rss_peak(), process_peak_before_run=loaded)
    print(json.dumps(r, default=float))
    return 0


def summarize(method, context, runs):
    """Medians over repeats (steps elementwise)."""
    steps = np.median(np.array([r["decode_step_s"] for r in runs]), axis=0)
    later = steps[3:] if len(steps) > 3 else steps
    peaks = {
        k: max(r[k] for r in runs)
        for k in ("process_peak", "process_peak_before_run")
        if k in runs[0]
    }
    return {
        **peaks,
        "context": context,
        "method": method,
        "repeats": len(runs),
        "ttft_s": float(np.median([r["ttft_s"] for r in runs])),
        "ttft_all_s": [r["ttft_s"] for r in runs],
        "ttft_cpu_s": float(np.median([r["ttft_cpu_s"] for r in runs])),
        "first_steps_s": [float(s) for s in steps[:3]],
        "decode_step_s": [float(s) for s in steps],
        "decode_tokens_per_s": float(1 / np.median(later)),
        "peak_memory": max(r["peak_memory"] for r in runs),
        "steady_memory": runs[-1].get("steady_memory"),
        "process_rss_after": runs[-1].get("process_rss_after"),
        "cache_bytes": runs[-1]["cache_bytes"],
        "tokens": runs[-1]["tokens"],
    }


def add_ratios(rows):
    for r in rows:
        base = next(
            (b for b in rows if b["context"] == r["context"] and b["method"] == PLAIN), None
        )
        if base is None:
            continue
        r["ttft_vs_plain"] = r["ttft_s"] / base["ttft_s"]
        r["ttft_cpu_vs_plain"] = r["ttft_cpu_s"] / base["ttft_cpu_s"]
        r["first_step_vs_plain"] = r["first_steps_s"][0] / base["first_steps_s"][0]
        r["decode_speed_vs_plain"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        r["peak_vs_plain"] = r["peak_memory"] / base["peak_memory"]
        if "process_peak" in r:
            r["process_peak_vs_plain"] = r["process_peak"] / base["process_peak"]


def render(data):
    meta = data["meta"]
    md = [
        "# Time to first token and decode speed against context\n",
        meta_markdown(meta),
        f"Load average (1/5/15 min) at the start: {data['load_start']}, at the end: "
        f"{data['load_end']}.\n",
        f"\nmlx-lm's generate_step for every method: prefill in {data['chunk']}-token steps, then "
        "greedy decoding, after one short warm-up generation per method (weights load lazily). "
        "TTFT = time to first token (the whole prefill); TTFT CPU = the process's CPU time until "
        "then (all its threads: less sensitive than wall time to other processes sharing the "
        "machine); step 1-3 = seconds between tokens 1-2, 2-3, 3-4 (a one-time cost left by the "
        f"prefill shows there); decode tok/s from the median of steps 4-{data['steps']}. Ratios "
        "are against the plain cache at the same context, same run (TTFT and step 1: time "
        "ratios, > 1 is slower; decode: speed ratio, > 1 is faster). Peak = mx.get_peak_memory "
        "over the generation (whole process, model weights included). Cache = bytes of the "
        "arrays the cache holds after the run. plain = mlx-lm KVCache in the model's dtype; "
        "mlxqB = mlx-lm QuantizedKVCache (B bits, group 64, quantized from the first prefill "
        f"step on, as `--kv-bits B --quantized-kv-start 0`). Medians over {data['repeats']} "
        "repeat(s).\n",
    ]
    if meta["machine"]["device"].startswith("Device(cpu"):
        md.append(
            "**CPU**: float32 matmul runs on OpenBLAS here while MLX's CPU quantized matmul is "
            "slow; these ratios do not predict Apple-silicon speed.\n"
        )
    if data.get("separate"):
        md.append(
            "Each method ran in a process of its own (--separate): process peak = that process's "
            "ru_maxrss (resident memory: Python, MLX, model weights, prefill buffers and cache, "
            "all of it), loaded = ru_maxrss after loading the model and tokenizing, before the "
            "generation. Steady = after the last decode step with the cache alive: MLX's active "
            "memory (weights + cache) and the process's resident memory (RSS; MLX keeps freed "
            "buffers for reuse, so it stays near the peak).\n"
        )
        md += [
            "| context | method | process peak MiB | vs plain | loaded MiB | peak - loaded MiB | "
            "MLX peak MiB | MLX peak vs plain | steady MLX MiB | steady RSS MiB | cache MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in data["rows"]:
            md.append(
                f"| {r['context']} | {r['method']} | {r['process_peak'] / 2**20:.0f} | "
                f"{r.get('process_peak_vs_plain', float('nan')):.2f}x | "
                f"{r['process_peak_before_run'] / 2**20:.0f} | "
                f"{(r['process_peak'] - r['process_peak_before_run']) / 2**20:.0f} | "
                f"{r['peak_memory'] / 2**20:.0f} | {r.get('peak_vs_plain', float('nan')):.2f}x | "
                f"{mib(r.get('steady_memory'))} | {mib(r.get('process_rss_after'))} | "
                f"{r['cache_bytes'] / 2**20:.1f} |"
            )
        md.append("")
    md += [
        "| context | method | TTFT s | TTFT vs plain | TTFT CPU s | CPU vs plain | step 1 ms | "
        "step 2 ms | step 3 ms | step 1 vs plain | decode tok/s | decode vs plain | peak MiB | "
        "cache MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        s = r["first_steps_s"] + [float("nan")] * (3 - len(r["first_steps_s"]))
        md.append(
            f"| {r['context']} | {r['method']} | {r['ttft_s']:.2f} | "
            f"{r.get('ttft_vs_plain', float('nan')):.2f}x | {r['ttft_cpu_s']:.2f} | "
            f"{r.get('ttft_cpu_vs_plain', float('nan')):.2f}x | {1e3 * s[0]:.0f} | "
            f"{1e3 * s[1]:.0f} | {1e3 * s[2]:.0f} | "
            f"{r.get('first_step_vs_plain', float('nan')):.2f}x | {r['decode_tokens_per_s']:.2f} | "
            f"{r.get('decode_speed_vs_plain', float('nan')):.2f}x | {r['peak_memory'] / 2**20:.0f} "
            f"| {r['cache_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(md) + "\n"


def mib(x):
    return "-" if x is None else f"{x / 2**20:.0f}"


def draw(rows, methods, path):
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for m in methods:
        rr = [r for r in rows if r["method"] == m]
        ctx = [r["context"] for r in rr]
        style = "o-" if m == PLAIN else ("s--" if m in MLX_QUANTIZED else "^-")
        axes[0].plot(ctx, [r["ttft_s"] for r in rr], style, label=m)
        axes[1].plot(ctx, [1e3 * r["first_steps_s"][0] for r in rr], style, label=m)
        axes[2].plot(ctx, [r["decode_tokens_per_s"] for r in rr], style, label=m)
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="prompt tokens",
        ylabel="seconds",
        title="time to first token",
    )
    axes[1].set(
        xscale="log", yscale="log", xlabel="prompt tokens", ylabel="ms", title="first decode step"
    )
    axes[2].set(
        xscale="log", yscale="log", xlabel="prompt tokens", ylabel="tokens/s", title="decode speed"
    )
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def load_average():
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return None


def write(a, meta, load_start, contexts, methods, runs):
    """The results so far as <out>/ttft[_tag].md, .json and .png; returns the markdown."""
    rows = [summarize(m, ctx, runs[(ctx, m)]) for ctx in contexts for m in methods]
    add_ratios(rows)
    data = {
        "meta": meta,
        "load_start": load_start,
        "load_end": load_average(),
        "chunk": a.chunk,
        "steps": a.steps,
        "repeats": a.repeats,
        "separate": a.separate,
        "rows": rows,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "ttft" + (f"_{a.tag}" if a.tag else "")
    text = render(data)
    if draw(rows, methods, out / f"{stem}.png"):
        data["plots"] = [f"{stem}.png"]
        text += f"\n![{stem}.png]({stem}.png)\n"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=None,
        help="a model kvarn_mlx.loader.load accepts (default: the embedded one)",
    )
    p.add_argument("--contexts", default="2048,4096,8192", help="prompt lengths in tokens")
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated, or 'all' for every preset (default: {','.join(methods_default())})",
    )
    p.add_argument("--chunk", type=int, default=2048, help="prefill step size in tokens")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed after the first token")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--quick", action="store_true", help=f"tiny run for CI: {QUICK}")
    p.add_argument("--text", default="topics")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="suffix for the output files (ttft_<tag>.md)")
    p.add_argument(
        "--separate",
        action="store_true",
        help="each method and context in a process of its own, with its process peak memory",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    methods = (
        methods_all()
        if a.methods == "all"
        else a.methods.split(",")
        if a.methods
        else methods_default()
    )
    if PLAIN not in methods:
        methods.insert(0, PLAIN)
    for m in methods:
        if m not in methods_all():
            p.error(f"unknown method {m!r}; use any of {','.join(methods_all())}")
    contexts = [int(c) for c in a.contexts.split(",")]
    if a.steps < 1 or a.chunk < 1 or min(contexts) < 2:
        p.error("--steps and --chunk must be >= 1 and every context >= 2")

    from kvarn_mlx.loader import load

    if a.separate:
        model = tok = None
    else:
        model, tok = load(a.model)
    if a.worker:
        return worker(a, model, tok)
    name = a.model or "SmolLM2-135M-Instruct (embedded, float32)"
    command = "python benchmarks/ttft.py " + " ".join(argv if argv is not None else sys.argv[1:])
    load_start = load_average()
    ids_all = None if a.separate else tokens(tok, a.text, max(contexts))
    meta = metadata(name, command)
    if not a.separate:
        warm_up(model, ids_all, methods, a.chunk)
    runs = {}
    for i, ctx in enumerate(contexts):
        for rep in range(a.repeats):
            order = methods if rep % 2 == 0 else methods[::-1]
            for m in order:
                r = (
                    run_separate(a, m, ctx)
                    if a.separate
                    else run_one(model, ids_all[:ctx], m, a.chunk, a.steps)
                )
                runs.setdefault((ctx, m), []).append(r)
                print(
                    f"{ctx:>6} {m:<12} TTFT {r['ttft_s']:8.2f}s  steps 1-3 ms "
                    f"{[round(1e3 * s) for s in r['decode_step_s'][:3]]}",
                    file=sys.stderr,
                    flush=True,
                )
        # Written after every context: a long run stopped early keeps what it measured.
        text = write(a, meta, load_start, contexts[: i + 1], methods, runs)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
