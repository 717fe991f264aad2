"""Teacher-forced fidelity: a method's logits over real text against the plain
cache's, per context length (mean / p99 KL, top-1 agreement, perplexity delta,
bytes held)."""

import hashlib
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from ..atomic_json import write_json
from ..prompt_cache import model_identity
from .methods import SINK, cache_bytes, make_caches, method_bits
from .runner import Progress, for_model, kl, log_softmax, pyplot, tokens

NAME = "fidelity"
HELP = "teacher-forced KL / top-1 / perplexity vs the plain cache"


def add_arguments(p):
    p.add_argument(
        "--methods",
        default="kivi2,rot2,norm2,kvarn2,oracle2,affine2,mlxq2,konly2,vonly2,"
        "kivi4,rot4,norm4,kvarn4,oracle4,affine4,mlxq4",
    )
    p.add_argument("--contexts", default="512,1024,2048,4096")
    p.add_argument(
        "--text",
        default="topics",
        help="topics (CPython pydoc_data/topics.py), licenses, or a file",
    )
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument(
        "--state",
        default=None,
        metavar="DIR",
        help="keep the run's state (every method's caches and metrics so far) in this folder "
        f"every {STATE_EVERY // 60} minutes; the same command resumes from it after a stop "
        "(long contexts on large models)",
    )


def run(args, model, tokenizer, methods, meta_md):
    """(result for the json, markdown, plot drawer) of one CLI run."""
    contexts = sorted(int(c) for c in args.contexts.split(","))
    res = fidelity(
        model,
        tokenizer,
        methods,
        contexts,
        args.text,
        args.chunk,
        args.attention,
        state=args.state and RunState(args.state, model_identity(args.model, model, tokenizer)),
    )
    return res, markdown(res, meta_md), lambda folder: plots(res, folder)


