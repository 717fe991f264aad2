"""python -m kvarn_mlx.plan: how much context fits in memory, per KV cache.

For a model (its config.json and its weight files' sizes; the weights are never
read) and a memory budget, prints the weights' bytes, the KV cache's bytes per
token and the longest context that fits, for mlx-lm's plain cache, its 8- and
4-bit QuantizedKVCache and each KVarN preset. `--context N` says which fit N tokens.

Bytes come from the caches themselves. The model's mlx-lm class is built lazily
(no weight is computed or allocated) to make its prompt cache and push one token
through it: that gives every layer's cache class, kv heads, head dims and dtype.
Small caches of those classes and shapes are then filled and asked for nbytes
(shapes fix nbytes, so nothing is computed either), and the caches' growth rules
carry the bytes to any context:
  KVCache, QuantizedKVCache  room added `step` (256) tokens at a time: up to
                             step - 1 tokens of room
  RotatingKVCache            at most the window while decoding; while a prompt
                             longer than the window is prefilled, window - 1 plus
                             one prefill chunk
  KVarNCache                 the sink, the tiles plus up to step_tiles - 1 tiles of
                             room, and a tail buffer rounded up to tail_step tokens
  other (recurrent) caches   the fixed state the model made for one token
Room depends on the order the tokens came in (prompt chunks, decode steps); the
planner counts the most any order leaves, so a context that "fits" fits whatever
the prompt's length.
"""

import argparse
import json
import logging
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from .cache import KVarNCache
from .config import PRESETS

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
MLX_KV_BITS = (8, 4)
MLX_KV_GROUP_SIZE = 64  # mlx_lm.generate's --kv-group-size default
PREFILL_STEP_SIZE = 2048  # mlx_lm.generate's prefill_step_size default
# Activations of a prefill chunk and the runtime: a stated allowance, not a
# measurement (override with --overhead). It does not grow with the context.
DEFAULT_OVERHEAD = "1GiB"


class PlanError(ValueError):
    pass


# -- sizes -----------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text):
    """'24GB', '24G', '24GiB', '512MB', '1e9' -> bytes. K/M/G/T are powers of 1024
    (a "24GB" Mac has 24 x 2^30 bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if not m:
        raise PlanError(f"cannot read {text!r} as a size; write e.g. 24GB, 1.5GiB or 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def human(n):
    """Bytes as B/KiB/MiB/GiB/TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def machine_budget():
    """(bytes, where they come from): on a Mac, Metal's working-set limit for the
    GPU (what MLX can keep resident); elsewhere the machine's RAM."""
    if mx.metal.is_available():
        info = mx.device_info()
        limit, ram = info["max_recommended_working_set_size"], info["memory_size"]
        return limit, (f"this Mac's GPU working-set limit ({limit / ram:.0%} of {human(ram)} unified memory; "
                       "macOS lets the GPU wire about 2/3-3/4 of it by default)")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram, "this machine's RAM"


# -- the model: config and weight sizes ------------------------------------------------


@dataclass
class ModelInfo:
    name: str
    config: dict
    weights_bytes: int | None  # None: count the model's parameters
    weights_source: str


def _weight_files(names):
    """The .safetensors files mlx-lm loads (model*.safetensors), or all of them."""
    st = [n for n in names if n.endswith(".safetensors")]
    return [n for n in st if Path(n).name.startswith("model")] or st


