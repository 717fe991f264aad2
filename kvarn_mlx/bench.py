"""Measure attention on this machine and write the dispatch's tuning file.

    python -m kvarn_mlx.bench [--contexts 2048,8192] [--out FILE] [--quick]

Times one layer's attention of L query tokens (decode steps: L = 1; prefill
chunks: larger L) over a cache of each context, three ways:
  plain        mx.fast.scaled_dot_product_attention over a float cache (mlx-lm's plain cache)
  dequantized  prefill.attend_dequantized (tiles dequantized into a buffer, fused attention)
  packed       attention.attend (the MLX ops path over the packed tiles) and, on a
               Metal device, kernels.packed_attention_metal (L <= 8)
From the figures it chooses what the dispatch otherwise takes from constants
(kvarn_mlx/tuning.py): from how many query tokens a step attends through the
dequantized buffer, on the CPU how many streams the ops path uses and from how
many tiles, on Metal the attention kernel's threadgroup target. It writes them
atomically to the tuning file ($KVARN_MLX_HOME/tuning.json by default), which
`import kvarn_mlx` reads from then on, and prints one table to paste into a bug
report. On a Mac it first checks the Metal kernels against the numpy reference.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import mlx.core as mx
import numpy as np

from . import attention, dispatch, kernels, prefill, tuning
from . import reference as ref
from .config import DEFAULT_PRESET, get_preset, preset_error
from .tiles import StepView, append

QUERIES = (1, 2, 4, 8, 9, 16, 32, 64)  # 8 | 9: the kernel's last length and the first past it
STREAM_TILES = (2, 4, 8, 16)  # tile counts at which one stream and two are compared
TARGET_GROUPS = (64, 128, 256, 512, 1024)


def metal_device() -> bool:
    """A real Metal device (the MSL emulator does not count: its timings mean nothing)."""
    return dispatch.available() and not dispatch.emulated()


def median_ms(fn, trials):
    mx.eval(fn())  # warm-up: builds kernels, allocates buffers
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


class Context:
    """A filled layer cache of `ctx` tokens: sink, whole tiles, the rest recent;
    the same tokens as a plain float cache. view(q) adds q's own keys."""

    def __init__(self, ctx, config, shape, dtype, seed=0):
        B, Hq, H, D = shape
        G, S = config.group_size, min(config.sink_size, ctx)
        n = (ctx - S) // G
        r = ctx - S - n * G
        rand = lambda *s, i: mx.random.normal(s, key=mx.random.key(seed + i)).astype(dtype)
        sink_k, sink_v = rand(B, H, S, D, i=1), rand(B, H, S, D, i=2)
        tk, tv = rand(B, H, n, G, D, i=3), rand(B, H, n, G, D, i=4)
        self.recent_k, self.recent_v = rand(B, H, r, D, i=5), rand(B, H, r, D, i=6)
        storage = (
            append(None, dispatch.quantize(tk, tv, config, True, config.rotate_values), 0)
            if n
            else None
        )
        self.view = StepView(
            sink_k,
            sink_v,
            storage,
            n,
            self.recent_k,
            self.recent_v,
            config.k_bits,
            config.v_bits,
            True,
            config.rotate_values,
        )
        flat = lambda x: x.reshape(B, H, n * G, D)
        self.plain_k = mx.concatenate([sink_k, flat(tk), self.recent_k], axis=2)
        self.plain_v = mx.concatenate([sink_v, flat(tv), self.recent_v], axis=2)
        self.n_tiles, self.shape, self.dtype, self.seed = n, shape, dtype, seed
        mx.eval(self.plain_k, self.plain_v, *([] if storage is None else storage.arrays()))

    def step(self, L):
        """(queries, view, plain K, plain V) of a step of L new tokens."""
        B, Hq, H, D = self.shape
        new = [
            mx.random.normal(s, key=mx.random.key(self.seed + 10 + i)).astype(self.dtype)
            for i, s in enumerate([(B, Hq, L, D), (B, H, L, D), (B, H, L, D)])
        ]
        q, k, v = new
        view = replace(
            self.view,
            recent_k=mx.concatenate([self.recent_k, k], axis=2),
            recent_v=mx.concatenate([self.recent_v, v], axis=2),
        )
        K, V = mx.concatenate([self.plain_k, k], axis=2), mx.concatenate([self.plain_v, v], axis=2)
        mx.eval(q, view.recent_k, view.recent_v, K, V)
        return q, view, K, V


