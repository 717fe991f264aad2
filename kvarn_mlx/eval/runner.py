"""What every experiment shares: text and tokens, chunked runs, metadata,
progress, and writing the json / markdown / plots of a run."""

import contextlib
import glob
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache

from ..cache import KVarNCache
from ..mlx_lm_private import BaseCache


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total, label):
        self.total, self.label, self.n, self.t0 = total, label, 0, time.time()

    def step(self, k=1):
        self.n += k
        w = 24
        f = int(w * self.n / max(self.total, 1))
        dt = time.time() - self.t0
        eta = dt / self.n * (self.total - self.n) if self.n else 0
        sys.stderr.write(
            f"\r{self.label:<14} [{'#' * f}{'.' * (w - f)}] {self.n}/{self.total} {dt:5.0f}s eta "
            f"{eta:4.0f}s"
        )
        if self.n >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def load_text(source):
    """ "topics" (CPython's pydoc_data/topics.py), "licenses" (/usr/share/common-licenses, Debian)
    or a file."""
    if source == "topics":
        import pydoc_data.topics

        return Path(pydoc_data.topics.__file__).read_text()
    if source == "licenses":
        files = sorted(
            {
                os.path.realpath(p)
                for p in glob.glob("/usr/share/common-licenses/*")
                if os.path.isfile(p)
            }
        )
        if not files:
            raise ValueError(
                "text 'licenses' reads /usr/share/common-licenses, which is not on this system; "
                "use --text topics or a file"
            )
        return "\n\n".join(Path(p).read_text(errors="replace") for p in files)
    return Path(source).read_text()


def tokens(tokenizer, source, n):
    """The first n token ids of the text."""
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


def log_softmax(x):
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def kl(lp_ref, lp):
    """KL(p_ref || p) over the last axis, from log-probabilities (log_softmax)."""
    return (mx.exp(lp_ref) * (lp_ref - lp)).sum(axis=-1)


