"""python -m kvarn_mlx.eval: how close a quantized KV cache stays to full precision.

Subcommands
  fidelity      teacher-forced logits over real text vs the plain-cache run:
                mean / p99 KL, top-1 agreement, perplexity delta, per context length.
  accumulation  the paper's pseudo-decode (KVARN_SPEC 8): per layer, mean absolute
                error of the attention output vs full precision, by position,
                "accumulated" (chunked prefill) next to "static" (one-shot).
  decode        greedy decoding: steps until the first token that differs from the
                full-precision run, and per-step KL on the full-precision trajectory.

Methods (at bits b = 2 or 4; every tile method uses the same sink and tail):
  fp        mlx-lm's KVCache (the reference)
  kvarnB    KVarN, K and V at B bits (rotation + 8 normalization iterations)
  kiviB     per-channel K / per-token V RTN, no rotation, no normalization
  rotB      rotation only (QuaRot-style), no normalization
  normB     normalization only, no rotation
  oracleB   rotation + per-channel K RTN on keys divided by exact float32
            per-token scales (std over channels of the full-precision tile);
            values rotation-only. Asks: do token scales alone close the gap?
  affineB   mx.quantize affine, group 64, per token (mlx-lm's format) in tiles,
            with the same sink and tail
  mlxqB     mlx-lm's QuantizedKVCache as shipped (no sink, no tail: every token
            is quantized the moment it arrives)
  konlyB / vonlyB  KVarN on K only / V only, the other side in full precision
  any preset name (k4v2_g128, ...)

By default attention runs on dequantized K/V with mx.fast.scaled_dot_product_attention
(--attention dequant): the same numbers as the packed path up to float rounding,
and much faster on CPU. --attention packed uses kvarn_mlx's packed attention
(and mlx-lm's quantized attention for mlxqB).
"""

import argparse
import contextlib
import glob
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import base
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache, QuantizedKVCache, _BaseCache, create_attention_mask

from . import attention as kv_attention
from . import quant
from .cache import KVarNCache
from .config import PRESETS, KVarNConfig

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
G = 128  # tile tokens for every tile method
SINK = 128


# -- eval-only tile cache ------------------------------------------------------