def read_folder(path, name=None):
    """A local folder with config.json; without .safetensors files the weights'
    bytes are counted from the model's parameters."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise PlanError(f"{path} has no config.json; pass a model folder, a Hugging Face repo id, or omit --model")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise PlanError(f"{path / 'config.json'} is not valid JSON: {e}") from e
    files = _weight_files([p.name for p in path.iterdir()])
    if not files:
        return ModelInfo(name or str(path), config, None, "counted from the model's parameters: no .safetensors files")
    size = sum((path / f).stat().st_size for f in files)
    return ModelInfo(name or str(path), config, size, f"{len(files)} .safetensors file(s) in {path}")


def read_hub(repo):
    """config.json and the weight files' sizes of a Hugging Face repo (not the weights);
    falls back to a copy in the local Hugging Face cache when the Hub cannot be reached."""
    from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        config = json.loads(Path(hf_hub_download(repo, "config.json")).read_text())
        info = HfApi().model_info(repo, files_metadata=True)
    except GatedRepoError as e:
        raise PlanError(f"{repo} is gated on the Hugging Face Hub: accept its terms on the website and log in "
                        "with `hf auth login`") from e
    except RepositoryNotFoundError as e:
        raise PlanError(f"no model {repo} on the Hugging Face Hub and no local folder {repo}") from e
    except Exception as e:  # offline mode, DNS, connection and HTTP errors of any hub client version
        cached = try_to_load_from_cache(repo, "config.json")
        if isinstance(cached, str):
            try:
                return read_folder(Path(cached).parent, repo)
            except PlanError:
                pass
        raise PlanError(
            f"could not read {repo}'s config.json and file sizes from the Hugging Face Hub (no network?) "
            f"[{type(e).__name__}: {e}], and no downloaded copy is cached. Pass a local model folder that has "
            "config.json, or omit --model to plan for the embedded default model (HF_HUB_OFFLINE=1 skips the "
            "Hub's retries)") from e
    sizes = {s.rfilename: s.size for s in info.siblings}
    files = _weight_files(list(sizes))
    if not files or any(sizes[f] is None for f in files):
        raise PlanError(f"{repo} lists no .safetensors weights with sizes on the Hugging Face Hub (mlx-lm loads only "
                        ".safetensors)")
    return ModelInfo(repo, config, sum(sizes[f] for f in files), f"{len(files)} .safetensors file(s) on the Hub")


def read_model(model=None):
    """ModelInfo for None (the embedded default), an embedded model's name
    (embedded:<key>), a local folder or a Hub repo id."""
    if model is None:
        from .loader import DEFAULT_NAME, default_model_path

        return read_folder(default_model_path(), DEFAULT_NAME)
    if Path(model).expanduser().exists():
        return read_folder(model)
    from . import loader

    try:
        path = loader.embedded_path(model)  # converted once, as generate and the server do
    except loader.ModelLoadError as e:
        raise PlanError(str(e)) from None
    if path is not None:
        return read_folder(path, path.name)
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", model):
        raise PlanError(f"no such model folder: {model}. Pass a folder with config.json, a Hugging Face repo id "
                        "(owner/name), or omit --model for the embedded default model")
    return read_hub(model)


def config_dtype(config):
    """The dtype the model computes in (and so its KV cache's), from config.json."""
    for c in (config, config.get("text_config") or {}):
        name = c.get("torch_dtype") or c.get("dtype")
        if isinstance(name, str) and name in DTYPES:
            return name
    return None


# -- the model's caches -----------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    """One cache layer of the model as mlx-lm makes it."""

    kind: str  # "kv" (KVCache), "window" (RotatingKVCache) or "state" (anything fixed-size)
    heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    dtype: str = ""
    window: int = 0
    keep: int = 0
    state_bytes: int = 0
    top_level: bool = True  # not inside a CacheList (mlx-lm's --kv-bits quantizes only top-level caches)
    cls: str = ""


def lazy_model(config, dtype):
    """The model's mlx-lm class built from its config in `dtype`. Parameters are lazy
    arrays: their shapes exist, nothing is computed or allocated."""
    from .mlx_lm_private import model_classes

    try:
        model_cls, args_cls = model_classes(config)
        model = model_cls(args_cls.from_dict(config))
    except Exception as e:
        raise PlanError(f"mlx-lm cannot build model type {config.get('model_type')!r} from this config.json: {e}") from e
    model.set_dtype(DTYPES[dtype])
    return model


def parameter_bytes(model, config):
    """Bytes of the model's parameters (quantized as config.json's "quantization" says)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    q = config.get("quantization")
    if isinstance(q, dict) and "bits" in q:
        nn.quantize(model, group_size=q.get("group_size", 64), bits=q["bits"], mode=q.get("mode", "affine"))
    params = tree_flatten(model.parameters())
    if config.get("tie_word_embeddings", True):
        # Some classes keep an lm_head until load() sees no lm_head weights (a tied head).
        params = [(k, x) for k, x in params if "lm_head" not in k.split(".")]
    return sum(x.nbytes for _, x in params)


def _flat(caches):
    """(cache, top level?) for every cache layer, CacheList members in order."""
    for c in caches:
        if isinstance(c, CacheList):
            yield from ((m, False) for m in c.caches)
        else:
            yield c, True


def model_layers(model):
    """The model's cache layers: its prompt cache after one token went through the
    model (lazily: nothing is evaluated)."""
    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    layers = []
    for c, top in _flat(caches):
        name = type(c).__name__
        if type(c) in (KVCache, RotatingKVCache):
            _, H, _, Dk = c.keys.shape
            kv = dict(heads=H, k_dim=Dk, v_dim=c.values.shape[-1], dtype=str(c.keys.dtype).split(".")[-1],
                      top_level=top, cls=name)
            if type(c) is KVCache:
                layers.append(Layer("kv", **kv))
            else:
                layers.append(Layer("window", window=c.max_size, keep=c.keep, **kv))
        elif isinstance(c, ArraysCache):
            layers.append(Layer("state", state_bytes=c.nbytes, top_level=top, cls=name))
        else:
            raise PlanError(f"the planner does not know how a {name} layer grows (it knows KVCache, RotatingKVCache "
                            "and fixed-size recurrent caches)")
    return layers


# -- bytes of one layer at n tokens, from real caches ------------------------------------


def _round_up(n, step):
    return -(-n // step) * step


@dataclass(frozen=True)
class Steps:
    """KVCache, QuantizedKVCache: room is added `step` tokens at a time, after
    cutting the buffer back to the tokens held; a chunk that arrives off a step
    boundary (a second prompt, a decode step after it) leaves up to step - 1 tokens of room."""

    token_bytes: int
    step: int

    per_token = property(lambda self: self.token_bytes)

    def peak(self, n):
        return self.token_bytes * (n + self.step - 1) if n else 0


@dataclass(frozen=True)
class Window:
    """RotatingKVCache: decoding holds at most the window (room added `step` tokens
    at a time below it); a prefill chunk of L tokens past the window is appended to
    the newest window - 1 tokens, so it holds up to window - 1 + prefill tokens."""

    token_bytes: int
    window: int
    step: int
    prefill: int

    per_token = 0

    def peak(self, n):
        if n == 0:
            return 0
        return self.token_bytes * max(min(n + self.step - 1, self.window), min(n, self.window - 1 + self.prefill))


@dataclass(frozen=True)
class Tiles:
    """KVarNCache: sink tokens, tiles of `group` tokens with up to step_tiles - 1
    tiles of room, and a tail buffer of fewer than `group` tokens grown tail_step at a time."""

    sink_token_bytes: int
    tile_bytes: int
    tail_step_bytes: int
    sink: int
    group: int
    step_tiles: int
    tail_step: int

    per_token = property(lambda self: self.tile_bytes / self.group)

    def held(self, n):
        s = min(n, self.sink)
        tiles, tail = divmod(n - s, self.group)
        capacity = tiles + self.step_tiles - 1 if tiles else 0
        return s * self.sink_token_bytes + capacity * self.tile_bytes + self.tail_step_bytes * (
            _round_up(tail, self.tail_step) // self.tail_step)

    def peak(self, n):
        """The most held at any count up to n: the tail empties into a tile at every
        tile boundary, so the previous boundary's full tail may hold more than now."""
        tiles = max(0, n - self.sink) // self.group
        if tiles == 0:
            return self.held(n)
        return max(self.held(n), self.held(self.sink + tiles * self.group - 1))


@dataclass(frozen=True)
class Fixed:
    nbytes: int

    per_token = 0

    def peak(self, n):
        return self.nbytes


def _feed(cache, layer, n):
    """Append n tokens of zero keys/values of the layer's shape (lazy: nothing is
    computed) and return the bytes the cache holds."""
    dt = DTYPES[layer.dtype]
    cache.update_and_fetch(mx.zeros((1, layer.heads, n, layer.k_dim), dt),
                           mx.zeros((1, layer.heads, n, layer.v_dim), dt))
    return cache.nbytes


def steps_of(make, layer):
    """Bytes of one room step, read from two sizes of a real cache."""
    c = make()
    one = _feed(c, layer, c.step)
    two = _feed(c, layer, c.step)
    return Steps((two - one) // c.step, c.step)


def window_of(layer, prefill):
    """Bytes per token of a RotatingKVCache, read from two sizes (prompt chunks are
    concatenated without room)."""
    c = RotatingKVCache(max_size=layer.window, keep=layer.keep)
    two = _feed(c, layer, 2)
    four = _feed(c, layer, 2)
    return Window((four - two) // 2, layer.window, c.step, prefill)


def tiles_of(config, layer):
    """Sink, tile and tail bytes of a KVarNCache, read from real caches at a few sizes."""
    S, G, step = config.sink_size, config.group_size, KVarNCache.step_tiles

    def held(*chunks):
        c = KVarNCache(config)
        for n in chunks:
            b = _feed(c, layer, n)
        return b

    sink = held(S) if S else 0
    one_step = held(S + step * G)  # sink + step_tiles tiles, no room, empty tail
    two_steps = held(S + step * G, step * G)
    tail = held(S + step * G + 1) - one_step  # one tail step of room
    return Tiles(sink // S if S else 0, (two_steps - one_step) // step, tail, S, G, step, KVarNCache.tail_step)


# -- the caches compared ------------------------------------------------------------------


def byte_model(layer, kind, prefill):
    """The byte model of one layer whose cache is `kind`: "plain", mlx-lm's
    QuantizedKVCache at that many bits (an int), or a KVarNConfig."""
    if isinstance(kind, int):
        if layer.k_dim % MLX_KV_GROUP_SIZE or layer.v_dim % MLX_KV_GROUP_SIZE:
            raise ValueError(f"head dims {layer.k_dim}/{layer.v_dim} are not multiples of mlx-lm's "
                             f"KV group size {MLX_KV_GROUP_SIZE}")
        return steps_of(lambda: QuantizedKVCache(MLX_KV_GROUP_SIZE, kind), layer)
    if kind != "plain":
        try:
            return tiles_of(kind, layer)
        except ValueError as e:
            raise ValueError(f"KVarNCache raises for {layer.heads} kv heads x head dims {layer.k_dim}/"
                             f"{layer.v_dim}: {e}") from e
    if layer.kind == "kv":
        return steps_of(KVCache, layer)
    if layer.kind == "window":
        return window_of(layer, prefill)
    return Fixed(layer.state_bytes)


def _quiet_make_cache(model, preset):
    from .integration import make_cache

    log = logging.getLogger("kvarn_mlx")
    level = log.level
    log.setLevel(logging.ERROR)  # make_cache says which layers it leaves; the table shows it
    try:
        return make_cache(model, preset)
    finally:
        log.setLevel(level)


def kvarn_kinds(model, preset):
    """Per cache layer (in model_layers' order): the preset's KVarNConfig where
    make_cache puts a KVarNCache, "plain" where it leaves the layer as it is."""
    return [c.config if isinstance(c, KVarNCache) else "plain" for c, _ in _flat(_quiet_make_cache(model, preset))]


def run_fails(model, caches, then=None):
    """Why two tokens through the model with these caches raise, or None (lazy:
    nothing is computed). then(caches) runs between the tokens."""
    try:
        model(mx.array([[0]]), cache=caches)
        if then is not None:
            then(caches)
        model(mx.array([[0]]), cache=caches)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def quantize_like_mlx_lm(caches, bits):
    """mlx_lm.generate --kv-bits: top-level caches with to_quantized become
    QuantizedKVCache (leaving here, with a warning, those that cannot)."""
    for i, c in enumerate(caches):
        if hasattr(c, "to_quantized"):
            try:
                caches[i] = c.to_quantized(group_size=MLX_KV_GROUP_SIZE, bits=bits)
            except NotImplementedError:
                pass


def _mlx_quantizes_windows():
    try:
        RotatingKVCache(max_size=4).to_quantized()
    except NotImplementedError:
        return False
    return True


@dataclass
class CachePlan:
    """One cache kind for the whole model: a byte model per cache layer, in the
    order of model_layers (identical layers share one)."""

    name: str
    note: str  # what the cache is
    warning: str = None
    models: list = None
    error: str = None

    @property
    def per_token(self):
        return sum(m.per_token for m in self.models)

    def peak(self, n):
        """The most bytes the model's caches hold at any point up to n tokens."""
        return sum(m.peak(n) for m in self.models)


def _cache_plan(name, note, layers, kinds, prefill, warning=None, error=None):
    """A CachePlan from each layer's cache kind (see byte_model), or the error that
    makes the cache not applicable to this model."""
    built = {}
    if error is None:
        try:
            for key in zip(layers, kinds):
                if key not in built:
                    built[key] = byte_model(*key, prefill)
        except ValueError as e:
            error = str(e)
    if error is not None:
        return CachePlan(name, note, warning, error=error)
    return CachePlan(name, note, warning, [built[key] for key in zip(layers, kinds)])


def cache_plans(config, dtype, prefill=PREFILL_STEP_SIZE, model=None):
    """CachePlan per cache compared: plain (model dtype, and float16 if that differs),
    mlx-lm 8- and 4-bit, each KVarN preset."""
    model = model or lazy_model(config, dtype)
    layers = model_layers(model)
    plain = ["plain"] * len(layers)
    plans = [_cache_plan(f"plain ({dtype})", "mlx-lm KVCache", layers, plain, prefill)]
    if DTYPES[dtype].size != 2:
        fp16 = model_layers(lazy_model(config, "float16"))
        plans.append(_cache_plan("plain (float16)", "mlx-lm KVCache in float16", fp16, plain, prefill))

    warning = None
    if any(l.kind == "window" and l.top_level for l in layers) and not _mlx_quantizes_windows():
        warning = ("mlx-lm cannot quantize RotatingKVCache (sliding-window) layers: they are counted plain here, "
                   "but mlx_lm.generate --kv-bits stops with NotImplementedError once they reach quantized_kv_start")
    for bits in MLX_KV_BITS:
        fails = run_fails(model, make_prompt_cache(model), lambda c: quantize_like_mlx_lm(c, bits))
        kinds = [bits if l.kind == "kv" and l.top_level else "plain" for l in layers]
        plans.append(_cache_plan(f"mlx-lm {bits}-bit", f"QuantizedKVCache, group {MLX_KV_GROUP_SIZE}", layers, kinds,
                                 prefill, warning, fails and f"the model raises with mlx-lm's QuantizedKVCache ({fails})"))

    for p in PRESETS:
        fails = run_fails(model, _quiet_make_cache(model, p))
        plans.append(_cache_plan(p, "KVarNCache where make_cache puts one", layers, kvarn_kinds(model, p), prefill,
                                 error=fails and f"the model raises with this KVarN cache ({fails})"))
    return plans


# -- the plan --------------------------------------------------------------------------------


def longest_context(peak, per_token, available):
    """The most tokens n with peak(n) <= available; None when the cache stops growing."""
    if peak(1) > available:
        return 0
    if per_token == 0:
        return None if peak(2**40) <= available else _bisect(peak, available, 1, 2**40)
    lo, hi = 1, 2
    while peak(hi) <= available:
        lo, hi = hi, hi * 2
    return _bisect(peak, available, lo, hi)


def _bisect(peak, available, lo, hi):
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= available else (lo, mid)
    return lo


def describe_layers(layers):
    counts = {}
    for l in layers:
        if l.kind == "state":
            key = f"{l.cls} (fixed state)"
        else:
            shape = (f"{l.heads} kv head{'s' if l.heads > 1 else ''} x head dim {l.k_dim}"
                     + (f"/{l.v_dim}" if l.v_dim != l.k_dim else ""))
            key = (f"full attention, {shape}" if l.kind == "kv" else f"sliding window {l.window}, {shape}")
        counts[key] = counts.get(key, 0) + 1
    return f"{len(layers)} cache layers: " + "; ".join(f"{n} {k}" for k, n in counts.items())


def plan(info, budget, budget_source, overhead, context=None, dtype=None, prefill=PREFILL_STEP_SIZE):
    """Everything the CLI prints, as a dict (the --json output)."""
    dtype = dtype or config_dtype(info.config)
    dtype_note = None
    if dtype is None:
        dtype, dtype_note = "float16", "config.json names no dtype: float16 assumed (set --dtype)"
    model = lazy_model(info.config, dtype)
    layers = model_layers(model)
    plans = cache_plans(info.config, dtype, prefill, model)
    weights = info.weights_bytes
    if weights is None:
        weights = parameter_bytes(model, info.config)
    available = budget - weights - overhead
    cfg = {**(info.config.get("text_config") or {}), **info.config}
    out = {
        "model": info.name, "model_type": info.config.get("model_type"), "dtype": dtype, "dtype_note": dtype_note,
        "layers": describe_layers(layers), "max_position_embeddings": cfg.get("max_position_embeddings"),
        "weights_bytes": weights, "weights_source": info.weights_source,
        "budget_bytes": budget, "budget_source": budget_source, "overhead_bytes": overhead,
        "kv_budget_bytes": available, "prefill_step_size": prefill, "context": context, "caches": [],
    }
    for c in plans:
        row = {"cache": c.name, "note": c.note, "warning": c.warning}
        if c.error:
            out["caches"].append({**row, "error": c.error})
            continue
        row.update(bytes_per_token=c.per_token, longest_context=longest_context(c.peak, c.per_token, available))
        if context is not None:
            row.update(kv_bytes_at_context=c.peak(context), fits_context=c.peak(context) <= available)
        out["caches"].append(row)
    return out


def format_plan(p):
    ctx = p["context"]
    lines = [
        f"model      {p['model']} ({p['model_type']}, {p['dtype']})",
        f"           {p['layers']}",
        f"weights    {human(p['weights_bytes'])} ({p['weights_source']})",
        f"budget     {human(p['budget_bytes'])} ({p['budget_source']})",
        f"KV budget  {human(p['kv_budget_bytes'])} = budget - weights - {human(p['overhead_bytes'])} allowance for "
        "activations and the runtime (--overhead)",
    ]
    if p["kv_budget_bytes"] <= 0:
        lines.append("note       the weights and the allowance alone exceed the budget: no context fits")
    if p["dtype_note"]:
        lines.append(f"note       {p['dtype_note']}")
    if p["max_position_embeddings"]:
        lines.append(f"context    the model takes up to {p['max_position_embeddings']:,} tokens (max_position_embeddings)")
    lines.append("")
    head = f"{'cache':<18} {'KV bytes/token':>14} {'longest context':>16}"
    if ctx is not None:
        head += f" {f'KV at {ctx:,}':>16} {'fits':>5}"
    lines += [head, "-" * len(head)]
    warnings = []
    for r in p["caches"]:
        if "error" in r:
            lines.append(f"{r['cache']:<18} not applicable: {r['error']}")
            continue
        n = r["longest_context"]
        line = f"{r['cache']:<18} {human(r['bytes_per_token']):>14} {'no limit' if n is None else f'{n:,}':>16}"
        if ctx is not None:
            line += f" {human(r['kv_bytes_at_context']):>16} {'yes' if r['fits_context'] else 'no':>5}"
        lines.append(line)
        if r["warning"] and r["warning"] not in warnings:
            warnings.append(r["warning"])
    legend = ("KV bytes/token: what each further token adds (sliding-window and recurrent layers add nothing). "
              "Longest context: the most every cache layer can hold up to that many tokens, sink, tail buffer "
              f"and preallocated room included, with prompts prefilled in chunks of {p['prefill_step_size']:,} "
              "tokens at most. The allowance does not grow with the context: transient buffers of a long "
              "prefill that do (a chunk's attention scores where attention is not fused) are not in it.")
    lines += ["", *textwrap.wrap(legend, 100)]
    for w in warnings:
        lines += textwrap.wrap(f"note: {w}", 100, subsequent_indent="      ")
    return "\n".join(lines)


def setup_arg_parser():
    p = argparse.ArgumentParser(prog="python -m kvarn_mlx.plan",
                                description="How much context fits in memory, for the plain, mlx-lm quantized and "
                                            "KVarN KV caches.")
    p.add_argument("--model", default=None,
                   help="Local model folder (with config.json) or Hugging Face repo id; reads only config.json "
                        "and the weight files' sizes (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--memory", default=None,
                   help="Memory budget, e.g. 24GB (powers of 1024). Default: on a Mac the GPU's working-set limit, "
                        "elsewhere the machine's RAM")
    p.add_argument("--overhead", default=DEFAULT_OVERHEAD,
                   help=f"Allowance for activations, the runtime and transient buffers (default {DEFAULT_OVERHEAD})")
    p.add_argument("--context", type=int, default=None, help="Also say which caches fit this many tokens")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="The dtype the model runs in (default: config.json's)")
    p.add_argument("--prefill-step-size", type=int, default=PREFILL_STEP_SIZE,
                   help="Prompt tokens per prefill step, as in generate (sliding-window layers hold one chunk more)")
    p.add_argument("--json", action="store_true", help="Print the plan as JSON")
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    try:
        if args.context is not None and args.context < 1:
            raise PlanError(f"--context {args.context}: give a number of tokens, at least 1")
        if args.prefill_step_size < 1:
            raise PlanError(f"--prefill-step-size {args.prefill_step_size} must be at least 1")
        if args.memory is None:
            budget, source = machine_budget()
        else:
            budget, source = parse_bytes(args.memory), "from --memory"
        overhead = parse_bytes(args.overhead)
        from .loader import ModelLoadError

        try:
            info = read_model(args.model)
        except ModelLoadError as e:
            raise PlanError(str(e)) from e
        p = plan(info, budget, source, overhead, args.context, args.dtype, args.prefill_step_size)
    except PlanError as e:
        sys.exit(f"error: {e}")
    print(json.dumps(p, indent=2) if args.json else format_plan(p))


if __name__ == "__main__":
    main()
