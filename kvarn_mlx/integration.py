"""Everything that touches mlx-lm's globals: the attention patch, the prompt-cache
class registration, and make_cache.

mlx-lm's models call `scaled_dot_product_attention` from mlx_lm.models.base
(each model module holds its own reference to it). The patch routes calls
whose cache is a KVarNCache to packed attention; every other cache goes to
mlx-lm's own function, untouched.
"""

import contextlib
import logging
import sys
import weakref
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import base
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import CacheList, KVCache

from .attention import packed_attention
from .batch_cache import BatchKVarNCache
from .cache import KVarNCache, cannot_hold
from .cli_support import model_context
from .config import DEFAULT_PRESET, FP16, user_preset

log = logging.getLogger("kvarn_mlx")
_warned = set()
_observers = []

_original = base.scaled_dot_product_attention


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
    """mlx-lm's entry point, with KVarN caches routed to packed attention when
    keys and values are the ones the cache returned (a model attending on others,
    e.g. derived from a cached latent, gets mlx-lm's attention on those)."""
    if isinstance(cache, KVarNCache) and cache.fetched(keys, values):
        out = packed_attention(queries, cache, scale, mask, sinks)
    elif isinstance(cache, BatchKVarNCache):
        out = cache.attention(queries, scale, mask, sinks)
    else:
        if sinks is not None:
            kwargs["sinks"] = sinks
        out = _original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
    for fn in _observers:
        fn(queries, keys, values, cache, out)
    return out


@contextlib.contextmanager
def observe(fn):
    """Within the block, call fn(queries, keys, values, cache, output) after every
    attention call that goes through the patched entry point (any cache kind)."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)


def _swap(old, new):
    base.scaled_dot_product_attention = new
    for name, module in list(sys.modules.items()):
        if (
            name.startswith("mlx_lm.")
            and getattr(module, "scaled_dot_product_attention", None) is old
        ):
            module.scaled_dot_product_attention = new


def patch():
    """Route mlx-lm's scaled_dot_product_attention to packed attention for KVarN
    caches, in mlx_lm.models.base and every loaded module holding it. Idempotent;
    run again after importing new model modules (make_cache does)."""
    _swap(_original, scaled_dot_product_attention)


def unpatch():
    _swap(scaled_dot_product_attention, _original)


def is_patched():
    return base.scaled_dot_product_attention is scaled_dot_product_attention


# load_prompt_cache resolves class names in mlx_lm.models.cache's globals.
mlx_cache.KVarNCache = KVarNCache
# mlx-lm batches sequences (BatchGenerator, its server) through type(cache).merge.
KVarNCache.merge = classmethod(lambda cls, caches: BatchKVarNCache.merge(caches))


def _warn_once(msg):
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def _members(cache):
    """A layer's caches: the members of a CacheList (a layer holding state of two
    kinds, e.g. Falcon-H1's Mamba and attention), else the cache itself."""
    return cache.caches if isinstance(cache, CacheList) else (cache,)


def kv_shapes(model):
    """{(layer, member): (kv heads, key head dim, value head dim, dtype)} of every
    plain KVCache of the model's prompt cache, read after one token through the
    model (lazily: nothing is computed); None for a model that does not run that way."""
    probe = mlx_cache.make_prompt_cache(model)
    observers = _observers[:]
    _observers.clear()  # the probe's attention calls are nobody's observations
    try:
        model(mx.array([[0]]), cache=probe)
    except Exception:  # the model's own error, if any, comes when it runs for real
        return None
    finally:
        _observers[:] = observers
    return {
        (i, j): (m.keys.shape[1], m.keys.shape[-1], m.values.shape[-1], m.keys.dtype)
        for i, c in enumerate(probe)
        for j, m in enumerate(_members(c))
        if type(m) is KVCache and m.keys is not None
    }


