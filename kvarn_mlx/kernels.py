"""Metal kernels for KVarN: their sources (metal/), building, launching and a
one-time self-test on a real device.

- ``quantize_keys_metal`` / ``quantize_values_metal``: one dispatch quantizes every
  (batch, head, tile) of a layer: Hadamard rotation, variance normalization,
  RTN, packing, absorbed scales. Same outputs as ``quant.quantize_keys`` /
  ``quant.quantize_values``.
- ``packed_attention_metal``: attention of L <= 8 query positions over a
  StepView (sink + packed tiles + recent tokens), flash-decoding style
  (per-split partial softmax, then a merge pass), GQA heads sharing each tile
  read. The tile storage is read in place: the kernel gets its capacity and
  the number of valid tiles.

Kernels are built with ``mx.fast.metal_kernel``, one kernel object per set of
compile-time constants (dtypes, head dim, tile size, bits), which open the body as
declarations (MLX compiles one pipeline per kernel and caches it). Nothing here
touches Metal at import time; which path runs is decided in dispatch.py.
"""

from __future__ import annotations

import logging
import math
import weakref
from pathlib import Path

import mlx.core as mx

from . import quant
from .tiles import StepView, Tiles, append

log = logging.getLogger("kvarn_mlx.kernels")

_kernels: dict = {}
_sources: dict = {}

FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
KERNEL_DIMS = (32, 64, 128, 256)  # head dims the kernels handle (D/32 a power of two)
KERNEL_BITS = (2, 3, 4, 5, 6, 8)


# Sources and kernel objects ---------------------------------------------------------


def _metal_dir() -> Path:
    here = Path(__file__).resolve().parent
    # installed package data, then the source tree
    for d in (here / "metal", here.parent / "metal"):
        if (d / "kvarn_common.h").exists():
            return d
    raise FileNotFoundError("kvarn_mlx: Metal kernel sources (metal/*.metal) not found")


def _source(name: str) -> str:
    if name not in _sources:
        _sources[name] = (_metal_dir() / name).read_text()
    return _sources[name]


def _kernel(name: str, input_names, output_names, source_file: str, constants=()):
    """The kernel object for these compile-time constants ((name, int, bool or dtype)
    pairs), built once per (name, constants, factory): the emulator's factory (tests)
    and the real one never share objects.

    The constants open the body as declarations rather than going in as template
    arguments: with template arguments MLX rebuilds the instantiation's name at every
    call (a std::regex and a string stream), which measured about 4 us of host time a
    call (benchmarks/kernel_call_cost.py), for every layer at every decode step."""
    factory = mx.fast.metal_kernel
    key = (name, id(factory), constants)
    k = _kernels.get(key)
    if k is None:
        k = factory(
            name="_".join([name, *(_constant_tag(v) for _, v in constants)]),
            input_names=list(input_names),
            output_names=list(output_names),
            source=_declarations(constants) + _source(source_file),
            header=_source("kvarn_common.h"),
        )
        _kernels[key] = k
    return k


# The type names MLX's generated signatures use.
_METAL_TYPES = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.uint8: "uint8_t",
    mx.uint32: "uint32_t",
    mx.int32: "int32_t",
}


def _declarations(constants):
    lines = []
    for n, v in constants:
        if isinstance(v, mx.Dtype):
            lines.append(f"typedef {_METAL_TYPES[v]} {n};")
        elif isinstance(v, bool):
            lines.append(f"constexpr bool {n} = {'true' if v else 'false'};")
        else:
            lines.append(f"constexpr int {n} = {int(v)};")
    return "".join(line + "\n" for line in lines)


def _constant_tag(v):
    if isinstance(v, mx.Dtype):
        return _METAL_TYPES[v].removesuffix("_t")
    return str(int(v))


# Tile quantization ------------------------------------------------------------------


