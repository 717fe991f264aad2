"""kvarn-mlx: KVarN KV-cache quantization for mlx-lm."""

from .config import DEFAULT_PRESET, PRESETS, KVarNConfig, get_preset

__all__ = ["DEFAULT_PRESET", "PRESETS", "KVarNConfig", "get_preset"]