def make_cache(
    model,
    preset=DEFAULT_PRESET,
    fp16_layers=(),
    profile=None,
    bytes_like=None,
    max_kl=None,
    context=None,
    **overrides,
):
    """The model's prompt cache with plain KVCache layers replaced by KVarNCache.

    preset: a preset name, a KVarNConfig, "fp16" (plain cache), or a list with
    one of those (or None, meaning plain) per layer. fp16_layers: layer indices
    (negative ones count from the end, e.g. (0, -1)) left as mlx-lm's plain
    cache whatever the preset. profile: a calibration profile of this model
    (python -m kvarn_mlx.calibrate) from which each layer gets its own key and
    value widths (mix.py), with bytes_like (a preset: at most its bytes, the
    least predicted KL) or max_kl (the fewest bytes predicting at most that KL at
    `context` tokens, by default the model's context length); it replaces
    preset. overrides set config fields (e.g. sink=0), for names and configs alike.
    KVCaches inside a CacheList are replaced too; other cache kinds
    (sliding-window, recurrent) are left as they are, and so is a KVCache whose
    head dims KVarN cannot hold (cache.cannot_hold; said once). Also turns on
    the packed-attention patch.
    """
    if profile is not None:
        if fp16_layers:
            raise ValueError(
                "fp16_layers and a profile do not combine: the profile chooses every layer's widths"
            )
        preset = profile_mix(model, profile, bytes_like, max_kl, context)[1]
    elif bytes_like is not None or max_kl is not None:
        raise ValueError(
            "bytes_like and max_kl choose widths from a calibration profile: pass profile= too"
        )
    caches = mlx_cache.make_prompt_cache(model)
    per_layer = list(preset) if isinstance(preset, (list, tuple)) else [preset] * len(caches)
    if len(per_layer) != len(caches):
        raise ValueError(
            f"got {len(per_layer)} per-layer presets for a model with {len(caches)} cache layers"
        )
    for i in fp16_layers:
        if not -len(caches) <= i < len(caches):
            raise ValueError(
                f"fp16 layer {i} does not exist: the model has {len(caches)} layers "
                f"(0..{len(caches) - 1}, or -1..-{len(caches)} from the end)"
            )
        per_layer[i] = None
    dims = kv_shapes(model) or {}
    skipped, left_plain, n_kv = set(), {}, 0
    for i, (c, p) in enumerate(zip(caches, per_layer)):
        if p is None or p == FP16:
            continue
        members = list(_members(c))
        for j, m in enumerate(members):
            if type(m) is not KVCache:
                skipped.add(type(m).__name__)
                continue
            config = user_preset(p, **overrides)
            problem = cannot_hold(config, *dims[i, j][1:3]) if (i, j) in dims else None
            n_kv += 1
            if problem:
                left_plain[problem] = left_plain.get(problem, 0) + 1
                continue
            members[j] = KVarNCache(config)
            members[j].announce_bypass = True
        if isinstance(c, CacheList):
            c.caches = tuple(members)
        else:
            caches[i] = members[0]
    if skipped:
        _warn_once(
            f"KVarN left {', '.join(sorted(skipped))} layers as they were (only plain KVCache "
            "layers are quantized)"
        )
    for problem, n in left_plain.items():
        _warn_once(f"KVarN left {n} of {n_kv} KVCache layers plain: {problem}")
    patch()
    return caches


def quantizable_layers(model):
    """(layers, shapes): the layers whose cache is a plain KVCache with keys and
    values of one head dim (those a calibration profile measures), and
    {layer: (kv heads, key dim, value dim, dtype)} of each."""
    shapes = {i: d for (i, j), d in (kv_shapes(model) or {}).items() if j == 0}
    caches = mlx_cache.make_prompt_cache(model)
    layers = [
        i
        for i, c in enumerate(caches)
        if type(c) is KVCache and i in shapes and shapes[i][1] == shapes[i][2]
    ]
    return layers, shapes


# (id(model), profile file, its mtime and size, bytes_like, max_kl, context)
# -> (model ref, Mix, configs)
_mixes = {}


def profile_mix(model, profile, bytes_like=None, max_kl=None, context=None):
    """(Mix, per-layer configs for make_cache) of this model from a calibration
    profile (a path). Refuses, before any cache is built, a profile of another
    model, one missing a layer make_cache quantizes, or with a width KVarN does
    not support (profile.ProfileError). Computed once per model and file.
    With max_kl, the KL is predicted at `context` tokens (mix.predict), by default
    the model's context length: a cache that grows that long stays within max_kl
    (if the model states no context length, at the calibration's length)."""
    from . import mix as mixes
    from . import profile as profiles

    path = Path(profile).expanduser()
    try:
        st = path.stat()
    except OSError:
        raise profiles.ProfileError(
            f"no profile file at {path}; make one with python -m kvarn_mlx.calibrate --out {path}"
        ) from None
    if max_kl is not None and context is None:
        context = model_context(model)
    key = (id(model), str(path.resolve()), st.st_mtime_ns, st.st_size, bytes_like, max_kl, context)
    hit = _mixes.get(key)
    if hit is not None and hit[0]() is model:
        return hit[1], hit[2]
    p = profiles.read(path)
    layers, shapes = quantizable_layers(model)
    mix, configs = mixes.from_profile(
        model, p, layers, shapes, bytes_like, max_kl, context, where=str(path)
    )
    per_layer = [configs.get(i) for i in range(len(mlx_cache.make_prompt_cache(model)))]
    _mixes[key] = (weakref.ref(model), mix, per_layer)
    return mix, per_layer