def fidelity(
    model,
    tokenizer,
    methods,
    contexts,
    source="topics",
    chunk=256,
    attention_mode="dequant",
    sink=SINK,
    ids=None,
    state=None,
):
    """Teacher-forced metrics per method and context length.

    One run of max(contexts) tokens per method: attention is causal and chunk
    boundaries are the same, so the logits at positions < L equal those of an
    L-token run. Positions p >= sink count (predicting token p+1). Seconds per
    method: its own model calls and metrics, summed over the chunks. ids: the
    token ids to run (default: the start of `source`). state: a RunState the run
    saves to every STATE_EVERY seconds and resumes from.
    """
    L = max(contexts)
    ids = tokens(tokenizer, source, L) if ids is None else list(ids[:L])
    targets = mx.array(ids[1:] + [0])
    names = ["fp"] + [m for m in methods if m != "fp"]
    # Every method's caches advance one chunk at a time, the plain cache's first:
    # only one chunk of reference log-probs is held (a 262K vocabulary's 4K tokens
    # would take 4 GiB), and each method's numbers are those of its own run.
    caches = {name: make_caches(model, name) for name in names}
    views = {name: for_model(caches[name], attention_mode) for name in names}
    per_pos = {name: {"kl": [], "agree": [], "nll": []} for name in names}
    bytes_at = {name: {} for name in names}
    seconds = dict.fromkeys(names, 0.0)
    x = mx.array(ids)[None]
    # Chunks of `chunk` tokens, a context that falls inside one ending it early: the
    # bytes at a context are read where a chunk ends.
    ends = sorted(set(range(chunk, L, chunk)) | set(contexts))
    bar = Progress(len(names) * len(ends), "chunks x methods")
    settings = {
        "ids": hashlib.sha256(np.array(ids, np.int64).tobytes()).hexdigest(),
        "methods": names,
        "contexts": sorted(contexts),
        "chunk": chunk,
        "attention": attention_mode,
        "sink": sink,
    }
    done = 0  # chunks run
    if state is not None:
        saved = state.load(settings)
        if saved is not None:
            done, caches, per_pos, bytes_at, seconds = saved
            views = {name: for_model(caches[name], attention_mode) for name in names}
            bar.step(done * len(names))
    saved_at = time.time()
    for i, (s, e) in enumerate(zip([0, *ends], ends)):
        if i < done:
            continue
        if state is not None and i > done and time.time() - saved_at > STATE_EVERY:
            state.save(settings, i, caches, per_pos, bytes_at, seconds)
            saved_at = time.time()
        lp_ref = top_ref = None
        for name in names:
            t0 = time.time()
            lp = log_softmax(model(x[:, s:e], cache=views[name])[0])
            if name == "fp":
                lp_ref, top_ref = lp, mx.argmax(lp, axis=-1)
            n = lp.shape[0]
            k = kl(lp_ref, lp)
            a = mx.argmax(lp, axis=-1) == top_ref
            t = -mx.take_along_axis(lp, targets[s : s + n, None], axis=-1)[:, 0]
            mx.eval(k, a, t, lp_ref, top_ref)
            for key, v in (("kl", k), ("agree", a), ("nll", t)):
                per_pos[name][key].append(np.array(v))
            if s + n in contexts:
                bytes_at[name][s + n] = cache_bytes(caches[name])
            seconds[name] += time.time() - t0
            bar.step()
    per_pos = {
        name: {key: np.concatenate(v) for key, v in d.items()} for name, d in per_pos.items()
    }
    del caches, views
    if state is not None:
        state.clear()

    rows = []
    for Lc in sorted(contexts):
        sel = slice(sink, Lc - 1)  # predicting tokens sink+1 .. Lc-1
        ppl_fp = float(np.exp(per_pos["fp"]["nll"][sel].mean()))
        for name in per_pos:
            p = per_pos[name]
            kls = np.maximum(p["kl"][sel].astype(np.float64), 0)
            ppl = float(np.exp(p["nll"][sel].mean()))
            b = bytes_at[name].get(Lc, {})
            rows.append(
                {
                    "method": name,
                    "bits_kv": method_bits(name),
                    "context": Lc,
                    "kl_mean": float(kls.mean()),
                    "kl_p99": float(np.percentile(kls, 99)),
                    "top1_agree": float(p["agree"][sel].mean()),
                    "ppl": ppl,
                    "ppl_delta": ppl - ppl_fp,
                    "bytes": b.get("bytes"),
                    "fp16_bytes": bytes_at["fp"][Lc]["fp16_bytes"],
                    "growing_bytes": b.get("growing_bytes"),
                    "bits_per_quantized_element": b.get("bits_per_quantized_element"),
                }
            )
    return {
        "rows": rows,
        "seconds": seconds,
        "source": source,
        "chunk": chunk,
        "sink": sink,
        "positions": f"positions {sink}..L-2 (predicting tokens {sink + 1}..L-1)",
    }


STATE_EVERY = 600  # seconds between saves of a run's state (--state)


class StateError(ValueError):
    """A --state folder this run cannot use."""


