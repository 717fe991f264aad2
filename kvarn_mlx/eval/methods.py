"""The caches compared by the evaluation, by method name.

Methods, at B = 2, 4 or 8 bits (every tile method uses the same sink and tail):
  fp        mlx-lm's KVCache (the reference)
  kvarnB    KVarN, K and V at B bits (rotation + 8 normalization iterations)
  kiviB     per-channel K / per-token V RTN, no rotation, no normalization
  rotB      rotation only (QuaRot-style), no normalization
  normB     normalization only, no rotation
  plainkB   KVarN without key rotation (values rotated)
  autoB     KVarN with key rotation chosen per kv head
  oracleB   rotation + per-channel K RTN on keys divided by exact float32
            per-token scales (std over channels of the full-precision tile);
            values rotation-only. Asks: do token scales alone close the gap?
  affineB   mx.quantize affine, group 64, per token (mlx-lm's format) in tiles,
            with the same sink and tail
  mlxqB     mlx-lm's QuantizedKVCache as shipped (no sink, no tail: every token
            is quantized the moment it arrives)
  konlyB / vonlyB  KVarN on K only / V only, the other side in full precision
  any preset name (k4v2_g128, auto4v2, ...) or kXvY_gG[_auto] name (k5v3_g128, ...)
  PROFILE.json@PRESET  per-layer widths from a calibration profile at PRESET's bytes
  PROFILE.json@kl0.005 the same for a predicted KL of at most 0.005 (make_cache's max_kl,
                       at the model's context length)

Variants, appended to a tile method's name (no commas: they separate methods):
  +fp8          scales stored as e4m3 bytes (scale_dtype="fp8"; codes <= 4 bits)
  +tail1024     the newest 1,024 tokens kept in full precision (tail_tokens; a
                multiple of the tile size, +tail0 for none)
  +fp16:0:-1    those model layers left as mlx-lm's plain cache (as make_cache's
                fp16_layers; negative indices count from the end)
e.g. k4v2_g128+fp8, k8v8_g128+fp16:0:-1, auto4v2+tail1024.
"""

import re
from dataclasses import replace
from functools import partial

from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .. import integration, memory
from ..cache import KVarNCache
from ..config import PRESETS, KVarNConfig, get_preset
from .baselines import AffineCache, KeysOnlyCache, OracleKeysCache, ValuesOnlyCache

G = 128  # tile tokens for every tile method
SINK = 128
FAMILIES = (
    "kvarn",
    "kivi",
    "rot",
    "norm",
    "oracle",
    "affine",
    "mlxq",
    "konly",
    "vonly",
    "plaink",
    "auto",
)


def _variant(name):
    """(base method, config overrides, plain layers) of name[+fp8][+tailN][+fp16:i:j...]."""
    base, *opts = name.split("+")
    overrides, layers = {}, ()
    for o in opts:
        if o == "fp8":
            overrides["scale_dtype"] = "fp8"
        elif re.fullmatch(r"tail\d+", o):
            overrides["tail_tokens"] = int(o[4:])
        elif re.fullmatch(r"fp16(:-?\d+)+", o):
            layers = tuple(int(i) for i in o.split(":")[1:])
        else:
            raise ValueError(
                f"unknown method {name!r}: variants are +fp8, +tailN (N newest tokens in full "
                "precision) and +fp16:i:j (layers kept plain)"
            )
    return base, overrides, layers


def _parse(name):
    m = re.fullmatch(r"([a-z]+)([248])", name)
    if not m or m.group(1) not in FAMILIES:
        raise ValueError(
            f"unknown method {name!r}: use fp, a preset ({', '.join(PRESETS)}) or one of "
            f"{', '.join(f + '2' for f in FAMILIES)} (or ...4, ...8)"
        )
    return m.group(1), int(m.group(2))


def profile_method(name):
    """(profile path, bytes_like, max_kl) of a PROFILE.json@PRESET or PROFILE.json@klX method, else
    None."""
    path, at, target = name.rpartition("@")
    if not at or not path.endswith(".json"):
        return None
    if re.fullmatch(r"kl[0-9.eE+-]+", target):
        return path, None, float(target[2:])
    get_preset(target)  # a clear error for an unknown preset
    return path, target, None


