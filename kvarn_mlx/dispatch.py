"""Which path runs: the Metal kernels or the MLX ops path.

Backend: ``KVARN_MLX_KERNELS=auto|metal|ops`` (environment) or
``set_backend(...)``. ``auto`` uses the kernels when ``available()`` and, on a
real device, once they pass their self-test. Input a kernel does not support
runs on the MLX ops path, with one log line per reason.
"""

from __future__ import annotations

import logging
import os
import threading

import mlx.core as mx

from . import kernels, quant
from .tiles import Tiles

log = logging.getLogger("kvarn_mlx.kernels")

BACKENDS = ("auto", "metal", "ops")
_backend: str | None = None  # None: read KVARN_MLX_KERNELS on first use
_logged: set = set()


def set_backend(name: str) -> None:
    """Force the kernels ("metal"), the MLX ops path ("ops"), or choose ("auto")."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r}: use one of {BACKENDS}")
    _backend = name


def get_backend() -> str:
    global _backend
    if _backend is None:
        env = os.environ.get("KVARN_MLX_KERNELS", "auto").strip().lower() or "auto"
        if env not in BACKENDS:
            _log_once(
                ("env", env), f"KVARN_MLX_KERNELS={env!r} is not one of {BACKENDS}; using 'auto'"
            )
            env = "auto"
        _backend = env
    return _backend


def emulated() -> bool:
    """True while mx.fast.metal_kernel is patched by the MSL emulator (tests on Linux)."""
    return getattr(mx.fast.metal_kernel, "__module__", "").startswith("mslemu")


def available() -> bool:
    """Whether Metal kernels can run: a Metal device, or the emulator patch."""
    if emulated():
        return True
    try:
        return bool(mx.metal.is_available())
    except Exception:  # pragma: no cover - builds without the metal module
        return False


def use_metal() -> bool:
    """Whether the kernels run now (the emulator skips the device self-test)."""
    b = get_backend()
    if b == "ops":
        return False
    if available():
        return emulated() or kernels._self_test()
    if b == "metal":
        _log_once(
            ("unavailable",),
            "KVARN_MLX_KERNELS=metal but Metal is not available here; using the MLX ops path",
        )
    return False


def _log_once(key, msg):
    if key not in _logged:
        _logged.add(key)
        log.warning(msg)


def fallback(what, reason):
    """Log once that `what` runs on the MLX ops path for `reason`."""
    _log_once(
        (what, reason),
        f"kvarn_mlx: {what} kernel does not support {reason}; using the MLX ops path",
    )


def _quantize(x, bits, iters, rotated, scale_dtype, keys):
    # Value codes pack along the head dim, key codes along the tile's tokens.
    n, what = (x.shape[-2], "key tile size") if keys else (x.shape[-1], "head dim")
    quant.check_bits(n, bits, what)
    if use_metal():
        reason = kernels.quantize_unsupported(x, bits, iters, scale_dtype)
        if reason is None:
            return kernels._quantize_metal(x, bits, iters, rotated, scale_dtype, keys)
        fallback("tile quantization", reason)
    if not COMPILE:
        return _quantize_ops(x, bits, iters, rotated, scale_dtype, keys)
    return _compiled(x, bits, iters, rotated, scale_dtype, keys)


def _quantize_ops(x, bits, iters, rotated, scale_dtype, keys):
    ops = quant.quantize_keys if keys else quant.quantize_values
    return ops(x, bits, iters, rotated, scale_dtype)


class Compiled:
    """fun through mx.compile: traced once per shape and settings, then replayed
    from C++. mx.compile keeps every trace and looks a call up among them one by
    one (each prefill's tile count, each tail length is a new shape): after
    max_traces traces it starts afresh, its traces going with it."""

    def __init__(self, fun, max_traces=64):
        self.fun, self.max_traces = fun, max_traces
        self.traces, self._compiled = 0, mx.compile(self._traced)

    def _traced(self, *args):
        self.traces += 1  # runs only when mx.compile traces
        return self.fun(*args)

    def __call__(self, *args):
        if self.traces > self.max_traces:
            self.traces, self._compiled = 0, mx.compile(self._traced)
        return self._compiled(*args)


# Tile quantization on the MLX ops path runs through mx.compile: a commit step's
# quantization graph is traced once per tile shape and settings, then replayed
# from C++ (about a sixth of the host time of building it from Python). The
# stored codes and scales are bit-identical to the uncompiled ops'
# (tests/test_quant_compiled.py). False: the ops as they are, every call.
COMPILE = True
_compiled = Compiled(_quantize_ops)


def quantize_keys(k, bits, iters=8, rotated=True, scale_dtype="float16"):
    """Key tiles [..., G, D] -> (words, a, b, t): the kernel when it runs, else
    quant.quantize_keys."""
    return _quantize(k, bits, iters, rotated, scale_dtype, keys=True)


def quantize_values(v, bits, iters=8, rotated=True, scale_dtype="float16"):
    """Value tiles [..., G, D] -> (words, a, b, c): the kernel when it runs, else
    quant.quantize_values."""
    return _quantize(v, bits, iters, rotated, scale_dtype, keys=False)


def quantize(k, v, config, rotate_k, rotate_v) -> Tiles:
    """Full-precision tiles k, v [B, H, m, G, D] -> Tiles of m tiles.
    rotate_k: a bool, or a bool per kv head (only those heads' keys are rotated)."""
    c = config
    if isinstance(rotate_k, mx.array):
        k = quant.sanitize(k)
        k = mx.where(rotate_k[:, None, None, None], quant.rotate(k), k)
        rotate_k = False
    return Tiles(
        *quantize_keys(k, c.k_bits, c.iters, bool(rotate_k), c.scale_dtype),
        *quantize_values(v, c.v_bits, c.iters, bool(rotate_v), c.scale_dtype),
    )


# MLX's CPU quantized_matmul uses one thread; independent work on a CPU stream
# of its own uses another core. 3 or 4 streams were slower than 2 on a 2-core
# machine (benchmarks/results/decode_speed.md).
CPU_STREAMS = max(1, min(2, os.cpu_count() or 1))
_local = threading.local()  # MLX streams belong to the thread that made them


def cpu_streams(k):
    """min(k, CPU_STREAMS) streams of this thread on the CPU, the current one first;
    on other devices the current stream alone."""
    device = mx.default_device()
    here = mx.default_stream(device)
    k = min(k, CPU_STREAMS) if device == mx.cpu else 1
    if k <= 1:
        return [here]
    more = getattr(_local, "streams", [])
    if len(more) < k - 1:
        more = _local.streams = more + [mx.new_stream(device) for _ in range(k - 1 - len(more))]
    return [here] + more[: k - 1]
