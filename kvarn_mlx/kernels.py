"""Metal kernels for KVarN (sources in metal/), their loader and the backend switch.

Kernels (built once per process with ``mx.fast.metal_kernel``; MLX compiles one
pipeline per template instantiation and caches it):

- ``quantize_keys_metal`` / ``quantize_values_metal``: one dispatch quantizes every
  (batch, head, tile) of a layer: Hadamard rotation, variance normalization,
  RTN, packing, absorbed scales. Same signature and outputs as
  ``quant.quantize_keys`` / ``quant.quantize_values``.
- ``packed_attention_metal``: attention of L <= 8 query positions over
  sink + packed tiles + tail, flash-decoding style (per-split partial softmax,
  then a merge pass), GQA heads sharing each tile read.

Backend: ``KVARN_MLX_KERNELS=auto|metal|ops`` (environment) or
``set_backend(...)``. ``auto`` uses the kernels when ``available()``. Shapes or
dtypes a kernel does not support fall back to the MLX ops path with one log line
per reason. Nothing here touches Metal at import time.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import mlx.core as mx

from . import quant

log = logging.getLogger("kvarn_mlx.kernels")

BACKENDS = ("auto", "metal", "ops")
_backend: str | None = None  # None: read KVARN_MLX_KERNELS on first use
_logged: set = set()
_kernels: dict = {}
_sources: dict = {}

_FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
_KERNEL_DIMS = (32, 64, 128, 256)  # head dims the kernels handle (D/32 a power of two)
_KERNEL_BITS = (2, 4, 8)


# Backend switch ------------------------------------------------------------------

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
            _log_once(("env", env), f"KVARN_MLX_KERNELS={env!r} is not one of {BACKENDS}; using 'auto'")
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
    """Whether the dispatchers below should use the kernels now."""
    b = get_backend()
    if b == "ops":
        return False
    if available():
        return emulated() or _self_test()
    if b == "metal":
        _log_once(("unavailable",), "KVARN_MLX_KERNELS=metal but Metal is not available here; using the MLX ops path")
    return False


_self_test_result = None


def _self_test() -> bool:
    """Once per process on a real device: run both kernels on a small case and
    compare with the ops path. A kernel that fails to build or disagrees on this
    device turns the kernels off (one log line) instead of giving wrong answers."""
    global _self_test_result
    if _self_test_result is None:
        from .attention import attend

        try:
            x = mx.random.normal((1, 2, 2, 64, 64), key=mx.random.key(0))
            k_tiles = _quantize_metal(x, 4, 8, True, "float32", keys=True)
            v_tiles = _quantize_metal(x, 2, 8, True, "float32", keys=False)
            k_ops, v_ops = quant.quantize_keys(x, 4, 8, True, "float32"), quant.quantize_values(x, 2, 8, True, "float32")
            q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(1))
            sink, tail = x[:, :, 0, :16], x[:, :, 1, :5]
            tiles = (*k_tiles, *v_tiles)
            got = packed_attention_metal(q, sink, sink, *tiles, 2, tail, tail, 0.125, 4, 2)
            want = attend(q, sink, sink, (*k_ops, *v_ops), tail, tail, 0.125, 4, 2)
            # Loose bounds: near-tied normalization iterates may legitimately differ
            # (tests/test_kernels.py holds the kernels to the reference tightly).
            def close(a, b, tol):
                return (mx.abs(a - b).mean() <= tol * mx.abs(b).mean()).item()

            _self_test_result = (close(quant.dequantize_keys(*k_tiles, 4), quant.dequantize_keys(*k_ops, 4), 0.05)
                                 and close(quant.dequantize_values(*v_tiles, 2), quant.dequantize_values(*v_ops, 2), 0.05)
                                 and close(got, want, 0.05))
            if not _self_test_result:
                log.warning("kvarn_mlx: the Metal kernels disagree with the MLX ops path on this device; "
                            "using the ops path (please report this with your chip and macOS version)")
        except Exception as e:  # a kernel that does not build here
            log.warning(f"kvarn_mlx: the Metal kernels failed on this device ({e}); using the MLX ops path")
            _self_test_result = False
    return _self_test_result


def _log_once(key, msg):
    if key not in _logged:
        _logged.add(key)
        log.warning(msg)


def _fallback(kernel, reason):
    _log_once((kernel, reason), f"kvarn_mlx: {kernel} kernel does not support {reason}; using the MLX ops path")


# Sources and kernel objects ---------------------------------------------------------

def _metal_dir() -> Path:
    here = Path(__file__).resolve().parent
    for d in (here / "metal", here.parent / "metal"):  # installed package data, then the source tree
        if (d / "kvarn_common.h").exists():
            return d
    raise FileNotFoundError("kvarn_mlx: Metal kernel sources (metal/*.metal) not found")


def _source(name: str) -> str:
    if name not in _sources:
        _sources[name] = (_metal_dir() / name).read_text()
    return _sources[name]


def _kernel(name: str, input_names, output_names, source_file: str):
    """The kernel object, built once per (name, factory): the emulator's
    factory (tests) and the real one never share objects."""
    factory = mx.fast.metal_kernel
    key = (name, id(factory))
    k = _kernels.get(key)
    if k is None:
        k = factory(
            name=name,
            input_names=list(input_names),
            output_names=list(output_names),
            source=_source(source_file),
            header=_source("kvarn_common.h"),
        )
        _kernels[key] = k
    return k


# Tile quantization ------------------------------------------------------------------

def _quant_unsupported(x, bits, iters, scale_dtype):
    if x.ndim < 2:
        return f"input of shape {tuple(x.shape)}"
    G, D = x.shape[-2:]
    if D not in _KERNEL_DIMS:
        return f"head dim {D} (kernel dims: {_KERNEL_DIMS})"
    if G < 16 or G > 256 or G & (G - 1):
        return f"tile size {G} (kernel: a power of two in 16..256)"
    if bits not in _KERNEL_BITS:
        return f"{bits}-bit codes (kernel bits: {_KERNEL_BITS})"
    if x.dtype not in _FLOAT_DTYPES:
        return f"input dtype {x.dtype}"
    if scale_dtype not in quant._SCALE_DTYPES:
        return f"scale dtype {scale_dtype!r}"
    if not isinstance(iters, int) or iters < 0:
        return f"iters={iters!r}"
    if x.size == 0:
        return "empty input"
    return None


def _quantize_metal(x, bits, iters, rotated, scale_dtype, keys):
    G, D = x.shape[-2:]
    lead = tuple(x.shape[:-2])
    nt = math.prod(lead)
    nsg = 16  # 512 threads: NSG*32 >= D and NSG*D*4 <= 16 KB of threadgroup memory for D <= 256
    sdt = quant._SCALE_DTYPES[scale_dtype]
    k = _kernel("kvarn_quantize_tiles", ["tiles"], ["words", "a", "b", "col"], "quantize_tiles.metal")
    if keys:
        shapes = [(nt, D, G * bits // 32), (nt, D), (nt, D), (nt, G)]
    else:
        shapes = [(nt, G, D * bits // 32), (nt, G), (nt, G), (nt, D)]
    words, a, b, col = k(
        inputs=[x.reshape(nt, G, D)],
        template=[("T", x.dtype), ("S", sdt), ("D", D), ("G", G), ("BITS", bits), ("ITERS", iters),
                  ("KEYS", bool(keys)), ("ROT", bool(rotated)), ("NSG", nsg)],
        grid=(32 * nsg, nt, 1),
        threadgroup=(32 * nsg, 1, 1),
        output_shapes=shapes,
        output_dtypes=[mx.uint32, sdt, sdt, sdt],
    )
    return tuple(o.reshape(*lead, *s[1:]) for o, s in zip((words, a, b, col), shapes))


def _quantize_or_fall_back(x, bits, iters, rotated, scale_dtype, keys):
    quant.check_head_dim(x.shape[-1], bits)
    reason = _quant_unsupported(x, bits, iters, scale_dtype)
    if reason:
        _fallback("tile quantization", reason)
        ops = quant.quantize_keys if keys else quant.quantize_values
        return ops(x, bits, iters, rotated, scale_dtype)
    return _quantize_metal(x, bits, iters, rotated, scale_dtype, keys)


def quantize_keys_metal(k, bits, iters=8, rotated=True, scale_dtype="float16"):
    """Key tiles k [..., G, D] -> (words [..., D, G*bits/32], a [..., D], b [..., D], t [..., G]);
    the kernel version of quant.quantize_keys (falls back to it for unsupported input)."""
    return _quantize_or_fall_back(k, bits, iters, rotated, scale_dtype, keys=True)


def quantize_values_metal(v, bits, iters=8, rotated=True, scale_dtype="float16"):
    """Value tiles v [..., G, D] -> (words [..., G, D*bits/32], a [..., G], b [..., G], c [..., D]);
    the kernel version of quant.quantize_values (falls back to it for unsupported input)."""
    return _quantize_or_fall_back(v, bits, iters, rotated, scale_dtype, keys=False)


def quantize_keys(k, bits, iters=8, rotated=True, scale_dtype="float16"):
    """Dispatch: the kernel when use_metal(), else quant.quantize_keys."""
    if use_metal():
        return quantize_keys_metal(k, bits, iters, rotated, scale_dtype)
    return quant.quantize_keys(k, bits, iters, rotated, scale_dtype)


def quantize_values(v, bits, iters=8, rotated=True, scale_dtype="float16"):
    """Dispatch: the kernel when use_metal(), else quant.quantize_values."""
    if use_metal():
        return quantize_values_metal(v, bits, iters, rotated, scale_dtype)
    return quant.quantize_values(v, bits, iters, rotated, scale_dtype)


# Attention over the packed cache ----------------------------------------------------

_ATT_THREADS = 256
_ATT_TARGET_GROUPS = 256  # aim for about this many threadgroups in pass 1
_TG_MEM = 32768


def _seq_len(x):
    return 0 if x is None else int(x.shape[2])


def _att_unsupported(q, sink_k, tail_k, k_words, k_a, k_t, k_bits, v_bits, scale_arrays):
    if q.ndim != 4:
        return f"query of shape {tuple(q.shape)}"
    B, Hq, L, D = q.shape
    Hkv = k_words.shape[1]
    if Hkv == 0 or Hq % Hkv:
        return f"{Hq} query heads over {Hkv} kv heads"
    if L > 8:
        return f"query length {L} (kernel: <= 8; prefill uses the ops path)"
    if D not in _KERNEL_DIMS:
        return f"head dim {D} (kernel dims: {_KERNEL_DIMS})"
    G = k_t.shape[-1]
    if G not in (32, 64, 128, 256):
        return f"tile size {G}"
    if k_bits not in _KERNEL_BITS or v_bits not in _KERNEL_BITS:
        return f"{k_bits}/{v_bits}-bit codes"
    if q.dtype not in _FLOAT_DTYPES:
        return f"query dtype {q.dtype}"
    for x in (sink_k, tail_k):
        if x is not None and x.dtype not in _FLOAT_DTYPES:
            return f"sink/tail dtype {x.dtype}"
    sdts = {x.dtype for x in scale_arrays}
    if len(sdts) != 1 or next(iter(sdts)) not in _FLOAT_DTYPES:
        return f"scale dtypes {sorted(str(d) for d in sdts)}"
    if k_words.dtype != mx.uint32:
        return f"code words of dtype {k_words.dtype}"
    return None


def _rows_per_group(R, D, G):
    rc = min(R, 8)
    while rc > 1 and 4 * (rc * D + 3 * rc * G + 2 * rc) > _TG_MEM - 1024:
        rc //= 2
    return rc


def packed_attention_metal(q, sink_k, sink_v, k_words, k_a, k_b, k_t, v_words, v_a, v_b, v_c, n_tiles,
                           tail_k, tail_v, scale, k_bits, v_bits, causal=True,
                           rotate_keys=True, rotate_values=True):
    """Attention of queries q [B, Hq, L, D] (unrotated, L <= 8) over one layer's
    cache: sink [B, Hkv, S, D] + the first n_tiles packed tiles (tile-major
    storage, capacity >= n_tiles) + tail [B, Hkv, T, D]; one softmax, causal
    for L > 1. Returns [B, Hq, L, D] in q's dtype. sink/tail may be None or empty.
    rotate_keys may be a per-kv-head bool array. Unsupported shapes/dtypes fall
    back to the MLX ops path (attention.attend)."""
    n_tiles = int(n_tiles)
    reason = _att_unsupported(q, sink_k, tail_k, k_words, k_a, k_t, k_bits, v_bits,
                              (k_a, k_b, k_t, v_a, v_b, v_c))
    if reason:
        _fallback("attention", reason)
        from .attention import attend

        n = int(n_tiles)
        tiles = None if n == 0 else tuple(x[:, :, :n] for x in (k_words, k_a, k_b, k_t, v_words, v_a, v_b, v_c))
        return attend(q, sink_k, sink_v, tiles, tail_k, tail_v, scale, k_bits, v_bits, rotate_keys, rotate_values,
                      "causal" if causal and q.shape[2] > 1 else None)

    B, Hq, L, D = q.shape
    Hkv, ncap, G = k_words.shape[1], k_words.shape[2], k_t.shape[-1]
    n_tiles = min(n_tiles, ncap)
    n_rep = Hq // Hkv
    R, BH = n_rep * L, B * Hkv
    S, Tn = _seq_len(sink_k), _seq_len(tail_k)
    kv_dtype = sink_k.dtype if S else (tail_k.dtype if Tn else mx.float16)
    sdt = k_a.dtype

    def dense(x, n):
        if n == 0:
            return mx.zeros((1,), kv_dtype)  # never read; avoids zero-size buffers
        return x.astype(kv_dtype) if x.dtype != kv_dtype else x

    def packed(x):
        return x if ncap else mx.zeros((1,), x.dtype)

    qf = q.astype(mx.float32).reshape(BH * R, D)  # rows (b, kv head, rep, i): GQA heads are consecutive
    qr = quant.rotated_where(rotate_keys, qf.reshape(B, Hkv, R, D), quant.rotate).reshape(BH * R, D)
    rc = _rows_per_group(R, D, G)
    n_rc = -(-R // rc)
    n_split = 0
    tps = 1
    if n_tiles:
        want = max(1, -(-_ATT_TARGET_GROUPS // (BH * n_rc)))
        tps = -(-n_tiles // min(n_tiles, want))
        n_split = -(-n_tiles // tps)
    NS = n_split + 2  # sink split, tile splits, tail split
    params = mx.array([n_tiles, ncap, S, Tn, tps, L, R, int(bool(causal)), NS, n_rc], dtype=mx.int32)

    k1 = _kernel(
        "kvarn_attention_split",
        ["q", "qr", "sink_k", "sink_v", "k_words", "k_a", "k_b", "k_t", "v_words", "v_a", "v_b", "v_c",
         "tail_k", "tail_v", "params", "scale"],
        ["o_part", "m_part", "l_part"],
        "attention_split.metal",
    )
    o_part, m_part, l_part = k1(
        inputs=[qf, qr, dense(sink_k, S), dense(sink_v, S), packed(k_words), packed(k_a), packed(k_b),
                packed(k_t), packed(v_words), packed(v_a), packed(v_b), packed(v_c), dense(tail_k, Tn),
                dense(tail_v, Tn), params, mx.array([float(scale)], dtype=mx.float32)],
        template=[("T", kv_dtype), ("SC", sdt), ("D", D), ("G", G), ("KB", int(k_bits)), ("VB", int(v_bits)),
                  ("RC", rc)],
        grid=(_ATT_THREADS, NS, BH * n_rc),
        threadgroup=(_ATT_THREADS, 1, 1),
        output_shapes=[(BH, NS, R, D), (BH, NS, R), (BH, NS, R)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    k2 = _kernel("kvarn_attention_combine", ["o_part", "m_part", "l_part", "params"], ["o_dense", "o_rot"],
                 "attention_combine.metal")
    o_dense, o_rot = k2(
        inputs=[o_part, m_part, l_part, params],
        template=[("D", D)],
        grid=(D, BH * R, 1),
        threadgroup=(min(D, 256), 1, 1),
        output_shapes=[(BH * R, D), (BH * R, D)],
        output_dtypes=[mx.float32, mx.float32],
    )
    out = o_dense + (mx.hadamard_transform(o_rot) if rotate_values else o_rot)
    return out.reshape(B, Hq, L, D).astype(q.dtype)
