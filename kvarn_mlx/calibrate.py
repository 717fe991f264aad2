"""python -m kvarn_mlx.calibrate: measure how much each layer of a model minds
KVarN at each key and value width, and write it as a profile (profile.py) that
make_cache(model, profile=...) turns into per-layer widths.

    python -m kvarn_mlx.calibrate --model M --out PROFILE.json

For each layer make_cache quantizes, each side (keys, values) and each width
(2, 3, 4, 5, 6, 8; and 2, 3, 4 with one-byte scales), the mean KL of the
next-token distribution to the plain cache's, teacher-forced over text that
ships with Python (the second half of CPython's pydoc_data/topics.py by
default, so the evals' text, its start, stays held apart), when only that
layer's keys (or only its values) are quantized, the "auto" key rotation
decided as the auto presets decide it.

What makes it cheap (a real measurement all the same):
- one plain pass records each layer's inputs (and the keys and values it
  caches) per chunk, and the reference log-probabilities;
- quantizing layer l changes nothing before it: a measurement replays the
  recorded inputs of layer l and runs only layers l.. (the model's own layer
  modules, masks and caches), and chunks that read no quantized tile yet run
  layer l alone (its cache, and the key-rotation choice its queries make);
- the widths and sides of one layer run as the rows of one batch;
- KL is measured on the last tokens only (--measure), after the text before
  them has filled the quantized tiles.
A model whose layers cannot be replayed this way (checked once against the
plain pass) is measured with whole passes, one per layer, side and width.
"""

import argparse
import contextlib
import hashlib
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from . import profile as profiles
from .batch_cache import BatchKVarNCache
from .cache import KVarNCache, cannot_hold
from .config import DEFAULT_PRESET, FP8_MAX_BITS, PRESETS, SUPPORTED_BITS, get_preset
from .eval.runner import Progress, kl, load_text, log_softmax
from .integration import make_cache, quantizable_layers

log = logging.getLogger("kvarn_mlx")

WIDTHS = SUPPORTED_BITS
FP8_WIDTHS = tuple(w for w in SUPPORTED_BITS if w <= FP8_MAX_BITS)
TOKENS = 1024
MEASURE = 512
CHUNK = 256
GROWTH_TOKENS = 4096
REPLAY_TOLERANCE = 1e-5  # KL of a replayed plain layer to the plain pass (float rounding only)


class OneSideCache(KVarNCache):
    """A KVarNCache whose attention reads only one side quantized: side "k" keys
    (values in full precision), side "v" values. Both sides go through the
    cache as usual (tiles, the "auto" key-rotation choice), so the quantized
    side is exactly what a KVarNCache of this config holds."""

    def __init__(self, config, side):
        super().__init__(config)
        self.side = side
        self.exact = None  # keys or values of every token, full precision

    def update_and_fetch(self, keys, values):
        x = values if self.side == "k" else keys
        self.exact = x if self.exact is None else mx.concatenate([self.exact, x], axis=2)
        return super().update_and_fetch(keys, values)

    def step_view(self):
        s = super().step_view()
        if s.tiles is None or s.n_tiles == 0:
            return s
        k, v = self.dequantized(s)
        n, S = k.shape[2], s.sink_k.shape[2]
        if self.side == "k":
            v = self.exact[..., :n, :]
        else:
            k = self.exact[..., :n, :]
        return replace(
            s,
            tiles=None,
            n_tiles=0,
            recent_k=k[..., S:, :],
            recent_v=v[..., S:, :],
            after_tile=None,
        )


def variant_config(base, side, width, fp8=False):
    """The config measuring `side` at `width` (with one-byte scales if fp8): the
    base's settings, the other side at the same width (read in full precision anyway)."""
    base = replace(base, scale_dtype="fp8") if fp8 else base
    if side == "k":
        return replace(base, k_bits=width, v_bits=width)
    return replace(base, k_bits=width, v_bits=width, rotate_keys=False)


# -- the plain pass, recorded ----------------------------------------------------------

_SLOT = object()  # where a recorded layer call passed its cache