class TileCache(_BaseCache):
    """Eval-only cache with KVarNCache's token flow (full-precision sink, tiles of
    G tokens quantized once when the tail fills, full-precision tail) and a
    pluggable quantizer per side. It keeps a float copy of the dequantized tiles
    for speed; `nbytes` counts only what a real cache of this format holds
    (quantized arrays, sink and tail)."""

    def __init__(self, k_side, v_side, group_size=G, sink=SINK):
        self.k_side, self.v_side = k_side, v_side
        self.G, self.S = group_size, sink
        self.offset = 0
        self.sink_k = self.sink_v = self.tail_k = self.tail_v = None
        self.k_hat = self.v_hat = None  # dequantized tiles [B, H, n*G, D]
        self.held = []  # quantized arrays, for bytes
        self.n_tiles = 0

    def update_and_fetch(self, keys, values):
        seen_k, seen_v = self.k_hat, self.v_hat
        if self.sink_k is None:
            self.sink_k, self.sink_v = keys[..., :0, :], values[..., :0, :]
            self.tail_k, self.tail_v = keys[..., :0, :], values[..., :0, :]
        self.offset += keys.shape[2]
        n = max(0, min(keys.shape[2], self.S - self.sink_k.shape[2]))
        if n:
            self.sink_k = mx.concatenate([self.sink_k, keys[..., :n, :]], axis=2)
            self.sink_v = mx.concatenate([self.sink_v, values[..., :n, :]], axis=2)
        rk = mx.concatenate([self.tail_k, keys[..., n:, :]], axis=2)
        rv = mx.concatenate([self.tail_v, values[..., n:, :]], axis=2)
        m = rk.shape[2] // self.G
        if m:
            self._append(rk[..., : m * self.G, :], rv[..., : m * self.G, :])
        self.tail_k, self.tail_v = rk[..., m * self.G :, :], rv[..., m * self.G :, :]
        # Like KVarNCache: this step's queries see tiles quantized before it, the rest exact.
        parts_k = [self.sink_k] + ([seen_k] if seen_k is not None else []) + [rk]
        parts_v = [self.sink_v] + ([seen_v] if seen_v is not None else []) + [rv]
        return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)

    def _append(self, k, v):
        B, H, T, D = k.shape
        m = T // self.G
        out = []
        for side, x in ((self.k_side, k), (self.v_side, v)):
            held = side.quantize(x.reshape(B, H, m, self.G, D))
            self.held.append((side, held))
            out.append(side.dequantize(held).reshape(B, H, T, D).astype(x.dtype))
        self.k_hat = out[0] if self.k_hat is None else mx.concatenate([self.k_hat, out[0]], axis=2)
        self.v_hat = out[1] if self.v_hat is None else mx.concatenate([self.v_hat, out[1]], axis=2)
        self.n_tiles += m

    def fetch_all(self):
        """All tokens with every whole tile quantized (for the static measurement)."""
        parts_k = [self.sink_k] + ([self.k_hat] if self.k_hat is not None else []) + [self.tail_k]
        parts_v = [self.sink_v] + ([self.v_hat] if self.v_hat is not None else []) + [self.tail_v]
        return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)

    def size(self):
        return self.offset

    def empty(self):
        return self.sink_k is None

    def make_mask(self, N, return_array=False, window_size=None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def nbytes_breakdown(self):
        quantized = sum(a.nbytes for _, h in self.held for a in h if isinstance(a, mx.array))
        sink_tail = sum(x.nbytes for x in (self.sink_k, self.sink_v, self.tail_k, self.tail_v) if x is not None)
        return {"quantized": quantized, "sink_tail": sink_tail, "total": quantized + sink_tail}

    @property
    def nbytes(self):
        return self.nbytes_breakdown()["total"]


class KVarNSide:
    """KVarN's tile quantizer for one side (any iters / rotation)."""

    def __init__(self, key, bits, iters=8, rotate=True):
        self.key, self.bits, self.iters, self.rotate = key, bits, iters, rotate

    def quantize(self, x):
        f = quant.quantize_keys if self.key else quant.quantize_values
        return f(x, self.bits, self.iters, self.rotate and quant.can_rotate(x.shape[-1]))

    def dequantize(self, held):
        f = quant.dequantize_keys if self.key else quant.dequantize_values
        x = f(*held, self.bits)
        return quant.unrotate(x) if self.rotate and quant.can_rotate(x.shape[-1]) else x


class FullSide:
    """No quantization: the tile stays in the model's dtype."""

    def quantize(self, x):
        return (x,)

    def dequantize(self, held):
        return held[0]


class AffineSide:
    """mx.quantize affine, per token along D in groups of 64 (mlx-lm's QuantizedKVCache format)."""

    def __init__(self, bits, group_size=64):
        self.bits, self.gs = bits, group_size

    def quantize(self, x):
        gs = self.gs if x.shape[-1] % self.gs == 0 else 32
        return (*mx.quantize(x, group_size=gs, bits=self.bits), gs)

    def dequantize(self, held):
        w, s, b, gs = held
        return mx.dequantize(w, s, b, group_size=gs, bits=self.bits)


class OracleKeySide:
    """Keys: rotate, divide each token by its exact std over channels (float32,
    from the full-precision tile), per-channel RTN, multiply back. Tests whether
    exact token scales alone close the gap to KVarN's iterated dual scaling."""

    def __init__(self, bits):
        self.bits = bits

    def quantize(self, x):
        M = mx.swapaxes(quant.rotate(x.astype(mx.float32)), -1, -2)  # [..., D, G]
        t = mx.maximum(mx.sqrt(mx.var(M, axis=-2, keepdims=True, ddof=1)), 1e-6)
        code, scale, lo = quant.rtn(M / t, self.bits)
        return quant.pack(code, self.bits), scale[..., 0].astype(mx.float16), lo[..., 0].astype(mx.float16), t[..., 0, :]

    def dequantize(self, held):
        return quant.unrotate(quant.dequantize_keys(*held, self.bits))


# -- methods -------------------------------------------------------------------

_FAMILIES = ("kvarn", "kivi", "rot", "norm", "oracle", "affine", "mlxq", "konly", "vonly", "plaink", "auto")


def method_config(name):
    """KVarNConfig for the KVarNCache methods, else None."""
    if name in PRESETS:
        return PRESETS[name]
    fam, b = _parse(name)
    if fam in ("kvarn", "kivi", "rot", "norm"):
        iters = 8 if fam in ("kvarn", "norm") else 0
        rot = fam in ("kvarn", "rot")
        return KVarNConfig(k_bits=b, v_bits=b, group_size=G, sink=SINK, iters=iters, rotate_keys=rot, rotate_values=rot)
    if fam in ("plaink", "auto"):  # KVarN without key rotation / with it chosen per kv head (values rotated)
        return KVarNConfig(k_bits=b, v_bits=b, group_size=G, sink=SINK, rotate_keys=fam == "auto")
    return None


def _parse(name):
    m = re.fullmatch(r"([a-z]+)([24])", name)
    if not m or m.group(1) not in _FAMILIES:
        raise ValueError(f"unknown method {name!r}: use fp, a preset ({', '.join(PRESETS)}) or one of "
                         f"{', '.join(f + '2' for f in _FAMILIES)} (or ...4)")
    return m.group(1), int(m.group(2))


def make_caches(model, name):
    """One cache per layer for method `name` (plain KVCache layers only)."""
    caches = mlx_cache.make_prompt_cache(model)
    if name == "fp":
        return caches
    cfg = method_config(name)
    if cfg is None:
        fam, b = _parse(name)
        k_side, v_side = {
            "oracle": (OracleKeySide(b), KVarNSide(False, b, iters=0)),
            "affine": (AffineSide(b), AffineSide(b)),
            "konly": (KVarNSide(True, b), FullSide()),
            "vonly": (FullSide(), KVarNSide(False, b)),
            "mlxq": (None, None),
        }[fam]
    for i, c in enumerate(caches):
        if type(c) is not KVCache:
            continue
        if cfg is not None:
            caches[i] = KVarNCache(cfg)
        elif fam == "mlxq":
            caches[i] = QuantizedKVCache(group_size=64, bits=b)
        else:
            caches[i] = TileCache(k_side, v_side)
    return caches


def method_bits(name):
    if name == "fp":
        return "16/16"
    cfg = method_config(name)
    if cfg is not None:
        return f"{cfg.k_bits}/{cfg.v_bits}"
    fam, b = _parse(name)
    return {"konly": f"{b}/fp", "vonly": f"fp/{b}"}.get(fam, f"{b}/{b}")


def cache_bytes(caches):
    """Measured bytes held by the caches (arrays, not formulas) and bits per
    quantized element (codes + scales over the elements stored in tiles)."""
    total = qbytes = qelems = tokens = 0
    for c in caches:
        if isinstance(c, KVarNCache):
            if c.empty():
                continue
            b = c.nbytes_breakdown()
            total += b["total"] - b["unused"]
            qbytes += b["codes"] + b["scales"]
            B, H, _, D = c.sink_k.shape
            qelems += 2 * B * H * c.n_tiles * c.config.group_size * D
        elif isinstance(c, TileCache):
            if c.empty():
                continue
            b = c.nbytes_breakdown()
            total += b["total"]
            # bits/element over the quantized side(s) only (K-only / V-only keep the other exact)
            held = [a for side, h in c.held if not isinstance(side, FullSide) for a in h if isinstance(a, mx.array)]
            qbytes += sum(a.nbytes for a in held)
            B, H, _, D = c.sink_k.shape
            sides = sum(not isinstance(s, FullSide) for s in (c.k_side, c.v_side))
            qelems += sides * B * H * c.n_tiles * c.G * D
        elif isinstance(c, QuantizedKVCache):
            if c.keys is None:
                continue
            used = sum(x.nbytes * c.offset // x.shape[2] for x in (*c.keys, *c.values))
            total += used
            qbytes += used
            B, H, _, _ = c.keys[0].shape
            qelems += 2 * B * H * c.offset * c.keys[0].shape[-1] * 32 // c.bits
        elif isinstance(c, KVCache):
            if c.keys is None:
                continue
            total += c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes
    bits = 8 * qbytes / qelems if qelems else None
    return {"bytes": int(total), "bits_per_quantized_element": bits}


def fp16_bytes(model, tokens):
    """What mlx-lm's KVCache holds for `tokens` tokens in a 2-byte dtype."""
    args = model.args
    H = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    D = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    return 2 * len(model.layers) * H * tokens * D * 2


# -- attention hook --------------------------------------------------------------


class _Hook:
    mode = "dequant"
    capture = None  # a list to append attention outputs to, or None
    capture_qkv = None  # a list to append (queries, keys, values) to, or None


def _eval_sdpa(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
    if _Hook.capture_qkv is not None:
        _Hook.capture_qkv.append((queries, keys, values))
    if _Hook.mode == "packed":
        out = kv_attention.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=sinks, **kwargs)
    else:
        if isinstance(cache, QuantizedKVCache):
            keys = mx.dequantize(*keys, group_size=cache.group_size, bits=cache.bits)
            values = mx.dequantize(*values, group_size=cache.group_size, bits=cache.bits)
        out = mx.fast.scaled_dot_product_attention(queries, keys.astype(queries.dtype), values.astype(queries.dtype),
                                                   scale=scale, mask=mask, sinks=sinks)
    if _Hook.capture is not None:
        _Hook.capture.append(out)
    return out


@contextlib.contextmanager
def hooked(mode=None):
    """Route mlx-lm's attention entry point through _eval_sdpa."""
    kv_attention.patch()
    held = [(m, m.scaled_dot_product_attention) for n, m in list(sys.modules.items())
            if n.startswith("mlx_lm.models") and getattr(m, "scaled_dot_product_attention", None)
            in (kv_attention.scaled_dot_product_attention, kv_attention._original)]
    _Hook.mode = mode or _Hook.mode
    for m, _ in held:
        m.scaled_dot_product_attention = _eval_sdpa
    try:
        yield
    finally:
        for m, f in held:
            m.scaled_dot_product_attention = f
        _Hook.capture = _Hook.capture_qkv = None


# -- helpers -----------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total, label):
        self.total, self.label, self.n, self.t0 = total, label, 0, time.time()
        self.quiet = os.environ.get("KVARN_EVAL_QUIET") == "1"

    def step(self, k=1):
        self.n += k
        if self.quiet:
            return
        w = 24
        f = int(w * self.n / max(self.total, 1))
        dt = time.time() - self.t0
        eta = dt / self.n * (self.total - self.n) if self.n else 0
        sys.stderr.write(f"\r{self.label:<14} [{'#' * f}{'.' * (w - f)}] {self.n}/{self.total} {dt:5.0f}s eta {eta:4.0f}s")
        if self.n >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def load_text(source):
    if source == "topics":
        import pydoc_data.topics
        return Path(pydoc_data.topics.__file__).read_text()
    if source == "licenses":
        files = sorted({os.path.realpath(p) for p in glob.glob("/usr/share/common-licenses/*") if os.path.isfile(p)})
        return "\n\n".join(Path(p).read_text(errors="replace") for p in files)
    return Path(source).read_text()


def tokens(tokenizer, source, n):
    text = load_text(source)
    # Encode only a prefix (tokenizers warn on very long inputs); grow if short.
    chars = 8 * n
    while True:
        ids = tokenizer.encode(text[:chars])
        if len(ids) > n or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise ValueError(f"text {source!r} has only {len(ids)} tokens; need {n}")
    return ids[:n]


def metadata(args, model_name):
    import mlx_lm
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        rev = None
    mem = None
    with contextlib.suppress(OSError, ValueError):
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    with contextlib.suppress(OSError):
        maps = Path("/proc/self/maps").read_text()
    blas = "openblas" in maps if "maps" in locals() else None
    return {
        "model": model_name,
        "command": "python -m kvarn_mlx.eval " + " ".join(sys.argv[1:]) if args is not None else None,
        "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "numpy": np.__version__,
                     "python": platform.python_version(), "kvarn_mlx_git": rev},
        "machine": {"system": platform.platform(), "processor": platform.machine(), "cpus": os.cpu_count(),
                    "memory_gib": mem, "device": str(mx.default_device())},
        "openblas_preloaded": blas,
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _meta_md(meta):
    v = meta["versions"]
    return (f"Model: {meta['model']}  \nCommand: `{meta['command']}`  \n"
            f"mlx {v['mlx']}, mlx-lm {v['mlx_lm']}, numpy {v['numpy']}, python {v['python']}, "
            f"kvarn_mlx {v['kvarn_mlx_git']}  \nMachine: {meta['machine']['system']}, {meta['machine']['cpus']} cpus, "
            f"{meta['machine']['memory_gib']} GiB, {meta['machine']['device']}; OpenBLAS preloaded: "
            f"{meta['openblas_preloaded']}  \nDate: {meta['date']}\n")


def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return None


def run_chunks(model, ids, caches, chunk, on_chunk=None, label=""):
    """Prefill ids [L] in chunks; on_chunk(start, logits [n, V]) per chunk."""
    bar = Progress(math.ceil(len(ids) / chunk), label)
    x = mx.array(ids)[None]
    for s in range(0, len(ids), chunk):
        logits = model(x[:, s : s + chunk], cache=caches)
        if on_chunk is not None:
            on_chunk(s, logits[0])
        else:
            mx.eval(logits)
        bar.step()


def _log_softmax(x):
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


# -- fidelity --------------------------------------------------------------------


def fidelity(model, tokenizer, methods, contexts, source="topics", chunk=256, sink=SINK, progress_label=""):
    """Teacher-forced metrics per method and context length.

    One run of max(contexts) tokens per method: attention is causal and chunk
    boundaries are the same, so the logits at positions < L equal those of an
    L-token run. Positions p >= sink count (predicting token p+1).
    """
    L = max(contexts)
    ids = tokens(tokenizer, source, L)
    targets = mx.array(ids[1:] + [0])
    ref = []  # (log-probs, argmax) per chunk

    def keep_ref(s, logits):
        lp = _log_softmax(logits)
        ref.append((lp, mx.argmax(lp, axis=-1)))
        mx.eval(ref[-1])

    per_pos, bytes_at, seconds = {}, {}, {}
    for name in ["fp"] + [m for m in methods if m != "fp"]:
        caches = make_caches(model, name)
        kl, agree, nll, at = [], [], [], {}

        def measure(s, logits, kl=kl, agree=agree, nll=nll, at=at, caches=caches):
            if name == "fp":
                keep_ref(s, logits)
            lp_ref, top_ref = ref[s // chunk]
            lp = _log_softmax(logits)
            n = lp.shape[0]
            k = (mx.exp(lp_ref) * (lp_ref - lp)).sum(axis=-1)
            a = mx.argmax(lp, axis=-1) == top_ref
            t = -mx.take_along_axis(lp, targets[s : s + n, None], axis=-1)[:, 0]
            mx.eval(k, a, t)
            kl.append(np.array(k)), agree.append(np.array(a)), nll.append(np.array(t))
            if s + n in contexts:
                at[s + n] = cache_bytes(caches)

        t0 = time.time()
        with hooked():
            run_chunks(model, ids, caches, chunk, measure, label=f"{progress_label}{name}")
        seconds[name] = time.time() - t0
        per_pos[name] = {"kl": np.concatenate(kl), "agree": np.concatenate(agree), "nll": np.concatenate(nll)}
        bytes_at[name] = at
        del caches

    rows = []
    for Lc in sorted(contexts):
        sel = slice(sink, Lc - 1)  # predicting tokens sink+1 .. Lc-1
        ppl_fp = float(np.exp(per_pos["fp"]["nll"][sel].mean()))
        for name in per_pos:
            p = per_pos[name]
            kl = p["kl"][sel].astype(np.float64)
            ppl = float(np.exp(p["nll"][sel].mean()))
            b = bytes_at[name].get(Lc, {})
            rows.append({
                "method": name, "bits_kv": method_bits(name), "context": Lc,
                "kl_mean": float(np.maximum(kl, 0).mean()), "kl_p99": float(np.percentile(np.maximum(kl, 0), 99)),
                "top1_agree": float(p["agree"][sel].mean()), "ppl": ppl, "ppl_delta": ppl - ppl_fp,
                "bytes": b.get("bytes"), "fp16_bytes": fp16_bytes(model, Lc),
                "bits_per_quantized_element": b.get("bits_per_quantized_element"),
            })
    return {"rows": rows, "seconds": seconds, "source": source, "chunk": chunk, "sink": sink,
            "positions": f"positions {sink}..L-2 (predicting tokens {sink + 1}..L-1)"}


def fidelity_markdown(res, meta):
    out = [f"# Fidelity (teacher-forced, text: {res['source']})\n", _meta_md(meta),
           f"\nPrefill in {res['chunk']}-token chunks (each chunk attends to tiles quantized before it). "
           f"Metrics over {res['positions']}; KL = KL(p_fp || p_method) per position in nats. "
           "Bytes: measured held K/V arrays of all layers at that context (sink and tail in the model's dtype, "
           "float32 here); ratio = a 2-byte fp16 KVCache's bytes / measured bytes. "
           "bits/elt: codes + scales per element stored in quantized tiles (for K-only / V-only: of the quantized side).\n"]
    for Lc in sorted({r["context"] for r in res["rows"]}):
        out.append(f"\n## Context {Lc}\n")
        out.append("| method | K/V bits | KL mean | KL p99 | top-1 agree | ppl | ppl delta | bytes | vs fp16 | bits/elt |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in res["rows"]:
            if r["context"] != Lc:
                continue
            ratio = f"{r['fp16_bytes'] / r['bytes']:.2f}x" if r["bytes"] else ""
            be = f"{r['bits_per_quantized_element']:.2f}" if r["bits_per_quantized_element"] else ""
            out.append(f"| {r['method']} | {r['bits_kv']} | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} | "
                       f"{r['top1_agree']:.3f} | {r['ppl']:.3f} | {r['ppl_delta']:+.3f} | {r['bytes'] or ''} | {ratio} | {be} |")
    out.append("\nSeconds per method (whole run): " + ", ".join(f"{k} {v:.0f}" for k, v in res["seconds"].items()))
    return "\n".join(out) + "\n"


def fidelity_plots(res, outdir):
    plt = _plt()
    if plt is None:
        return []
    rows = [r for r in res["rows"] if r["method"] != "fp"]
    files = []
    def group(r):  # the first code width in "K/V bits" ("fp/2" -> 2)
        return next(b for b in r["bits_kv"].split("/") if b != "fp")

    groups = sorted({group(r) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, bits in zip(axes[0], groups):
        for m in dict.fromkeys(r["method"] for r in rows if group(r) == bits):
            rr = [r for r in rows if r["method"] == m]
            ax.plot([r["context"] for r in rr], [max(r["kl_mean"], 1e-6) for r in rr], "o-", label=m)
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="mean KL to fp (nats)",
               title=f"{bits}-bit codes (first side)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(outdir / "fidelity_kl.png")
    fig.savefig(files[-1], dpi=110)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    allrows = res["rows"]
    for m in dict.fromkeys(r["method"] for r in allrows):
        rr = [r for r in allrows if r["method"] == m and r["bytes"]]
        ax.plot([r["context"] for r in rr], [r["bytes"] / 2**20 for r in rr], "o-", label=m)
    ctx = sorted({r["context"] for r in allrows})
    ax.plot(ctx, [allrows[0]["fp16_bytes"] * c / allrows[0]["context"] / 2**20 for c in ctx], "k--", label="fp16 KVCache")
    ax.set(xlabel="context (tokens)", ylabel="KV cache MiB (measured)", title="memory vs context")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(outdir / "memory_vs_context.png")
    fig.savefig(files[-1], dpi=110)
    plt.close("all")
    return files


# -- accumulation ------------------------------------------------------------------


def _capture_run(model, ids, caches, block, label, want_qkv=False):
    """Chunked prefill capturing every layer's attention output [L, Hq*D] (numpy),
    and (want_qkv) the queries and the final keys/values per layer."""
    outs, qs, kv = [], [], None
    bar = Progress(math.ceil(len(ids) / block), label)
    x = mx.array(ids)[None]
    for s in range(0, len(ids), block):
        _Hook.capture = cap = []
        _Hook.capture_qkv = seen = [] if want_qkv else None
        try:
            mx.eval(model(x[:, s : s + block], cache=caches))
        finally:
            _Hook.capture = _Hook.capture_qkv = None
        outs.append([np.array(o[0].swapaxes(0, 1).reshape(o.shape[2], -1)) for o in cap])
        if want_qkv:
            qs.append([q for q, _, _ in seen])
            kv = [(k, v) for _, k, v in seen]
            mx.eval(qs[-1])
        bar.step()
    per_layer = [np.concatenate([o[i] for o in outs]) for i in range(len(outs[0]))]
    if want_qkv:
        q = [mx.concatenate([c[i] for c in qs], axis=2) for i in range(len(qs[0]))]
        return per_layer, q, kv
    return per_layer


def _static_outputs(name, q, k, v, scale, block):
    """One-shot: quantize the full-precision run's K/V once (every whole tile
    after the sink) and attend with its queries, with the same visibility as the
    chunked run (a block's queries see tiles before the block quantized and the
    block itself exact), so accumulated / static isolates error propagation."""
    c = make_caches_single(name)
    exact_block = True
    if isinstance(c, KVarNCache):
        c.update_and_fetch(k, v)
        kh, vh = c.update_and_fetch(k[..., :0, :], v[..., :0, :])  # a 0-token step: every tile now counts as seen
    elif isinstance(c, TileCache):
        c.update_and_fetch(k, v)
        kh, vh = c.fetch_all()
    elif isinstance(c, QuantizedKVCache):
        kq, vq = c.update_and_fetch(k, v)
        kh = mx.dequantize(*kq, group_size=c.group_size, bits=c.bits)
        vh = mx.dequantize(*vq, group_size=c.group_size, bits=c.bits)
        exact_block = False  # it quantizes every token on arrival, its own block too
    else:
        kh, vh = k, v
    kh, vh = kh.astype(q.dtype), vh.astype(q.dtype)
    L = q.shape[2]
    out = []
    for s in range(0, L, block):
        e = min(L, s + block)
        km = mx.concatenate([kh[:, :, :s], k[:, :, s:e]], axis=2) if exact_block else kh[:, :, :e]
        vm = mx.concatenate([vh[:, :, :s], v[:, :, s:e]], axis=2) if exact_block else vh[:, :, :e]
        o = mx.fast.scaled_dot_product_attention(q[:, :, s:e], km, vm, scale=scale, mask="causal")
        out.append(np.array(o[0].swapaxes(0, 1).reshape(e - s, -1)))
    return np.concatenate(out)


class _OneLayer:
    def __init__(self):
        self.layers = [None]

    def make_cache(self):
        return [KVCache()]


def make_caches_single(name):
    return make_caches(_OneLayer(), name)[0]


def accumulation(model, tokenizer, methods, context=2048, block=G, source="topics"):
    ids = tokens(tokenizer, source, context)
    with hooked():
        ref, q, kv = _capture_run(model, ids, mlx_cache.make_prompt_cache(model), block, "fp", want_qkv=True)
        scale = model.layers[0].self_attn.scale
        res = {"context": context, "block": block, "source": source, "methods": {}}
        for name in methods:
            out = _capture_run(model, ids, make_caches(model, name), block, name)
            acc = np.stack([np.abs(o - r).mean(axis=1) for o, r in zip(out, ref)])  # [layers, L]
            sta = np.stack([np.abs(_static_outputs(name, q[i], *kv[i], scale, block) - ref[i]).mean(axis=1)
                            for i in range(len(ref))])
            res["methods"][name] = {"accumulated": acc, "static": sta}
    return res


def _window(x, a, b):
    return float(x[..., a:b].mean())


def accumulation_summary(res, sink=SINK):
    L = res["context"]
    first = (sink + G, min(L, sink + G + 512))  # first quantized positions
    last = (max(sink + G, L - 512), L)  # may overlap "first" on short contexts
    rows = []
    for name, r in res["methods"].items():
        acc, sta = r["accumulated"].mean(axis=0), r["static"].mean(axis=0)
        pos = np.arange(L)
        sel = pos >= sink + G
        slope = np.polyfit(pos[sel] / 1000, acc[sel], 1)[0]
        slope_s = np.polyfit(pos[sel] / 1000, sta[sel], 1)[0]
        rows.append({
            "method": name,
            "acc_first": _window(acc, *first), "acc_last": _window(acc, *last),
            "static_first": _window(sta, *first), "static_last": _window(sta, *last),
            "acc_growth": _window(acc, *last) / max(_window(acc, *first), 1e-12),
            "acc_over_static_last": _window(acc, *last) / max(_window(sta, *last), 1e-12),
            "acc_slope_per_1k": float(slope), "static_slope_per_1k": float(slope_s),
            "acc_mean": float(acc[sel].mean()), "static_mean": float(sta[sel].mean()),
        })
    return rows, first, last


def accumulation_markdown(res, meta):
    rows, first, last = accumulation_summary(res)
    out = [f"# Error accumulation (pseudo-decode, text: {res['source']})\n", _meta_md(meta),
           f"\nContext {res['context']} tokens, prefilled in blocks of {res['block']} (each block is quantized "
           "before the next attends to it; a block's own tokens are seen in full precision, as in real decoding). "
           "Error = mean |attention output - full-precision output| (before o_proj), averaged over heads, channels "
           "and layers. Accumulated: the chunked run, where every layer's input already carries the error of earlier "
           "layers and tokens. Static: the full-precision run's K/V quantized once, attended by the full-precision "
           "queries with the same visibility (tiles before the query's block quantized, the block itself exact), so "
           f"acc/static > 1 is error carried forward through layers and tokens. Windows: first = positions [{first[0]}, {first[1]}), last = [{last[0]}, {last[1]}).\n",
           "| method | acc first | acc last | acc growth (last/first) | acc slope /1K tok | static first | static last | static slope /1K | acc/static (last) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['method']} | {r['acc_first']:.5f} | {r['acc_last']:.5f} | {r['acc_growth']:.2f} | "
                   f"{r['acc_slope_per_1k']:+.5f} | {r['static_first']:.5f} | {r['static_last']:.5f} | "
                   f"{r['static_slope_per_1k']:+.5f} | {r['acc_over_static_last']:.2f} |")
    out.append("\nPer-layer mean error over quantized positions (accumulated / static):\n")
    names = list(res["methods"])
    out.append("| layer | " + " | ".join(names) + " |")
    out.append("|---|" + "---|" * len(names))
    n_layers = next(iter(res["methods"].values()))["accumulated"].shape[0]
    for i in range(n_layers):
        cells = []
        for n in names:
            r = res["methods"][n]
            cells.append(f"{r['accumulated'][i, SINK + G:].mean():.4f} / {r['static'][i, SINK + G:].mean():.4f}")
        out.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def compact_accumulation(res, bin=16):
    """For the json: per-position curves averaged over layers at full resolution,
    per-layer curves as means over bins of `bin` tokens (keeps files small)."""
    out = dict(res, methods={}, layer_bin=bin)
    for name, r in res["methods"].items():
        m = {}
        for key in ("accumulated", "static"):
            x = np.asarray(r[key], dtype=np.float64)
            n = x.shape[1] // bin * bin
            m[f"{key}_mean_over_layers"] = np.round(x.mean(axis=0), 6)
            m[f"{key}_per_layer_binned"] = np.round(x[:, :n].reshape(x.shape[0], -1, bin).mean(axis=2), 6)
        out["methods"][name] = m
    return out


def accumulation_plots(res, outdir, smooth=64):
    plt = _plt()
    if plt is None:
        return []
    k = np.ones(smooth) / smooth
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, (name, r) in enumerate(res["methods"].items()):
        c = colors[j % len(colors)]
        for ax, key, ls in ((axes[0], "accumulated", "-"), (axes[0], "static", "--")):
            y = np.convolve(r[key].mean(axis=0)[SINK + G:], k, mode="valid")  # smooth quantized positions only
            ax.plot(SINK + G + smooth // 2 + np.arange(len(y)), y, ls, color=c, label=f"{name} {key}")
        n_layers = r["accumulated"].shape[0]
        for i in (n_layers // 2, n_layers - 1):
            y = np.convolve(r["accumulated"][i][SINK + G:], k, mode="valid")
            axes[1].plot(SINK + G + smooth // 2 + np.arange(len(y)), y, "-" if i == n_layers - 1 else ":",
                         color=c, label=f"{name} layer {i}")
    axes[0].set(xlabel="position (tokens)", ylabel="mean |attn out - fp|", yscale="log",
                title=f"mean of all layers, block {res['block']} (solid: accumulated, dashed: static)")
    axes[1].set(xlabel="position (tokens)", ylabel="mean |attn out - fp|", yscale="log", title="accumulated, single layers")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    f = outdir / "accumulation.png"
    fig.savefig(f, dpi=110)
    plt.close("all")
    return [f]


# -- decode ------------------------------------------------------------------------


def decode(model, tokenizer, methods, prompt_len=384, steps=256, source="licenses", chunk=256, prompts=1):
    """Per prompt (consecutive prompt_len-token pieces of the text): the fp greedy
    trajectory, then each method teacher-forced on it."""
    all_ids = tokens(tokenizer, source, prompt_len * prompts)
    res = {"prompt_len": prompt_len, "steps": steps, "source": source, "prompts": prompts,
           "methods": {m: {"kl_per_prompt": [], "first_divergence": []} for m in methods}}
    with hooked():
        for j in range(prompts):
            ids = all_ids[j * prompt_len : (j + 1) * prompt_len]
            tag = f"p{j} " if prompts > 1 else ""
            traj, ref_lp = _greedy(model, ids, mlx_cache.make_prompt_cache(model), steps, chunk, f"{tag}fp")
            for name in methods:
                kls, first_div = _forced(model, ids, make_caches(model, name), traj, ref_lp, chunk, f"{tag}{name}")
                res["methods"][name]["kl_per_prompt"].append(np.array(kls))
                res["methods"][name]["first_divergence"].append(first_div)
    for r in res["methods"].values():
        r["kl"] = np.mean(r["kl_per_prompt"], axis=0)
        # No divergence within the steps counts as `steps` (a lower bound) for the median.
        r["first_divergence_median"] = float(np.median([steps if d is None else d for d in r["first_divergence"]]))
    return res


def _prefill_last(model, ids, caches, chunk, label):
    last = []
    run_chunks(model, ids, caches, chunk, lambda s, lg: last.append(lg[-1]), label=f"{label} prefill")
    return last[-1]


def _greedy(model, ids, caches, steps, chunk, label):
    y = _prefill_last(model, ids, caches, chunk, label)
    traj, ref_lp = [], []
    bar = Progress(steps, f"{label} decode")
    for _ in range(steps):
        lp = _log_softmax(y)
        tok = mx.argmax(lp)
        mx.eval(lp, tok)
        traj.append(int(tok.item()))
        ref_lp.append(lp)
        y = model(tok.reshape(1, 1), cache=caches)[0, -1]
        bar.step()
    return traj, ref_lp


def _forced(model, ids, caches, traj, ref_lp, chunk, label):
    y = _prefill_last(model, ids, caches, chunk, label)
    kls, first_div = [], None
    bar = Progress(len(traj), f"{label} decode")
    for i, t in enumerate(traj):
        lp = _log_softmax(y)
        kl = (mx.exp(ref_lp[i]) * (ref_lp[i] - lp)).sum()
        top = mx.argmax(lp)
        mx.eval(kl, top)
        kls.append(max(float(kl.item()), 0.0))
        if first_div is None and int(top.item()) != t:
            first_div = i
        # Teacher-forced on the fp trajectory: identical to free-running up to the first divergence.
        y = model(mx.array([[t]]), cache=caches)[0, -1]
        bar.step()
    return kls, first_div


def decode_markdown(res, meta):
    P = res.get("prompts", 1)
    out = [f"# Decode (greedy, text: {res['source']})\n", _meta_md(meta),
           f"\n{P} prompt(s) of {res['prompt_len']} tokens (consecutive pieces of the text), {res['steps']} greedy "
           "steps each. First divergence: the first step whose greedy token differs from the full-precision run's "
           "(free-running and teacher-forced decoding agree up to that step; 'none' = no divergence within the steps, "
           "counted as the step count in the median). KL: per step on the full-precision trajectory (teacher-forced), "
           "averaged over prompts. With sink 128 and 128-token tiles, tokens generated after the prompt are quantized "
           "once the tail fills.\n",
           "| method | K/V bits | first divergence per prompt | median | KL mean | KL p99 | KL mean, steps < 128 | KL mean, steps >= 128 |",
           "|---|---|---|---|---|---|---|---|"]
    for name, r in res["methods"].items():
        kl = np.asarray(r["kl"])
        fd = ", ".join("none" if d is None else str(d) for d in r["first_divergence"])
        late = kl[128:].mean() if len(kl) > 128 else float("nan")
        out.append(f"| {name} | {method_bits(name)} | {fd} | {r['first_divergence_median']:.0f} | {kl.mean():.4f} | "
                   f"{np.percentile(kl, 99):.3f} | {kl[:128].mean():.4f} | {late:.4f} |")
    return "\n".join(out) + "\n"


def decode_plots(res, outdir, smooth=16):
    plt = _plt()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    k = np.ones(smooth) / smooth
    for name, r in res["methods"].items():
        ax.plot(res["prompt_len"] + np.arange(len(r["kl"])), np.maximum(np.convolve(r["kl"], k, mode="same"), 1e-7),
                label=f"{name} (first divergence, median {r['first_divergence_median']:.0f})")
    ax.set(xlabel="position (tokens)", ylabel=f"KL to fp (nats, {smooth}-step mean)", yscale="log",
           title=f"teacher-forced decode on the fp trajectory ({res.get('prompts', 1)} prompts)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    f = outdir / "decode_kl.png"
    fig.savefig(f, dpi=110)
    plt.close("all")
    return [f]


# -- CLI ------------------------------------------------------------------------------


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def setup_arg_parser():
    p = argparse.ArgumentParser(prog="python -m kvarn_mlx.eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default=None, help="MLX model folder or HF repo (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="benchmarks/results", help="results folder")
    p.add_argument("--tag", default="", help="suffix for result file names")
    p.add_argument("--attention", choices=("dequant", "packed"), default="dequant",
                   help="attention over dequantized K/V (fast on CPU, default) or the packed path")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fidelity", help="teacher-forced KL / top-1 / perplexity vs the plain cache")
    f.add_argument("--methods", default="kivi2,rot2,norm2,kvarn2,oracle2,affine2,mlxq2,konly2,vonly2,"
                   "kivi4,rot4,norm4,kvarn4,oracle4,affine4,mlxq4")
    f.add_argument("--contexts", default="512,1024,2048,4096")
    f.add_argument("--text", default="topics", help="topics (CPython pydoc_data/topics.py), licenses, or a file")
    f.add_argument("--chunk", type=int, default=256)
    a = sub.add_parser("accumulation", help="attention-output error vs position: accumulated and static")
    a.add_argument("--methods", default="kivi2,rot2,kvarn2")
    a.add_argument("--context", type=int, default=2048)
    a.add_argument("--block", type=int, default=G)
    a.add_argument("--text", default="topics")
    d = sub.add_parser("decode", help="greedy decode: first divergence and per-step KL")
    d.add_argument("--methods", default="kivi2,rot2,kvarn2,k4v2_g128")
    d.add_argument("--prompt-len", type=int, default=384)
    d.add_argument("--steps", type=int, default=256)
    d.add_argument("--text", default="licenses")
    d.add_argument("--prompts", type=int, default=1, help="prompts (consecutive pieces of the text)")
    return p


def _load(model_arg):
    from .loader import load
    model, tok = load(model_arg)
    return model, tok, model_arg or "SmolLM2-135M-Instruct (embedded, float32)"


def main(argv=None, model=None, tokenizer=None, model_name=None):
    args = setup_arg_parser().parse_args(argv)
    if argv is not None:
        sys.argv = ["kvarn_mlx.eval", *argv]
    if model is None:
        model, tokenizer, model_name = _load(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = metadata(args, model_name)
    meta["attention"] = args.attention
    _Hook.mode = args.attention
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m != "fp":
            method_bits(m)  # fail early on unknown names
    tag = f"_{args.tag}" if args.tag else ""
    # Plots are drawn in a scratch folder and moved with the tag, so a tagged run never touches untagged files.
    scratch = Path(tempfile.mkdtemp(prefix=".plots.", dir=out))
    if args.cmd == "fidelity":
        res = fidelity_with_mode(args, model, tokenizer, methods)
        md, plots, stem = fidelity_markdown(res, meta), fidelity_plots(res, scratch), f"fidelity{tag}"
    elif args.cmd == "accumulation":
        res = accumulation(model, tokenizer, methods, args.context, args.block, args.text)
        md, plots, stem = accumulation_markdown(res, meta), accumulation_plots(res, scratch), f"accumulation{tag}"
        res["summary"] = accumulation_summary(res)[0]
        res = compact_accumulation(res)
    else:
        res = decode(model, tokenizer, methods, args.prompt_len, args.steps, args.text, prompts=args.prompts)
        md, plots, stem = decode_markdown(res, meta), decode_plots(res, scratch), f"decode{tag}"
    renamed = []
    for f in plots:
        g = out / (f.stem + tag + f.suffix)
        f.replace(g)
        renamed.append(g.name)
    shutil.rmtree(scratch, ignore_errors=True)
    md += "\n" + "\n".join(f"![{g}]({g})" for g in renamed) + "\n"
    (out / f"{stem}.md").write_text(md)
    (out / f"{stem}.json").write_text(json.dumps(_jsonable({"meta": meta, "result": res, "plots": renamed}), indent=1))
    print(md)
    print(f"wrote {out / stem}.md, .json and {len(renamed)} plot(s)", file=sys.stderr)
    return res


def fidelity_with_mode(args, model, tokenizer, methods):
    contexts = sorted(int(c) for c in args.contexts.split(","))
    return fidelity(model, tokenizer, methods, contexts, args.text, args.chunk)


if __name__ == "__main__":
    main()