def time_paths(c: Context, L, trials, kernel):
    """ms of one attention call of L queries: plain, dequantized, ops, kernel (or None)."""
    q, view, K, V = c.step(L)
    scale = q.shape[-1] ** -0.5
    mask = "causal" if L > 1 else None
    fig = {
        "plain": median_ms(
            lambda: mx.fast.scaled_dot_product_attention(q, K, V, scale=scale, mask=mask), trials
        ),
        "dequantized": median_ms(lambda: prefill.attend_dequantized(q, view, scale, mask), trials),
        "ops": median_ms(lambda: attention.attend(q, view, scale, mask), trials),
        "kernel": None,
    }
    if kernel and kernels.attention_unsupported(q, view) is None:
        fig["kernel"] = median_ms(
            lambda: kernels.packed_attention_metal(q, view, scale, L > 1), trials
        )
    return fig


def packed_ms(fig):
    """What the dispatch runs below the threshold: the kernel where it serves, else the ops path."""
    return fig["kernel"] if fig["kernel"] is not None else fig["ops"]


def choose_min_queries(rows, default):
    """The smallest L from which the dequantized path is at least as fast as the
    packed one at every larger L measured (times summed over the contexts);
    `default` when it never is.
    rows: [{"queries": L, "dequantized": ms, "ops": ms, "kernel": ms|None}]."""
    total = {}
    for r in rows:
        d, p = total.get(r["queries"], (0.0, 0.0))
        total[r["queries"]] = (d + r["dequantized"], p + packed_ms(r))
    lengths = sorted(total)
    wins = [L for L in lengths if all(total[x][0] <= total[x][1] for x in lengths if x >= L)]
    return wins[0] if wins else default


