"""kvarn-mlx: KVarN KV-cache quantization for mlx-lm.

Importing the package registers KVarNCache with mlx-lm's prompt-cache loader
and routes mlx-lm's attention entry point to packed attention for KVarN caches
(other caches are untouched; `unpatch()` undoes it). See kvarn_mlx/integration.py.
"""

from .attention import packed_attention
from .cache import KVarNCache
from .config import DEFAULT_PRESET, FP16, PRESETS, KVarNConfig, get_preset
from .integration import make_cache, patch, unpatch
from .tuning import apply as _apply_tuning

patch()
_apply_tuning()  # the choices `python -m kvarn_mlx.bench` measured on this machine, if any

__all__ = [
    "DEFAULT_PRESET",
    "FP16",
    "PRESETS",
    "KVarNCache",
    "KVarNConfig",
    "get_preset",
    "make_cache",
    "packed_attention",
    "patch",
    "unpatch",
]