def quantize_unsupported(x, bits, iters, scale_dtype):
    if x.ndim < 2:
        return f"input of shape {tuple(x.shape)}"
    G, D = x.shape[-2:]
    if D not in KERNEL_DIMS:
        return f"head dim {D} (kernel dims: {KERNEL_DIMS})"
    if G < 16 or G > 256 or G & (G - 1):
        return f"tile size {G} (kernel: a power of two in 16..256)"
    if bits not in KERNEL_BITS:
        return f"{bits}-bit codes (kernel bits: {KERNEL_BITS})"
    if G * bits % 32:  # key rows are a channel's G codes, bitstream-packed into whole words
        return f"tile size {G} at {bits} bits (G*bits must fill uint32 words)"
    if x.dtype not in FLOAT_DTYPES:
        return f"input dtype {x.dtype}"
    if scale_dtype not in quant._SCALE_DTYPES or scale_dtype == "fp8":
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
    k = _kernel(
        "kvarn_quantize_tiles",
        ["tiles"],
        ["words", "a", "b", "col"],
        "quantize_tiles.metal",
        (
            ("T", x.dtype),
            ("S", sdt),
            ("D", D),
            ("G", G),
            ("BITS", bits),
            ("ITERS", iters),
            ("KEYS", bool(keys)),
            ("ROT", bool(rotated)),
            ("NSG", nsg),
        ),
    )
    if keys:
        shapes = [(nt, D, G * bits // 32), (nt, D), (nt, D), (nt, G)]
    else:
        shapes = [(nt, G, D * bits // 32), (nt, G), (nt, G), (nt, D)]
    words, a, b, col = k(
        inputs=[x.reshape(nt, G, D)],
        grid=(32 * nsg, nt, 1),
        threadgroup=(32 * nsg, 1, 1),
        output_shapes=shapes,
        output_dtypes=[mx.uint32, sdt, sdt, sdt],
    )
    return tuple(o.reshape(*lead, *s[1:]) for o, s in zip((words, a, b, col), shapes))


def quantize_keys_metal(k, bits, iters=8, rotated=True, scale_dtype="float16"):
    """Key tiles k [..., G, D] -> (words [..., D, G*bits/32], a [..., D], b [..., D], t [..., G]);
    for input quantize_unsupported accepts."""
    return _quantize_metal(k, bits, iters, rotated, scale_dtype, keys=True)


def quantize_values_metal(v, bits, iters=8, rotated=True, scale_dtype="float16"):
    """Value tiles v [..., G, D] -> (words [..., G, D*bits/32], a [..., G], b [..., G], c [..., D]);
    for input quantize_unsupported accepts."""
    return _quantize_metal(v, bits, iters, rotated, scale_dtype, keys=False)


# Attention over the packed cache ----------------------------------------------------

_ATT_THREADS = 256
_ATT_TARGET_GROUPS = 256  # aim for about this many threadgroups in pass 1
_TG_MEM = 32768


def attention_unsupported(q, view: StepView):
    """Why packed_attention_metal cannot take these queries over this view, or None."""
    memo = _step_memo(q, view)
    if memo is None:
        return _unsupported(q, view)
    if memo.reason is _UNKNOWN:
        memo.reason = _unsupported(q, view)
    return memo.reason


# A decode step asks every layer the same questions (can the kernel run, with which
# plan and fixed inputs); a layer's answers are kept, by its tile storage, while what
# they depend on is the same as at the last step: tile count, query shape and dtype,
# bits, the width and dtype of the recent tokens' buffer, and (by identity, cheaper than a key)
# sink and rotation flags.
_UNKNOWN = object()
# id(tile storage) -> _StepMemo; an entry leaves with its storage (it holds the tile
# arrays and the sink, which must not outlive the cache)
_step_memos = {}


class _StepMemo:
    __slots__ = ("tiles", "n_tiles", "q", "bits", "sink", "width", "rotate_k", "reason", "calls")

    def __init__(self, q, view, width):
        key = id(view.tiles)
        self.tiles = weakref.ref(view.tiles, lambda _: _step_memos.pop(key, None))
        self.n_tiles, self.q = view.n_tiles, (q.shape, q.dtype)
        self.bits = (view.k_bits, view.v_bits, view.rotate_v)
        self.sink, self.width, self.rotate_k = view.sink_k, width, view.rotate_k
        self.reason, self.calls = _UNKNOWN, {}


def _recent_buffers(view):
    """What the kernel reads as the recent tokens: a view's whole tail buffer when it
    has one (its count goes in row_lens), else its recent tokens."""
    room = view.recent_room
    if room is not None and room[0].shape[2]:
        return room
    return view.recent_k, view.recent_v


def _step_memo(q, view):
    """The layer's memo for this step (made anew when anything it depends on changed), or
    None for a view without tiles."""
    tiles = view.tiles
    if tiles is None:
        return None
    # attention_unsupported, then the call: one lookup. Kept in the view's __dict__,
    # not a field, so that dataclasses.replace does not carry it to another view.
    asked = view.__dict__.get("_memo")
    if (
        asked is not None
        and asked[0] == (q.shape, q.dtype)
        and asked[1].rotate_k is view.rotate_k
        and asked[1].n_tiles == view.n_tiles
    ):
        return asked[1]
    recent = _recent_buffers(view)[0]
    width = (recent.shape[2], recent.dtype)
    memo = _step_memos.get(id(tiles))
    if (
        memo is None
        or memo.tiles() is not tiles
        or memo.n_tiles != view.n_tiles
        or memo.sink is not view.sink_k
        or memo.width != width
        or memo.rotate_k is not view.rotate_k
        or memo.q != (q.shape, q.dtype)
        or memo.bits != (view.k_bits, view.v_bits, view.rotate_v)
    ):
        memo = _step_memos[id(tiles)] = _StepMemo(q, view, width)
    view.__dict__["_memo"] = ((q.shape, q.dtype), memo)
    return memo


def _unsupported(q, view):
    if q.ndim != 4:
        return f"query of shape {tuple(q.shape)}"
    B, Hq, L, D = q.shape
    Hkv = view.sink_k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        return f"{Hq} query heads over {Hkv} kv heads"
    if L > 8:
        return f"query length {L} (kernel: <= 8; prefill uses the ops path)"
    if D not in KERNEL_DIMS:
        return f"head dim {D} (kernel dims: {KERNEL_DIMS})"
    if view.tiles is None:
        return "a cache without tiles"
    for x in (q, view.sink_k, view.recent_k):
        if x.dtype not in FLOAT_DTYPES:
            return f"{'query' if x is q else 'sink/tail'} dtype {x.dtype}"
    return _tiles_unsupported(view.tiles, view.k_bits, view.v_bits)


# Per tile storage: what the kernel checks of it, found once (a decode step asks every layer).
_tile_checks = weakref.WeakKeyDictionary()


def _tiles_unsupported(tiles, k_bits, v_bits):
    checks = _tile_checks.setdefault(tiles, {})
    if (k_bits, v_bits) not in checks:
        checks[k_bits, v_bits] = _check_tiles(tiles, k_bits, v_bits)
    return checks[k_bits, v_bits]


def _check_tiles(tiles, k_bits, v_bits):
    G = tiles.group_size
    if G not in (32, 64, 128, 256):
        return f"tile size {G}"
    if k_bits not in KERNEL_BITS or v_bits not in KERNEL_BITS:
        return f"{k_bits}/{v_bits}-bit codes"
    sdts = {x.dtype for x in tiles.arrays() if x.dtype != mx.uint32}
    if len(sdts) != 1 or next(iter(sdts)) not in (*FLOAT_DTYPES, mx.uint8):  # uint8: e4m3 scales
        return f"scale dtypes {sorted(str(d) for d in sdts)}"
    if tiles.k_words.dtype != mx.uint32 or tiles.v_words.dtype != mx.uint32:
        return f"code words of dtype {tiles.k_words.dtype}"
    return None


def _rows_per_group(R, D, G):
    rc = min(R, 8)
    while rc > 1 and 4 * (2 * rc * D + 3 * rc * G + 2 * rc) > _TG_MEM - 1024:  # QR, QA; SS, PA, PB
        rc //= 2
    return rc


def packed_attention_metal(q, view: StepView, scale, causal=True, row_lens=None):
    """Attention of queries q [B, Hq, L, D] (unrotated, L <= 8) over one layer's
    StepView: sink + tiles [0, view.n_tiles) of the storage + recent tokens; one
    softmax, causal for L > 1. Returns [B, Hq, L, D] in q's dtype. For input
    attention_unsupported accepts. The tile storage is passed whole (tile-major,
    so its arrays are [capacity, B*H, ...] as they are): no slice, no copy.

    A decode step builds this for every layer: few ops, no reshapes (q's rows
    [B, Hq, L] are already the kernel's (b, kv head, rep, i) rows), and what the
    shapes decide (templates, grids, the params array) found once per shape.

    row_lens: int32 [B, 3], per batch row its own tiles, sink and tail tokens,
    where a batch's rows pad to the longest (batch_cache.py); None: all of them.
    A view whose recent tokens start a buffer (view.recent_room, a cache's tail)
    passes the whole buffer and its count: no strided slice for the kernel to copy."""
    sk, rk = view.sink_k, view.recent_k
    S, Tn = sk.shape[2], rk.shape[2]
    kv_dtype = sk.dtype if S else (rk.dtype if Tn else mx.float16)
    own_lens = row_lens is None
    memo = _step_memo(q, view)
    key = (kv_dtype, bool(causal), own_lens)
    call = None if memo is None else memo.calls.get(key)
    if call is None:
        call = _Call(q, view, kv_dtype, bool(causal), own_lens, row_lens)
        if memo is not None:
            memo.calls[key] = call
    plan = call.plan
    if own_lens:
        row_lens = _lengths(plan.head[0], S, Tn)
    split, combine = plan.kernels()
    tail_k, tail_v = call.recent(view)
    o_part, m_part, l_part = split(
        inputs=[q, call.rot_k, *call.fixed, tail_k, tail_v, call.params, row_lens, _scalar(scale)],
        grid=plan.split_grid,
        threadgroup=(_ATT_THREADS, 1, 1),
        output_shapes=plan.split_shapes,
        output_dtypes=_PARTS_DTYPES,
    )
    (out,) = combine(
        inputs=[o_part, m_part, l_part, call.params],
        grid=plan.combine_grid,
        threadgroup=plan.combine_threadgroup,
        output_shapes=plan.combine_shapes,  # rows bh*R + r are q's rows
        output_dtypes=plan.combine_dtypes,
    )
    return out


_PARTS_DTYPES = [mx.float32, mx.float32, mx.float32]


class _Call:
    """What a packed_attention_metal call takes besides the query, its row lengths, the
    scale and the recent tokens (read from the view at each call: a tail buffer is
    written in place at every step): the plan, the sink and tile inputs and the
    params array."""

    def __init__(self, q, view, kv_dtype, causal, own_lens, row_lens):
        self.plan = plan = _plan(q, view, kv_dtype, causal)
        S = view.sink_k.shape[2]
        # A single cache's whole tail buffer, its count in row_lens; a batch's recent
        # tokens as the view holds them, each row's count in row_lens.
        Tn = _recent_buffers(view)[0].shape[2] if own_lens else view.recent_k.shape[2]
        n_rows = 1 if own_lens else row_lens.shape[0]
        self.params = plan.params.get((Tn, n_rows))
        if self.params is None:
            self.params = plan.params[Tn, n_rows] = _evaluated(
                mx.array([*plan.head, Tn, *plan.rest, n_rows], mx.int32)
            )
        self.kv_dtype, self.own_lens, self.n_tail = kv_dtype, own_lens, Tn
        # The sink and the tile storage are never written in place (a write to the
        # storage changes the tile count, a new sink is a new array): kept as they are.
        self.fixed = (
            self._dense(view.sink_k, S),
            self._dense(view.sink_v, S),
            *view.tiles.arrays(),
        )
        self.rot_k = _rotation_flags(view.rotate_k, q.shape[0], view.sink_k.shape[1])

    def _dense(self, x, n):
        if n == 0:
            return _placeholder(self.kv_dtype)  # never read; avoids zero-size buffers
        return x.astype(self.kv_dtype)

    def recent(self, view):
        rk, rv = _recent_buffers(view) if self.own_lens else (view.recent_k, view.recent_v)
        if self.n_tail and rk.dtype == self.kv_dtype and rv.dtype == self.kv_dtype:
            return rk, rv  # as they are: no astype call
        return self._dense(rk, self.n_tail), self._dense(rv, self.n_tail)


class _Plan:
    """What packed_attention_metal's shapes decide, and its params arrays by tail length."""

    def __init__(self, q, view, kv_dtype, causal):
        B, Hq, L, D = q.shape
        tiles = view.tiles
        Hkv, S = view.sink_k.shape[1], view.sink_k.shape[2]
        G = tiles.group_size
        n_tiles = min(view.n_tiles, tiles.capacity)
        R, BH = Hq // Hkv * L, B * Hkv
        rc = _rows_per_group(R, D, G)
        n_rc = -(-R // rc)
        n_split = 0
        tps = 1
        if n_tiles:
            want = max(1, -(-_ATT_TARGET_GROUPS // (BH * n_rc)))
            tps = -(-n_tiles // min(n_tiles, want))
            n_split = -(-n_tiles // tps)
        NS = n_split + 2  # sink split, tile splits, tail split
        # params: [n_tiles, BH, S, Tn, tps, L, R, causal, NS, n_rc, Hkv, n_rows], Tn per
        # step, n_rows: of row_lens
        self.head, self.rest = (n_tiles, BH, S), (tps, L, R, int(causal), NS, n_rc, Hkv)
        self.params = {}
        self.split_constants = (
            ("T", kv_dtype),
            ("SC", tiles.k_a.dtype),
            ("D", D),
            ("G", G),
            ("KB", view.k_bits),
            ("VB", view.v_bits),
            ("RC", rc),
        )
        self.split_grid = (_ATT_THREADS, NS, BH * n_rc)
        self.split_shapes = [(BH, NS, R, D), (BH, NS, R), (BH, NS, R)]
        self.combine_constants = (("T", q.dtype), ("D", D), ("ROT", bool(view.rotate_v)))
        self.combine_grid = (D, BH * R, 1)
        self.combine_threadgroup = (D, 1, 1)  # D <= 256: one threadgroup per row
        self.combine_shapes = [(B, Hq, L, D)]
        self.combine_dtypes = [q.dtype]
        self._kernels = (None, None, None)  # (factory, split, combine)

    def kernels(self):
        """The two kernels of these constants, from the current factory."""
        if self._kernels[0] is not mx.fast.metal_kernel:
            split = _kernel(
                "kvarn_attention_split",
                _SPLIT_INPUTS,
                ["o_part", "m_part", "l_part"],
                "attention_split.metal",
                self.split_constants,
            )
            combine = _kernel(
                "kvarn_attention_combine",
                ["o_part", "m_part", "l_part", "params"],
                ["out"],
                "attention_combine.metal",
                self.combine_constants,
            )
            self._kernels = (mx.fast.metal_kernel, split, combine)
        return self._kernels[1:]


_plans = {}


def _plan(q, view, kv_dtype, causal):
    tiles = view.tiles
    key = (
        *q.shape,
        *view.sink_k.shape[1:3],
        kv_dtype,
        tiles.k_a.dtype,
        tiles.group_size,
        min(view.n_tiles, tiles.capacity),
        view.k_bits,
        view.v_bits,
        bool(view.rotate_v),
        q.dtype,
        causal,
        _ATT_TARGET_GROUPS,
    )
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) > 4096:  # shapes of caches long gone
            _plans.clear()
        plan = _plans[key] = _Plan(q, view, kv_dtype, causal)
    return plan


_SPLIT_INPUTS = [
    "q",
    "rot_k",
    "sink_k",
    "sink_v",
    "k_words",
    "k_a",
    "k_b",
    "k_t",
    "v_words",
    "v_a",
    "v_b",
    "v_c",
    "tail_k",
    "tail_v",
    "params",
    "row_lens",
    "scale",
]
_constants = {}


_flags = {}
_lens = {}


def _lengths(n_tiles, S, Tn):
    """row_lens of a view whose rows all hold every token: [[n_tiles, S, Tn]], made once."""
    key = (n_tiles, S, Tn)
    if key not in _lens:
        if len(_lens) > 4096:
            _lens.clear()
        _lens[key] = mx.array([key], mx.int32)
    return _lens[key]


def _rotation_flags(rot, B, H):
    """Whether each (batch row, kv head) bh's keys are stored rotated, int32 [B*H], from a
    cache's rotate_k (a bool, a bool per kv head [H], or a batch's [B, H]); made once per
    flag array (lazily: the first step computes it, later steps read it)."""
    if not isinstance(rot, mx.array):
        key = ("rot", bool(rot), B * H)
        if key not in _constants:
            _constants[key] = _evaluated(mx.full((B * H,), int(bool(rot)), mx.int32))
        return _constants[key]
    key = (id(rot), B, H)
    hit = _flags.get(key)
    if hit is None or hit[0] is not rot:
        if len(_flags) > 4096:  # flags of caches long gone
            _flags.clear()
        flags = rot.astype(mx.int32).reshape(-1, H)
        hit = _flags[key] = (rot, mx.broadcast_to(flags, (B, H)).reshape(B * H))
    return hit[1]


def _placeholder(dtype):
    """A one-element array of dtype, made once."""
    if ("zero", dtype) not in _constants:
        _constants["zero", dtype] = _evaluated(mx.zeros((1,), dtype))
    return _constants["zero", dtype]


def _scalar(scale):
    """The softmax scale as a float32 [1] input, made once per value."""
    key = ("scale", float(scale))
    if key not in _constants:
        _constants[key] = _evaluated(mx.array([float(scale)], dtype=mx.float32))
    return _constants[key]


def _evaluated(x):
    """x computed now: a constant shared by graphs built on any thread or stream."""
    mx.eval(x)
    return x


# Self-test on a real device ---------------------------------------------------------

_self_test_result = None


def _self_test() -> bool:
    """Once per process: run both kernels on a small case and compare with the
    MLX ops path (tile quantization) and with dense attention over the
    dequantized tiles. A kernel that fails to build or disagrees on this device
    turns the kernels off (one log line) instead of giving wrong answers."""
    global _self_test_result
    if _self_test_result is None:
        try:
            x = mx.random.normal((1, 2, 2, 64, 64), key=mx.random.key(0))  # [B, H, tiles, G, D]
            k_tiles = _quantize_metal(x, 4, 8, True, "float32", keys=True)
            v_tiles = _quantize_metal(x, 2, 8, True, "float32", keys=False)
            k_ops, v_ops = (
                quant.quantize_keys(x, 4, 8, True, "float32"),
                quant.quantize_values(x, 2, 8, True, "float32"),
            )
            q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(1))
            sink, tail = x[:, :, 0, :16], x[:, :, 1, :5]
            storage = append(None, Tiles(*k_tiles, *v_tiles), 0)
            got = packed_attention_metal(
                q, StepView(sink, sink, storage, 2, tail, tail, 4, 2), 0.125
            )
            k, v = Tiles(*k_ops, *v_ops).dequantize(4, 2, True, True)
            want = mx.fast.scaled_dot_product_attention(
                q,
                mx.concatenate([sink, k, tail], axis=2),
                mx.concatenate([sink, v, tail], axis=2),
                scale=0.125,
            )

            # Loose bounds: near-tied normalization iterates may legitimately differ
            # (tests/test_kernels.py holds the kernels to the reference tightly).
            def close(a, b, tol):
                return (mx.abs(a - b).mean() <= tol * mx.abs(b).mean()).item()

            _self_test_result = (
                close(quant.dequantize_keys(*k_tiles, 4), quant.dequantize_keys(*k_ops, 4), 0.05)
                and close(
                    quant.dequantize_values(*v_tiles, 2), quant.dequantize_values(*v_ops, 2), 0.05
                )
                and close(got, want, 0.05)
            )
            if not _self_test_result:
                log.warning(
                    "kvarn_mlx: the Metal kernels disagree with the MLX ops path on this device; "
                    "using the ops path (please report this with your chip and macOS version)"
                )
        except Exception as e:  # a kernel that does not build here
            log.warning(
                f"kvarn_mlx: the Metal kernels failed on this device ({e}); using the MLX ops path"
            )
            _self_test_result = False
    return _self_test_result