class _Layer:
    """A model layer standing in for the original: calls fn(original, args, kwargs);
    other attributes (e.g. use_sliding, read by the model's loop) are the original's."""

    def __init__(self, inner, fn):
        self.inner, self.fn = inner, fn

    def __call__(self, *args, **kwargs):
        return self.fn(self.inner, args, kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _layer_list(model):
    """The list the model's loop reads its layers from: model.layers, or the
    inner model's list when model.layers is a fresh slice of it (pipelined models)."""
    layers = model.layers
    inner = getattr(getattr(model, "model", None), "layers", None)
    if (
        isinstance(inner, list)
        and len(inner) == len(layers)
        and all(a is b for a, b in zip(inner, layers))
    ):
        return inner
    return layers


@contextlib.contextmanager
def _layers_replaced(model, fns):
    """Within the block, model.layers[j] calls fns[j](original, args, kwargs)."""
    layers = _layer_list(model)
    originals = list(layers)
    try:
        for j, fn in fns.items():
            layers[j] = _Layer(originals[j], fn)
        yield originals
    finally:
        layers[:] = originals


def _chunks(n, chunk):
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


class Recording:
    """The plain pass over ids in chunks: per layer and chunk the layer's call
    (its cache marked), its input for the layers kept (`keep`), the keys and
    values it cached in the chunks before position `first_read`, and the
    reference log-probs of the measured chunks."""

    def __init__(self, model, ids, chunk, measured, keep, first_read):
        self.ids, self.chunks, self.measured = ids, _chunks(len(ids), chunk), measured
        n = len(model.layers)
        self.calls = [[None] * len(self.chunks) for _ in range(n)]
        self.inputs = [[None] * len(self.chunks) for _ in range(n)]
        self.kv = [[None] * len(self.chunks) for _ in range(n)]
        self.ref = {}
        caches = make_prompt_cache(model)
        self.replayable = len(caches) == n and all(
            type(c) in (KVCache, RotatingKVCache) for c in caches
        )
        at = [0]

        def record(j):
            def fn(inner, args, kwargs):
                c = caches[j]
                a = tuple(_SLOT if x is c else x for x in args)
                k = {name: _SLOT if v is c else v for name, v in kwargs.items()}
                self.replayable &= (
                    bool(args)
                    and isinstance(args[0], mx.array)
                    and (_SLOT in a or _SLOT in k.values())
                )
                if j in keep and args:
                    self.inputs[j][at[0]] = args[0]
                self.calls[j][at[0]] = ((None,) + a[1:] if a else a, k)
                return inner(*args, **kwargs)

            return fn

        for j, c in enumerate(caches):
            update = c.update_and_fetch

            def recorded_update(keys, values, j=j, update=update):
                if self.chunks[at[0]][0] < first_read:
                    self.kv[j][at[0]] = (keys, values)
                return update(keys, values)

            c.update_and_fetch = recorded_update
        x = mx.array(ids)[None]
        bar = Progress(len(self.chunks), "plain pass")
        with _layers_replaced(model, {j: record(j) for j in range(n)}):
            for i, (s, e) in enumerate(self.chunks):
                at[0] = i
                logits = model(x[:, s:e], cache=caches)
                if i in measured:
                    self.ref[i] = log_softmax(logits[0])
                mx.eval(
                    self.ref.get(i, logits),
                    [kv for kv in (r[i] for r in self.kv) if kv],
                    [x for x in (r[i] for r in self.inputs) if x is not None],
                    [_arrays(self.calls[j][i]) for j in range(n)],
                )
                bar.step()


def _arrays(x):
    if isinstance(x, mx.array):
        return [x]
    if isinstance(x, (list, tuple)):
        return [y for z in x for y in _arrays(z)]
    if isinstance(x, dict):
        return [y for z in x.values() for y in _arrays(z)]
    return []


def _rows(x, B):
    return x if B == 1 else mx.broadcast_to(x, (B, *x.shape[1:]))


def _call(layer, call, h, cache):
    args, kwargs = call
    args = (h,) + tuple(cache if a is _SLOT else a for a in args[1:])
    kwargs = {k: cache if v is _SLOT else v for k, v in kwargs.items()}
    return layer(*args, **kwargs)


def _layer_cache(row_caches):
    return row_caches[0] if len(row_caches) == 1 else BatchKVarNCache(row_caches)


def measure_replayed(model, rec, l, row_caches, first_read):
    """Mean KL over the measured chunks for each row cache at layer l (a
    KVarNCache, or a plain KVCache for a check), replaying the recorded pass."""
    B = len(row_caches)
    caches = make_prompt_cache(model)
    caches[l] = _layer_cache(row_caches)
    layers = list(model.layers)
    total, n = mx.zeros((B,)), 0
    for i, (s, e) in enumerate(rec.chunks):
        h = _rows(rec.inputs[l][i], B)
        if s < first_read:  # no position here reads a quantized tile: downstream is the plain pass
            out = _call(layers[l], rec.calls[l][i], h, caches[l])
            for j in range(l + 1, len(layers)):
                caches[j].update_and_fetch(*(_rows(x, B) for x in rec.kv[j][i]))
            mx.eval(out, [x for c in caches[l + 1 :] for x in (c.keys, c.values)])
            continue
        for j in range(l, len(layers)):
            h = _call(layers[j], rec.calls[j][i], h, caches[j])
        if i in rec.measured:
            total = total + mx.stack(
                [
                    kl(rec.ref[i], log_softmax(_head(model, rec.ids[s:e], h[b : b + 1])[0])).sum()
                    for b in range(B)
                ]
            )
            n += e - s
        mx.eval(h, total)
    return np.array(total / max(n, 1)).tolist()


def _head(model, ids, h):
    """The model's logits for hidden states h [1, L, hidden] leaving its last layer
    (its final norm and output head, as the model applies them)."""
    with _layers_replaced(model, {j: (lambda inner, a, k: h) for j in range(len(model.layers))}):
        return model(mx.array(ids)[None], cache=None)


def measure_whole(model, rec, l, cache):
    """Mean KL over the measured chunks with `cache` at layer l: whole passes."""
    caches = make_prompt_cache(model)
    caches[l] = cache
    x = mx.array(rec.ids)[None]
    total, n = mx.array(0.0), 0
    for i, (s, e) in enumerate(rec.chunks):
        logits = model(x[:, s:e], cache=caches)
        if i in rec.measured:
            total = total + kl(rec.ref[i], log_softmax(logits[0])).sum()
            n += e - s
        mx.eval(total, logits)
    return total.item() / max(n, 1)


# -- calibration -----------------------------------------------------------------------


def calibration_tokens(tokenizer, source, start, n):
    """n token ids of the text `source` from character `start` (None: its middle)."""
    text = load_text(source)
    start = len(text) // 2 if start is None else start
    ids, chars = [], 8 * n
    while True:
        ids = tokenizer.encode(text[start : start + chars])
        if len(ids) > n or start + chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise ValueError(
            f"text {source!r} from character {start} has only {len(ids)} tokens; need {n}"
        )
    return ids[:n], start


def calibrate(
    model,
    tokenizer,
    *,
    source="topics",
    start=None,
    tokens=TOKENS,
    measure=MEASURE,
    chunk=CHUNK,
    widths=WIDTHS,
    fp8_widths=FP8_WIDTHS,
    base=DEFAULT_PRESET,
    batch=12,
    replay=True,
    identity=None,
    checkpoint=None,
):
    """The profile (a dict, profile.py's format) of this model. checkpoint: a file that
    each measurement is appended to as it is made, and that a run with the same model,
    text and settings takes its measurements from (an interrupted calibration resumes)."""
    base = get_preset(base)
    widths, fp8_widths = sorted(set(widths)), sorted(set(fp8_widths))
    if not widths or any(w not in SUPPORTED_BITS for w in widths):
        raise ValueError(f"widths {widths}: use some of {SUPPORTED_BITS}")
    if any(w not in FP8_WIDTHS for w in fp8_widths):
        raise ValueError(f"fp8 widths {fp8_widths}: use some of {FP8_WIDTHS} (or none)")
    if fp8_widths and base.scale_dtype == "fp8":
        fp8_widths = []  # the widths themselves are measured with one-byte scales
    G, S = base.group_size, base.sink_size
    first_read = S + G  # the first token position whose chunk can read a quantized tile
    if chunk < 32:
        raise ValueError(
            f"--chunk {chunk}: use at least 32 (shorter steps are decoding steps to the cache)"
        )
    if not 0 < measure <= tokens - first_read:
        raise ValueError(
            f"--measure {measure}: between 1 and --tokens minus {first_read} "
            f"(the sink and the first tile, {tokens - first_read} here)"
        )
    ids, start = calibration_tokens(tokenizer, source, start, tokens)
    t0 = time.time()
    layers, shapes = quantizable_layers(model)
    if not layers:
        raise ValueError(
            "this model has no layer make_cache quantizes (plain KVCache layers): nothing to "
            "calibrate"
        )
    make_cache(model, base)  # turns the packed-attention patch on
    chunks = _chunks(tokens, chunk)
    measured = {i for i, (s, e) in enumerate(chunks) if e > tokens - measure}
    measure_from = chunks[min(measured)][0]
    rec = Recording(model, ids, chunk, measured, set(layers), first_read)
    mode = "replay" if replay and rec.replayable else "whole"
    if mode == "replay":
        l = layers[len(layers) // 2]
        try:
            err = measure_replayed(model, rec, l, [KVCache()], first_read)[0]
        except Exception as e:  # a model whose layers take more than the replay passes
            err = f"{type(e).__name__}: {e}"
        if not (isinstance(err, float) and err <= REPLAY_TOLERANCE):
            log.warning(
                "calibrate: replaying this model's layers does not reproduce its plain pass "
                f"({err}); measuring with whole passes (slower)"
            )
            mode = "whole"
    variants = []  # (layer, side, fp8, width, config or None when the layer cannot hold it)
    for l in layers:
        _, D, _, _ = shapes[l]
        for fp8, ws in ((False, widths), (True, fp8_widths)):
            for side in profiles.SIDES:
                for w in ws:
                    cfg = variant_config(base, side, w, fp8)
                    variants.append((l, side, fp8, w, None if cannot_hold(cfg, D, D) else cfg))
    results = {l: {} for l in layers}  # layer -> profiles.side_key -> {width: KL}
    for l, side, fp8, w, _ in variants:
        results[l].setdefault(profiles.side_key(side, fp8), {})[str(w)] = None
    run = {
        "fingerprint": profiles.fingerprint(model),
        "text_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
        "measured_from": measure_from,
        "chunk": chunk,
        "settings": {k: getattr(base, k) for k in profiles.SETTINGS},
    }
    done = read_checkpoint(checkpoint, run)
    if checkpoint and Path(checkpoint).exists():  # after a torn line, start a new one
        with open(checkpoint, "rb+") as f:
            size = f.seek(0, 2)
            if size:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    f.write(b"\n")
    todo, resumed = [], 0
    for v in variants:
        l, side, fp8, w, cfg = v
        kl = done.get((l, profiles.side_key(side, fp8), str(w)))
        if kl is not None:
            results[l][profiles.side_key(side, fp8)][str(w)] = kl
            resumed += 1
        elif cfg is not None:
            todo.append(v)
    if resumed:
        log.info(f"calibrate: {resumed} measurements taken from the checkpoint {checkpoint}")
    bar = Progress(len(todo), "measurements")
    for l in layers:
        mine = [v for v in todo if v[0] == l]
        for k in range(0, len(mine), batch if mode == "replay" else 1):
            group = mine[k : k + batch]
            rows = [OneSideCache(cfg, side) for _, side, _, _, cfg in group]
            if mode == "replay":
                kls = measure_replayed(model, rec, l, rows, first_read)
            else:
                kls = [measure_whole(model, rec, l, rows[0])]
            lines = []
            for (_, side, fp8, w, _), kl in zip(group, kls):
                key = profiles.side_key(side, fp8)
                results[l][key][str(w)] = max(0.0, float(kl))
                lines.append({"run": run, "layer": l, "side": key, "width": str(w), "kl": kl})
            if checkpoint:
                with open(checkpoint, "a") as f:
                    f.write("".join(json.dumps(x) + "\n" for x in lines))
            bar.step(len(group))
    identity = dict(identity or {})
    identity["fingerprint"] = run["fingerprint"]
    identity.setdefault("model_layers", str(len(make_prompt_cache(model))))
    return {
        "format": profiles.FORMAT,
        "format_version": profiles.FORMAT_VERSION,
        "model": identity,
        "text": {
            "source": source,
            "start_char": start,
            "tokens": tokens,
            "sha256": run["text_sha256"],
            "measured_positions": [measure_from, tokens - 1],
            "chunk": chunk,
        },
        "settings": run["settings"],
        "widths": widths,
        "fp8_widths": fp8_widths,
        "kl": "mean KL(plain || this) in nats per measured position, "
        "only this layer's side quantized (k_fp8, v_fp8: with one-byte scales)",
        "layers": [{"layer": l, **results[l]} for l in layers],
        "mode": mode,
        "seconds": round(time.time() - t0, 1),
        **({"resumed_measurements": resumed} if resumed else {}),
    }


def growth_presets(settings, base):
    """The presets whose growth a profile measures: base, and the narrowest preset
    with the profile's settings (its widths the narrowest a mix goes near)."""
    same = [
        name
        for name, c in PRESETS.items()
        if profiles.settings_config(settings, c.k_bits, c.v_bits) == c
    ]
    narrow = min(same, key=lambda n: PRESETS[n].k_bits + PRESETS[n].v_bits, default=base)
    return list(dict.fromkeys([base, narrow]))


def check_growth_tokens(tokens, n):
    """Refuse a growth run that does not go past the calibration's n tokens, where it starts."""
    if tokens <= n:
        raise ValueError(
            f"--growth-tokens {tokens}: use more than the calibration's {n:,} tokens, e.g. {4 * n}"
        )


def measure_growth(model, tokenizer, p, base, tokens=GROWTH_TOKENS, chunk=CHUNK):
    """How the mean KL of whole caches grows with the context on profile p's
    calibration text: each growth preset's mean KL over positions 128..L-2 (as
    the evals measure it) at the calibration's length, its doublings and `tokens`
    (one run of `tokens`: the shorter lengths cost nothing more), every layer
    quantized, packed attention. mix.predict scales a mix's summed KL by it."""
    from .eval.fidelity import fidelity

    base_config = profiles.settings_config(p["settings"], 2, 2)
    G, S = base_config.group_size, base_config.sink_size
    n = p["text"]["tokens"]  # where mix.predict's scaling starts
    check_growth_tokens(tokens, n)
    lengths = [n << i for i in range(tokens.bit_length()) if n << i < tokens] + [tokens]
    contexts = sorted({c for c in lengths if c > S + G})
    text = p["text"]
    ids, start = calibration_tokens(tokenizer, text["source"], text["start_char"], tokens)
    names = growth_presets(p["settings"], base)
    t0 = time.time()
    res = fidelity(model, tokenizer, names, contexts, text["source"], chunk, "packed", ids=ids)
    return {
        "what": "mean KL(plain || this) over "
        + res["positions"]
        + ", every layer quantized, packed attention",
        "source": text["source"],
        "start_char": start,
        "tokens": tokens,
        "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
        "chunk": chunk,
        "presets": {
            name: {str(r["context"]): r["kl_mean"] for r in res["rows"] if r["method"] == name}
            for name in names
        },
        "seconds": round(time.time() - t0, 1),
    }


def read_checkpoint(path, run):
    """{(layer, side key, width): KL} of the measurements a checkpoint holds for this
    run (model, text and settings); {} for a missing file. A file that is not a
    calibration checkpoint is refused, and a torn line (a run killed while writing
    it) is left out."""
    if not path:
        return {}
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return {}
    want = json.loads(json.dumps(run))
    done = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            key = (int(row["layer"]), str(row["side"]), str(row["width"]))
            kl = max(0.0, float(row["kl"]))
            same = row["run"] == want
        except (ValueError, KeyError, TypeError):
            if line.startswith('{"run": '):
                continue  # torn: the line being written when a run stopped
            raise ValueError(
                f"{path}: line {i + 1} is not a calibration checkpoint's; pass a new file "
                "(or the one an earlier calibration of this model wrote)"
            ) from None
        if same:
            done[key] = kl
    return done


def setup_arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m kvarn_mlx.calibrate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--model",
        default=None,
        help="MLX model folder, HF repo or embedded:NAME "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--out", required=True, help="the profile to write (JSON)")
    p.add_argument(
        "--text",
        default="topics",
        help="topics (CPython's pydoc_data/topics.py, default), or a file",
    )
    p.add_argument(
        "--text-start",
        type=int,
        default=None,
        help="character of the text to start at (default: its middle)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=TOKENS,
        help=f"tokens of text run through the model (default {TOKENS})",
    )
    p.add_argument(
        "--measure",
        type=int,
        default=MEASURE,
        help=f"KL is averaged over the last this many tokens, whole chunks (default {MEASURE})",
    )
    p.add_argument(
        "--chunk", type=int, default=CHUNK, help=f"prefill chunk (default {CHUNK}, as the evals)"
    )
    p.add_argument(
        "--widths", default=",".join(map(str, WIDTHS)), help="widths to measure (default all)"
    )
    p.add_argument(
        "--fp8-widths",
        default=",".join(map(str, FP8_WIDTHS)),
        help="widths to measure with one-byte (e4m3) scales as well, which lets a mix store some "
        "layers for less and widen others (default 2,3,4; empty for none)",
    )
    p.add_argument(
        "--base",
        default=DEFAULT_PRESET,
        help=f"the preset whose other settings (tile size, sink, key rotation) the widths use "
        f"(default {DEFAULT_PRESET})",
    )
    p.add_argument(
        "--batch", type=int, default=12, help="measurements run together as one batch (default 12)"
    )
    p.add_argument(
        "--growth-tokens",
        type=int,
        default=GROWTH_TOKENS,
        help="then run this many tokens of the text with every layer quantized (two presets) "
        "to measure how the KL grows with the context, which the predictions use "
        f"(default {GROWTH_TOKENS}; 0: none)",
    )
    p.add_argument(
        "--add-growth",
        action="store_true",
        help="only measure the growth, and add it to the profile --out already holds",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="append each measurement to this file as it is made, and take the ones it "
        "already holds for this model, text and settings (an interrupted run resumes)",
    )
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        widths = [int(w) for w in args.widths.split(",") if w]
        if not widths or any(w not in WIDTHS for w in widths):
            raise ValueError(f"--widths {args.widths}: use some of {', '.join(map(str, WIDTHS))}")
        fp8_widths = [int(w) for w in args.fp8_widths.split(",") if w]
        if any(w not in FP8_WIDTHS for w in fp8_widths):
            raise ValueError(
                f"--fp8-widths {args.fp8_widths}: use some of {', '.join(map(str, FP8_WIDTHS))} "
                "(one-byte scales suit narrow codes), or an empty string for none"
            )
        get_preset(args.base)
        if args.growth_tokens < 0:
            raise ValueError(f"--growth-tokens {args.growth_tokens}: give tokens, or 0 for none")
        profiles.check_writable(args.out)
        if args.add_growth:
            if not args.growth_tokens:
                raise ValueError("--add-growth measures --growth-tokens tokens: give more than 0")
            p = profiles.read(args.out)
        if args.growth_tokens:
            check_growth_tokens(
                args.growth_tokens, p["text"]["tokens"] if args.add_growth else args.tokens
            )
        read_checkpoint(args.checkpoint, None)  # a file that is not one is refused now
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    from .loader import load
    from .prompt_cache import model_identity

    model, tokenizer = load(args.model)
    identity = model_identity(args.model, model, tokenizer)
    command = "python -m kvarn_mlx.calibrate " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.add_growth:
        try:
            profiles.check_model(p, model, quantizable_layers(model)[0], args.out)
            p["growth"] = measure_growth(
                model, tokenizer, p, args.base, args.growth_tokens, args.chunk
            )
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        p["growth"]["command"] = command
        profiles.write(args.out, p)
        print(f"added to {args.out}: {_growth_line(p['growth'])}")
        return
    try:
        p = calibrate(
            model,
            tokenizer,
            source=args.text,
            start=args.text_start,
            tokens=args.tokens,
            measure=args.measure,
            chunk=args.chunk,
            widths=widths,
            fp8_widths=fp8_widths,
            base=args.base,
            batch=max(1, args.batch),
            identity=identity,
            checkpoint=args.checkpoint,
        )
        if args.growth_tokens:
            p["growth"] = measure_growth(
                model, tokenizer, p, args.base, args.growth_tokens, args.chunk
            )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    p["command"] = command
    profiles.write(args.out, p)
    worst = max(
        (
            (e["layer"], s, kl)
            for e in p["layers"]
            for s in profiles.SIDES
            for kl in [e[s].get(str(min(p["widths"])))]
            if kl is not None
        ),
        key=lambda t: t[2],
    )
    print(
        f"wrote {args.out}: {len(p['layers'])} layers x {len(profiles.SIDES)} sides x "
        f"{len(p['widths'])} widths in {p['seconds']:.0f} s ({p['mode']}); most sensitive at "
        f"{min(p['widths'])} bits: layer {worst[0]} {'keys' if worst[1] == 'k' else 'values'} (KL "
        f"{worst[2]:.3g})"
    )

    if "growth" in p:
        print(f"growth: {_growth_line(p['growth'])}")


def _growth_line(g):
    return (
        "; ".join(
            f"{name} mean KL "
            + ", ".join(
                f"{kl:.3g} at {int(c):,}" for c, kl in sorted(kls.items(), key=lambda t: int(t[0]))
            )
            for name, kls in g["presets"].items()
        )
        + f" ({g['seconds']:.0f} s)"
    )


if __name__ == "__main__":
    main()