def metadata(model_name, command=None):
    """Model, command, versions, machine and date of a run."""
    import mlx_lm

    try:
        rev = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
            ).stdout.strip()
            or None
        )
    except OSError:
        rev = None
    mem = None
    with contextlib.suppress(OSError, ValueError):
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    blas = None
    with contextlib.suppress(OSError):
        blas = "openblas" in Path("/proc/self/maps").read_text()
    return {
        "model": model_name,
        "command": command,
        "versions": {
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "kvarn_mlx_git": rev,
        },
        "machine": {
            "system": platform.platform(),
            "processor": platform.machine(),
            "cpus": os.cpu_count(),
            "memory_gib": mem,
            "device": str(mx.default_device()),
        },
        "openblas_preloaded": blas,
        "ld_preload": os.environ.get("LD_PRELOAD"),
        # OpenBLAS's idle threads spin (OPENBLAS_THREAD_TIMEOUT) on the cores other CPU streams use
        "blas_env": {
            k: v for k, v in os.environ.items() if k.startswith(("OPENBLAS_", "OMP_NUM_THREADS"))
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def meta_markdown(meta):
    v, m = meta["versions"], meta["machine"]
    return (
        f"Model: {meta['model']}  \nCommand: `{meta['command']}`  \n"
        f"mlx {v['mlx']}, mlx-lm {v['mlx_lm']}, numpy {v['numpy']}, python {v['python']}, "
        f"kvarn_mlx {v['kvarn_mlx_git']}  \nMachine: {m['system']}, {m['cpus']} cpus, "
        f"{m['memory_gib']} GiB, {m['device']}; OpenBLAS preloaded: "
        f"{meta['openblas_preloaded']}{_blas_env(meta)}  \nDate: {meta['date']}\n"
    )


def _blas_env(meta):
    env = meta.get("blas_env") or {}
    return "".join(f", {k}={v}" for k, v in sorted(env.items()))


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None (one line on stderr) if not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return None


def jsonable(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def write_results(out, stem, tag, meta, result, markdown, draw):
    """Write <stem><tag>.md and .json into out, with the plots draw(folder) makes.

    Plots are drawn in a scratch folder and moved with the tag, so a tagged run
    never touches an untagged run's files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"_{tag}" if tag else ""
    scratch = Path(tempfile.mkdtemp(prefix=".plots.", dir=out))
    try:
        plots = []
        for f in draw(scratch):
            g = out / (f.stem + tag + f.suffix)
            f.replace(g)
            plots.append(g.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    markdown += "\n" + "\n".join(f"![{g}]({g})" for g in plots) + "\n"
    (out / f"{stem}{tag}.md").write_text(markdown)
    (out / f"{stem}{tag}.json").write_text(
        json.dumps(jsonable({"meta": meta, "result": result, "plots": plots}), indent=1)
    )
    print(markdown)
    print(f"wrote {out / (stem + tag)}.md, .json and {len(plots)} plot(s)", file=sys.stderr)


# -- attention -----------------------------------------------------------------

ATTENTION_MODES = ("dequant", "packed")


class Dequantized(BaseCache):
    """A quantized cache shown to the model as a plain one: update_and_fetch
    returns its keys and values dequantized, so mlx-lm's own attention
    (mx.fast.scaled_dot_product_attention) runs over them."""

    def __init__(self, cache):
        self.cache = cache

    @property
    def offset(self):
        return self.cache.offset

    def update_and_fetch(self, keys, values):
        k, v = self.cache.update_and_fetch(keys, values)
        c = self.cache
        if isinstance(c, QuantizedKVCache):
            k = mx.dequantize(*k, group_size=c.group_size, bits=c.bits)
            v = mx.dequantize(*v, group_size=c.group_size, bits=c.bits)
        return k.astype(keys.dtype), v.astype(values.dtype)

    def size(self):
        return self.cache.size()

    def empty(self):
        return self.cache.empty()

    def make_mask(self, *args, **kwargs):
        return self.cache.make_mask(*args, **kwargs)


def for_model(caches, mode):
    """The cache list the model runs with: in "packed" mode the caches themselves
    (KVarN caches attend through kvarn_mlx's packed attention, mlx-lm's
    QuantizedKVCache through mlx-lm's quantized attention); in "dequant" mode
    every quantized cache behind Dequantized (the same numbers up to float
    rounding, and faster on CPU) except an "auto" KVarN cache (needs_queries)."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode {mode!r}: use one of {ATTENTION_MODES}")
    if mode == "packed":
        return caches
    return [
        Dequantized(c)
        if isinstance(c, (KVarNCache, QuantizedKVCache)) and not needs_queries(c)
        else c
        for c in caches
    ]


def needs_queries(cache):
    """An "auto" KVarN cache chooses its key rotation from the step's queries, which only
    the packed path hands it: it attends through that path in either mode."""
    return isinstance(cache, KVarNCache) and cache.config.rotate_keys == "auto"


def reusable(saved, wanted):
    """Whether a checkpoint row made with settings `saved` serves a run with settings
    `wanted`: the same settings apart from "methods", of which it holds every wanted one."""

    def rest(settings):
        return {k: v for k, v in settings.items() if k != "methods"}

    return rest(saved) == rest(wanted) and set(wanted["methods"]) <= set(saved["methods"])


class CheckpointError(ValueError):
    """A --checkpoint file that is not one an eval wrote."""


_ROW_START = '{"settings": '  # how every row an eval appends begins (json.dumps order)


def read_checkpoint(path):
    """The rows of an eval's --checkpoint file (a JSON object with "settings" a line);
    [] when there is none. A line cut short (a run stopped while writing it) is left
    out; any other line that is not a row refuses the file, so that nothing is ever
    appended to a file the evals did not write."""
    if not path:
        return []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    except UnicodeDecodeError:
        text = None
    rows = []
    for i, line in enumerate(text.splitlines() if text is not None else [None]):
        if line is not None and not line.strip():
            continue
        try:
            row = json.loads(line)
        except (TypeError, ValueError):
            row = None
        if isinstance(row, dict) and isinstance(row.get("settings"), dict):
            rows.append(row)
        elif row is None and line is not None and line.startswith(_ROW_START):
            continue  # torn
        else:
            raise CheckpointError(
                f"--checkpoint {path}: line {i + 1} is not a row of a python -m kvarn_mlx.eval "
                "checkpoint; pass a new file (or the one an earlier run of this experiment wrote)"
            )
    return rows


def append_checkpoint(path, row):
    """Append one row (a dict with "settings" first) as a line, ending a line a stopped
    run left cut short first."""
    with open(path, "ab+") as f:
        if f.seek(0, os.SEEK_END):
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(row) + "\n").encode())