def method_cache(name):
    """(cache class, KVarNConfig) of a tile method, or (QuantizedKVCache, None) for mlxqB."""
    base, overrides, _ = _variant(name)
    if base != name:
        if base == "fp" or base.startswith("mlxq"):
            raise ValueError(f"unknown method {name!r}: variants apply to KVarN tile methods")
        cls, cfg = method_cache(base)
        return cls, replace(cfg, **overrides)
    if name in PRESETS or re.fullmatch(r"k\d+v\d+_g\d+(_auto)?", name):
        return KVarNCache, get_preset(name)
    fam, b = _parse(name)
    if fam == "mlxq":
        return QuantizedKVCache, None
    cfg = partial(KVarNConfig, k_bits=b, v_bits=b, group_size=G, sink=SINK)
    plain = dict(rotate_keys=False, rotate_values=False)
    return {
        "kvarn": (KVarNCache, cfg()),
        "kivi": (KVarNCache, cfg(iters=0, **plain)),
        "rot": (KVarNCache, cfg(iters=0)),
        "norm": (KVarNCache, cfg(**plain)),
        "plaink": (KVarNCache, cfg(rotate_keys=False)),
        "auto": (KVarNCache, cfg(rotate_keys="auto")),
        "oracle": (OracleKeysCache, cfg(iters=0)),
        "konly": (KeysOnlyCache, cfg()),
        "vonly": (ValuesOnlyCache, cfg()),
        "affine": (AffineCache, cfg(iters=0, **plain)),
    }[fam]


def make_caches(model, name):
    """One cache per layer for method `name` (plain KVCache layers only); turns
    on kvarn_mlx's attention patch, as make_cache does."""
    caches = mlx_cache.make_prompt_cache(model)
    if name == "fp":
        return caches
    if profile_method(name):
        path, bytes_like, max_kl = profile_method(name)
        return integration.make_cache(model, profile=path, bytes_like=bytes_like, max_kl=max_kl)
    cls, cfg = method_cache(name)
    n, layers = len(caches), _variant(name)[2]
    plain = {i % n for i in layers if -n <= i < n}
    if len(plain) != len(set(layers)):
        raise ValueError(
            f"method {name!r}: the model has {n} layers (0..{n - 1}, or -1..-{n} from the end)"
        )
    for i, c in enumerate(caches):
        if type(c) is KVCache and i not in plain:
            caches[i] = (
                QuantizedKVCache(group_size=64, bits=_parse(name)[1]) if cfg is None else cls(cfg)
            )
    integration.patch()
    return caches


def method_bits(name):
    """ "K/V" code bits of a method, "fp" for a side kept in full precision."""
    if name == "fp":
        return "16/16"
    if profile_method(name):
        return "mixed"
    cls, cfg = method_cache(name)
    if cfg is None:
        b = _parse(name)[1]
        return f"{b}/{b}"
    sides = getattr(cls, "quantized_sides", ("k", "v"))
    return "/".join(
        str(bits) if side in sides else "fp"
        for side, bits in (("k", cfg.k_bits), ("v", cfg.v_bits))
    )


def cache_bytes(caches):
    """Bytes the caches hold for their tokens (measured arrays, without
    preallocated room), their 2-byte equivalent, bits per quantized element
    (codes + scales over the elements stored in quantized form; K-only / V-only:
    over the quantized side), and growing_bytes: the bytes of the layers whose
    cache grows with the context (all but sliding-window layers)."""
    held = memory.cache_bytes(caches)
    growing = memory.cache_bytes(
        [c for c in caches if not isinstance(c, mlx_cache.RotatingKVCache)]
    )
    qbytes = qelems = 0
    for c in caches:
        if isinstance(c, KVarNCache) and c.n_tiles:
            tiles = c.tiles.valid()
            sides = getattr(c, "quantized_sides", ("k", "v"))
            arrays = [
                x
                for name, x in zip(("k", "k", "k", "k", "v", "v", "v", "v"), tiles.arrays())
                if name in sides
            ]
            qbytes += sum(x.nbytes for x in arrays)
            B, H, _, D = c.sink_k.shape
            qelems += len(sides) * B * H * tiles.count * c.config.group_size * D
        elif isinstance(c, QuantizedKVCache) and c.keys is not None:
            qbytes += sum(x.nbytes * c.offset // x.shape[2] for x in (*c.keys, *c.values))
            B, H, _, w = c.keys[0].shape
            qelems += 2 * B * H * c.offset * w * 32 // c.bits
    return {
        "bytes": held["held"] - held["unused"],
        "fp16_bytes": held["fp16"],
        "growing_bytes": growing["held"] - growing["unused"],
        "bits_per_quantized_element": 8 * qbytes / qelems if qelems else None,
    }