def choose_streams(rows, defaults):
    """(cpu_streams, min_stream_tiles) from one-stream and split timings of the
    ops path's decode at several tile counts: two streams if they are faster at
    the most tiles measured; then splitting from the smallest tile count from
    which the split is faster at every larger count (each range holds half).
    rows: [{"tiles": n, "one": ms, "split": ms}]."""
    rows = sorted(rows, key=lambda r: r["tiles"])
    if not rows or rows[-1]["split"] >= rows[-1]["one"]:
        return 1, defaults["min_stream_tiles"]
    wins = [r["tiles"] for i, r in enumerate(rows) if all(x["split"] < x["one"] for x in rows[i:])]
    return 2, max(1, wins[0] // 2)


def time_streams(c: Context, trials):
    """Decode on the ops path over the first n tiles, one stream against two."""
    q, view, _, _ = c.step(1)
    scale = q.shape[-1] ** -0.5
    rows = []
    saved = dispatch.CPU_STREAMS, attention.MIN_STREAM_TILES
    try:
        for n in sorted({t for t in STREAM_TILES if t < c.n_tiles} | {c.n_tiles}):
            v = replace(view, n_tiles=n)
            dispatch.CPU_STREAMS, attention.MIN_STREAM_TILES = 1, 1
            one = median_ms(lambda: attention.attend(q, v, scale), trials)
            dispatch.CPU_STREAMS = 2
            rows.append(
                {
                    "tiles": n,
                    "one": one,
                    "split": median_ms(lambda: attention.attend(q, v, scale), trials),
                }
            )
    finally:
        dispatch.CPU_STREAMS, attention.MIN_STREAM_TILES = saved
    return rows


def time_target_groups(c: Context, trials):
    """Decode through the Metal kernel with each threadgroup target; {target: ms}."""
    q, view, _, _ = c.step(1)
    scale = q.shape[-1] ** -0.5
    saved = kernels._ATT_TARGET_GROUPS
    out = {}
    try:
        for t in TARGET_GROUPS:
            kernels._ATT_TARGET_GROUPS = t
            out[t] = median_ms(lambda: kernels.packed_attention_metal(q, view, scale), trials)
    finally:
        kernels._ATT_TARGET_GROUPS = saved
    return out


def reference_check() -> str | None:
    """The Metal kernels on this device: their own self-test (kernels against
    the ops path), then the attention kernel over kernel-quantized tiles against
    reference.attention (numpy). None if both pass, else what failed."""
    if not kernels._self_test():
        return "the kernels' self-test failed (see the log line above)"
    config = get_preset("k4v2_g128")
    c = Context(64 + 2 * 128 + 5, replace(config, sink=64), (1, 4, 2, 64), mx.float32, seed=100)
    q, view, _, _ = c.step(2)
    got = np.array(kernels.packed_attention_metal(q, view, 0.125, True))
    t = view.tiles.valid(view.n_tiles)
    kw, ka, kb, kt, vw, va, vb, vc = (
        np.array(x if x.dtype == mx.uint32 else x.astype(mx.float32)) for x in t.arrays()
    )
    f = lambda x, h: np.array(x[0, h].astype(mx.float32)).astype(np.float64)
    for h in range(2):
        keys = [
            (ref.unpack(kw[0, h, i], 4), ka[0, h, i], kb[0, h, i], kt[0, h, i])
            for i in range(view.n_tiles)
        ]
        values = [
            (ref.unpack(vw[0, h, i], 2), va[0, h, i], vb[0, h, i], vc[0, h, i])
            for i in range(view.n_tiles)
        ]
        want = ref.attention(
            np.array(q[0, 2 * h : 2 * h + 2]).astype(np.float64),
            f(view.sink_k, h),
            f(view.sink_v, h),
            keys,
            values,
            f(view.recent_k, h),
            f(view.recent_v, h),
            0.125,
            causal=True,
        )
        err = np.abs(got[0, 2 * h : 2 * h + 2] - want).max()
        if not err <= 1e-3 * max(1.0, np.abs(want).max()):
            return (
                f"the attention kernel differs from the numpy reference by {err:.3g} (kv head {h})"
            )
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m kvarn_mlx.bench",
        description="Measure attention on this machine and write kvarn-mlx's tuning file.",
    )
    p.add_argument(
        "--contexts",
        default="2048,8192",
        help="cache lengths in tokens, comma-separated (default: 2048,8192)",
    )
    p.add_argument(
        "--queries",
        default=",".join(map(str, QUERIES)),
        help=(
            "query tokens per step to time, comma-separated; 1 is a decode step (default: "
            "%(default)s)"
        ),
    )
    p.add_argument(
        "--kv-preset",
        default=DEFAULT_PRESET,
        help="the KVarN preset whose widths are timed (default: %(default)s)",
    )
    p.add_argument("--heads", type=int, default=32, help="query heads (default: 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="kv heads (default: 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default: 128)")
    p.add_argument(
        "--dtype",
        default=None,
        help="float16, bfloat16 or float32 (default: float16 on a GPU, float32 on the CPU)",
    )
    p.add_argument(
        "--num-trials",
        type=int,
        default=10,
        help="timed calls per figure, the median is kept (default: 10)",
    )
    p.add_argument(
        "--out", default=None, help="tuning file to write (default: $KVARN_MLX_HOME/tuning.json)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=(
            "small shapes, few lengths and trials: checks that everything runs (seconds; not for "
            "tuning)"
        ),
    )
    a = p.parse_args(argv)
    err = preset_error(a.kv_preset)
    if err:
        p.error(err)
    try:
        a.contexts = [int(x) for x in a.contexts.split(",")]
        a.queries = sorted({int(x) for x in a.queries.split(",")})
    except ValueError:
        p.error("--contexts and --queries take comma-separated integers, e.g. --contexts 2048,8192")
    if min(a.contexts) < 1 or min(a.queries) < 1 or a.num_trials < 1:
        p.error("--contexts, --queries and --num-trials must be positive")
    if a.heads < 1 or a.kv_heads < 1 or a.heads % a.kv_heads:
        p.error(f"--heads {a.heads} must be a positive multiple of --kv-heads {a.kv_heads}")
    if a.dtype is not None and a.dtype not in ("float16", "bfloat16", "float32"):
        p.error(f"--dtype {a.dtype!r}: use float16, bfloat16 or float32")
    if a.quick:
        a.heads, a.kv_heads, a.head_dim, a.num_trials = 4, 2, 64, 2
        a.queries = [x for x in a.queries if x in (1, 9, 16)] or a.queries[:2]
    return a


