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

from mlx_lm.models import base
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache

from .attention import packed_attention
from .batch_cache import BatchKVarNCache
from .cache import KVarNCache
from .config import DEFAULT_PRESET, FP16, get_preset

log = logging.getLogger("kvarn_mlx")
_warned = set()
_observers = []

_original = base.scaled_dot_product_attention


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
    """mlx-lm's entry point, with KVarN caches routed to packed attention."""
    if isinstance(cache, KVarNCache):
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
        if name.startswith("mlx_lm.") and getattr(module, "scaled_dot_product_attention", None) is old:
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


def make_cache(model, preset=DEFAULT_PRESET, **overrides):
    """The model's prompt cache with plain KVCache layers replaced by KVarNCache.

    preset: a preset name, a KVarNConfig, "fp16" (plain cache), or a list with
    one of those (or None, meaning plain) per layer. overrides set config fields
    (e.g. sink=0), for names and configs alike. Other cache kinds (sliding-window,
    recurrent) are left as they are. Also turns on the packed-attention patch.
    """
    caches = mlx_cache.make_prompt_cache(model)
    per_layer = preset if isinstance(preset, (list, tuple)) else [preset] * len(caches)
    if len(per_layer) != len(caches):
        raise ValueError(f"got {len(per_layer)} per-layer presets for a model with {len(caches)} cache layers")
    skipped = set()
    for i, (c, p) in enumerate(zip(caches, per_layer)):
        if p is None or p == FP16:
            continue
        if type(c) is not KVCache:
            skipped.add(type(c).__name__)
            continue
        caches[i] = KVarNCache(get_preset(p, **overrides))
    if skipped:
        msg = f"KVarN left {', '.join(sorted(skipped))} layers as they were (only plain KVCache layers are quantized)"
        if msg not in _warned:
            _warned.add(msg)
            log.warning(msg)
    patch()
    return caches