class RunState:
    """A fidelity run's state in a folder of its own files: per method, its caches as a
    prompt-cache file (mlx-lm's save_prompt_cache, which KVarN caches take part in) and
    its per-position metrics so far, and state.json naming them, the chunks run and the
    run's settings. Each save writes new files, then state.json atomically, then removes
    the previous save's files: a stop at any point leaves one whole state. A folder
    holding another run's state is refused, not overwritten."""

    def __init__(self, folder, model_info=None):
        self.folder = Path(folder).expanduser()
        self.manifest = self.folder / "state.json"
        self.model_info = model_info  # prompt_cache.model_identity: a state is one model's
        if self.folder.exists() and not self.folder.is_dir():
            raise StateError(f"--state {folder} is a file; pass a folder (it is made if absent)")

    def _read(self):
        try:
            return json.loads(self.manifest.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise StateError(
                f"--state {self.folder}: {self.manifest.name} is unreadable ({e}); pass another "
                "folder"
            ) from None

    def load(self, settings):
        """(chunks run, caches, per-position metrics, bytes, seconds), or None if the
        folder holds no state yet."""
        m = self._read()
        if m is None:
            return None
        if (
            m.get("settings") != json.loads(json.dumps(settings))
            or m.get("model") != self.model_info
        ):
            raise StateError(
                f"--state {self.folder} holds the state of another run (other model, text, "
                "methods, contexts, chunk or attention); pass another folder, or remove that one"
            )
        caches, per_pos = {}, {}
        for name, files in m["files"].items():
            caches[name] = load_prompt_cache(str(self.folder / files["caches"]))
            with np.load(self.folder / files["metrics"]) as z:
                per_pos[name] = {key: [z[key]] for key in ("kl", "agree", "nll")}
        bytes_at = {name: {int(c): b for c, b in d.items()} for name, d in m["bytes_at"].items()}
        return m["chunks"], caches, per_pos, bytes_at, m["seconds"]

    def save(self, settings, chunks, caches, per_pos, bytes_at, seconds):
        self.folder.mkdir(parents=True, exist_ok=True)
        old = self._read()
        files = {}
        for i, name in enumerate(caches):
            stem = f"{chunks}-{i}"
            files[name] = {"caches": f"{stem}.safetensors", "metrics": f"{stem}.npz"}
            save_prompt_cache(str(self.folder / files[name]["caches"]), caches[name])
            np.savez(
                self.folder / files[name]["metrics"],
                **{key: np.concatenate(v) for key, v in per_pos[name].items()},
            )
        write_json(
            self.manifest,
            {
                "settings": settings,
                "model": self.model_info,
                "chunks": chunks,
                "files": files,
                "bytes_at": bytes_at,
                "seconds": seconds,
            },
        )
        if old is not None:
            self._remove(old)

    def clear(self):
        """Remove the state (the run finished): its files, then the folder if empty."""
        m = self._read()
        if m is not None:
            self._remove(m)
            self.manifest.unlink()
        try:
            self.folder.rmdir()
        except OSError:
            pass  # absent, or holds files that are not ours

    def _remove(self, manifest):
        for files in manifest["files"].values():
            for f in files.values():
                (self.folder / f).unlink(missing_ok=True)


def markdown(res, meta_md):
    out = [
        f"# Fidelity (teacher-forced, text: {res['source']})\n",
        meta_md,
        f"\nPrefill in {res['chunk']}-token chunks (each chunk attends to tiles quantized before "
        f"it). Metrics over {res['positions']}; KL = KL(p_fp || p_method) per position in nats. "
        "Bytes: measured held K/V arrays of all layers at that context (sink and tail in the "
        "model's dtype, float32 here); ratio = a 2-byte fp16 KVCache's bytes / measured bytes. "
        "bits/elt: codes + scales per element stored in quantized tiles (for K-only / V-only: "
        "of the quantized side).\n",
    ]
    for Lc in sorted({r["context"] for r in res["rows"]}):
        out.append(f"\n## Context {Lc}\n")
        out.append(
            "| method | K/V bits | KL mean | KL p99 | top-1 agree | ppl | ppl delta | bytes | vs "
            "fp16 | bits/elt |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in res["rows"]:
            if r["context"] != Lc:
                continue
            ratio = f"{r['fp16_bytes'] / r['bytes']:.2f}x" if r["bytes"] else ""
            be = f"{r['bits_per_quantized_element']:.2f}" if r["bits_per_quantized_element"] else ""
            out.append(
                f"| {r['method']} | {r['bits_kv']} | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} | "
                f"{r['top1_agree']:.3f} | {r['ppl']:.3f} | {r['ppl_delta']:+.3f} | "
                f"{r['bytes'] or ''} | {ratio} | {be} |"
            )
    out.append(
        "\nSeconds per method (whole run): "
        + ", ".join(f"{k} {v:.0f}" for k, v in res["seconds"].items())
    )
    return "\n".join(out) + "\n"


def plots(res, outdir):
    plt = pyplot()
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
            ax.plot(
                [r["context"] for r in rr], [max(r["kl_mean"], 1e-6) for r in rr], "o-", label=m
            )
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="context (tokens)",
            ylabel="mean KL to fp (nats)",
            title=f"{bits}-bit codes (first side)",
        )
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
    ax.plot(
        ctx,
        [allrows[0]["fp16_bytes"] * c / allrows[0]["context"] / 2**20 for c in ctx],
        "k--",
        label="fp16 KVCache",
    )
    ax.set(xlabel="context (tokens)", ylabel="KV cache MiB (measured)", title="memory vs context")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(outdir / "memory_vs_context.png")
    fig.savefig(files[-1], dpi=110)
    plt.close("all")
    return files