def main(argv=None):
    a = parse_args(argv)
    device = mx.default_device().type.name
    dtype = getattr(mx, a.dtype or ("float32" if device == "cpu" else "float16"))
    out = tuning.default_path() if a.out is None else a.out
    if out is None:
        print("KVARN_MLX_TUNING is empty (no tuning file); pass --out FILE", file=sys.stderr)
        return 2
    if a.out is None:
        out.parent.mkdir(parents=True, exist_ok=True)
    try:
        out = tuning.check_writable(out)
    except tuning.TuningError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = get_preset(a.kv_preset)
    config = replace(config, rotate_keys=True) if config.rotate_keys == "auto" else config
    shape = (1, a.heads, a.kv_heads, a.head_dim)
    defaults = tuning.DEFAULTS[device]
    machine = tuning.machine()

    metal = metal_device()
    check = reference_check() if metal else None
    kernel = metal and check is None and dispatch.use_metal()

    rows, streams, groups = [], [], {}
    for ctx in a.contexts:
        c = Context(ctx, config, shape, dtype)
        if c.n_tiles == 0:
            print(
                f"--contexts {ctx}: no whole tile past the sink; nothing to time", file=sys.stderr
            )
            continue
        for L in a.queries:
            rows.append({"context": ctx, "queries": L, **time_paths(c, L, a.num_trials, kernel)})
        if ctx == max(a.contexts):
            if device == "cpu" and (machine["cores"] or 1) >= 2:
                streams = time_streams(c, a.num_trials)
            if kernel:
                groups = time_target_groups(c, a.num_trials)
    if not rows:
        print(
            "nothing was timed: give --contexts longer than the sink plus one tile", file=sys.stderr
        )
        return 2

    choices = {}
    if streams:
        choices["cpu_streams"], choices["min_stream_tiles"] = choose_streams(streams, defaults)
    if groups:
        choices["target_groups"] = min(groups, key=groups.get)
    choices["min_queries"] = choose_min_queries(rows, defaults["min_queries"])
    figures = {
        "dtype": str(dtype).split(".")[-1],
        "preset": a.kv_preset,
        "shape": list(shape),
        "trials": a.num_trials,
        "attention_ms": rows,
        "streams_ms": streams,
        "target_groups_ms": {str(k): v for k, v in groups.items()},
    }
    path = tuning.write(out, device, choices, figures)
    print(report(machine, device, check, metal, kernel, figures, choices, defaults, path, a.quick))
    return 0


def report(machine, device, check, metal, kernel, figures, choices, defaults, path, quick):
    """One markdown table: the machine, the figures, the choices written."""
    import mlx_lm

    f = lambda x: "-" if x is None else f"{x:.3f}"
    selftest = "no Metal device" if not metal else "passed" if check is None else f"FAILED: {check}"
    B, Hq, H, D = figures["shape"]
    lines = [
        "| kvarn_mlx.bench | |",
        "|---|---|",
        f"| machine | {machine['system']}, {machine['chip']}, {machine['cores']} cores |",
        f"| MLX | {machine['mlx']} (mlx-lm {mlx_lm.__version__}), device {device} |",
        f"| Metal kernels vs numpy reference | {selftest} |",
        f"| shapes | {figures['preset']}, Hq={Hq} Hkv={H} D={D} {figures['dtype']}, median of "
        f"{figures['trials']} |",
        "",
        "| context | queries | plain ms | dequantized ms | ops ms | kernel ms |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['context']} | {r['queries']} | {f(r['plain'])} | {f(r['dequantized'])} | "
        f"{f(r['ops'])} | {f(r['kernel'])} |"
        for r in figures["attention_ms"]
    ]
    if figures["streams_ms"]:
        lines += ["", "| tiles | ops decode, 1 stream ms | 2 streams ms |", "|---|---|---|"]
        lines += [
            f"| {r['tiles']} | {f(r['one'])} | {f(r['split'])} |" for r in figures["streams_ms"]
        ]
    if figures["target_groups_ms"]:
        lines += ["", "| kernel threadgroup target | decode ms |", "|---|---|"]
        lines += [f"| {k} | {f(v)} |" for k, v in figures["target_groups_ms"].items()]
    lines += ["", "| choice | default | written |", "|---|---|---|"]
    lines += [f"| {k} | {defaults[k]} | {v} |" for k, v in sorted(choices.items())]
    lines += [
        "",
        f"written: {path}"
        + (" (--quick: small shapes, not a tuning of this machine)" if quick else ""),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
