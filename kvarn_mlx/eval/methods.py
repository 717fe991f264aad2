"""The caches compared by the evaluation, by method name.

Methods, at B = 2 or 4 bits (every tile method uses the same sink and tail):
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
  any preset name (k4v2_g128, ...)
"""

import re

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache, QuantizedKVCache, _BaseCache, create_attention_mask

from .. import quant
from ..cache import KVarNCache
from ..config import PRESETS, KVarNConfig

G = 128  # tile tokens for every tile method
SINK = 128


class TileCache(_BaseCache):
    """Eval-only cache with KVarNCache's token flow (full-precision sink, tiles of
    G tokens quantized once when the tail fills, full-precision tail) and a
    pluggable quantizer per side. It keeps a float copy of the dequantized tiles
    for speed; `nbytes` counts only what a real cache of this format holds
    (quantized arrays, sink and tail)."""

    def __init__(self, k_side, v_side, group_size=G, sink=SINK):
        self.k_side, self.v_side = k_side, v_side
        self.G, self.S = group_size, sink
        self.offset = 0
        self.sink_k = self.sink_v = self.tail_k = self.tail_v = None
        self.k_hat = self.v_hat = None  # dequantized tiles [B, H, n*G, D]
        self.held = []  # quantized arrays, for bytes
        self.n_tiles = 0

    def update_and_fetch(self, keys, values):
        seen_k, seen_v = self.k_hat, self.v_hat
        if self.sink_k is None:
            self.sink_k, self.sink_v = keys[..., :0, :], values[..., :0, :]
            self.tail_k, self.tail_v = keys[..., :0, :], values[..., :0, :]
        self.offset += keys.shape[2]
        n = max(0, min(keys.shape[2], self.S - self.sink_k.shape[2]))
        if n:
            self.sink_k = mx.concatenate([self.sink_k, keys[..., :n, :]], axis=2)
            self.sink_v = mx.concatenate([self.sink_v, values[..., :n, :]], axis=2)
        rk = mx.concatenate([self.tail_k, keys[..., n:, :]], axis=2)
        rv = mx.concatenate([self.tail_v, values[..., n:, :]], axis=2)
        m = rk.shape[2] // self.G
        if m:
            self._append(rk[..., : m * self.G, :], rv[..., : m * self.G, :])
        self.tail_k, self.tail_v = rk[..., m * self.G :, :], rv[..., m * self.G :, :]
        # Like KVarNCache: this step's queries see tiles quantized before it, the rest exact.
        parts_k = [self.sink_k] + ([seen_k] if seen_k is not None else []) + [rk]
        parts_v = [self.sink_v] + ([seen_v] if seen_v is not None else []) + [rv]
        return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)

    def _append(self, k, v):
        B, H, T, D = k.shape
        m = T // self.G
        out = []
        for side, x in ((self.k_side, k), (self.v_side, v)):
            held = side.quantize(x.reshape(B, H, m, self.G, D))
            self.held.append((side, held))
            out.append(side.dequantize(held).reshape(B, H, T, D).astype(x.dtype))
        self.k_hat = out[0] if self.k_hat is None else mx.concatenate([self.k_hat, out[0]], axis=2)
        self.v_hat = out[1] if self.v_hat is None else mx.concatenate([self.v_hat, out[1]], axis=2)
        self.n_tiles += m

    def fetch_all(self):
        """All tokens with every whole tile quantized (for the static measurement)."""
        parts_k = [self.sink_k] + ([self.k_hat] if self.k_hat is not None else []) + [self.tail_k]
        parts_v = [self.sink_v] + ([self.v_hat] if self.v_hat is not None else []) + [self.tail_v]
        return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)

    def size(self):
        return self.offset

    def empty(self):
        return self.sink_k is None

    def make_mask(self, N, return_array=False, window_size=None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def nbytes_breakdown(self):
        quantized = sum(a.nbytes for _, h in self.held for a in h if isinstance(a, mx.array))
        sink_tail = sum(x.nbytes for x in (self.sink_k, self.sink_v, self.tail_k, self.tail_v) if x is not None)
        return {"quantized": quantized, "sink_tail": sink_tail, "total": quantized + sink_tail}

    @property
    def nbytes(self):
        return self.nbytes_breakdown()["total"]


class KVarNSide:
    """KVarN's tile quantizer for one side (any iters / rotation)."""

    def __init__(self, key, bits, iters=8, rotate=True):
        self.key, self.bits, self.iters, self.rotate = key, bits, iters, rotate

    def quantize(self, x):
        f = quant.quantize_keys if self.key else quant.quantize_values
        return f(x, self.bits, self.iters, self.rotate and quant.can_rotate(x.shape[-1]))

    def dequantize(self, held):
        f = quant.dequantize_keys if self.key else quant.dequantize_values
        x = f(*held, self.bits)
        return quant.unrotate(x) if self.rotate and quant.can_rotate(x.shape[-1]) else x


class FullSide:
    """No quantization: the tile stays in the model's dtype."""

    def quantize(self, x):
        return (x,)

    def dequantize(self, held):
        return held[0]


class AffineSide:
    """mx.quantize affine, per token along D in groups of 64 (mlx-lm's QuantizedKVCache format)."""

    def __init__(self, bits, group_size=64):
        self.bits, self.gs = bits, group_size

    def quantize(self, x):
        gs = self.gs if x.shape[-1] % self.gs == 0 else 32
        return (*mx.quantize(x, group_size=gs, bits=self.bits), gs)

    def dequantize(self, held):
        w, s, b, gs = held
        return mx.dequantize(w, s, b, group_size=gs, bits=self.bits)


class OracleKeySide:
    """Keys: rotate, divide each token by its exact std over channels (float32,
    from the full-precision tile), per-channel RTN, multiply back. Tests whether
    exact token scales alone close the gap to KVarN's iterated dual scaling."""

    def __init__(self, bits):
        self.bits = bits

    def quantize(self, x):
        M = mx.swapaxes(quant.rotate(x.astype(mx.float32)), -1, -2)  # [..., D, G]
        t = mx.maximum(mx.sqrt(mx.var(M, axis=-2, keepdims=True, ddof=1)), 1e-6)
        code, scale, lo = quant.rtn(M / t, self.bits)
        return quant.pack(code, self.bits), scale[..., 0].astype(mx.float16), lo[..., 0].astype(mx.float16), t[..., 0, :]

    def dequantize(self, held):
        return quant.unrotate(quant.dequantize_keys(*held, self.bits))


# -- methods -------------------------------------------------------------------

_FAMILIES = ("kvarn", "kivi", "rot", "norm", "oracle", "affine", "mlxq", "konly", "vonly", "plaink", "auto")


def method_config(name):
    """KVarNConfig for the KVarNCache methods, else None."""
    if name in PRESETS:
        return PRESETS[name]
    fam, b = _parse(name)
    if fam in ("kvarn", "kivi", "rot", "norm"):
        iters = 8 if fam in ("kvarn", "norm") else 0
        rot = fam in ("kvarn", "rot")
        return KVarNConfig(k_bits=b, v_bits=b, group_size=G, sink=SINK, iters=iters, rotate_keys=rot, rotate_values=rot)
    if fam in ("plaink", "auto"):  # KVarN without key rotation / with it chosen per kv head (values rotated)
        return KVarNConfig(k_bits=b, v_bits=b, group_size=G, sink=SINK, rotate_keys=fam == "auto")
    return None


def _parse(name):
    m = re.fullmatch(r"([a-z]+)([24])", name)
    if not m or m.group(1) not in _FAMILIES:
        raise ValueError(f"unknown method {name!r}: use fp, a preset ({', '.join(PRESETS)}) or one of "
                         f"{', '.join(f + '2' for f in _FAMILIES)} (or ...4)")
    return m.group(1), int(m.group(2))


def make_caches(model, name):
    """One cache per layer for method `name` (plain KVCache layers only)."""
    caches = mlx_cache.make_prompt_cache(model)
    if name == "fp":
        return caches
    cfg = method_config(name)
    if cfg is None:
        fam, b = _parse(name)
        k_side, v_side = {
            "oracle": (OracleKeySide(b), KVarNSide(False, b, iters=0)),
            "affine": (AffineSide(b), AffineSide(b)),
            "konly": (KVarNSide(True, b), FullSide()),
            "vonly": (FullSide(), KVarNSide(False, b)),
            "mlxq": (None, None),
        }[fam]
    for i, c in enumerate(caches):
        if type(c) is not KVCache:
            continue
        if cfg is not None:
            caches[i] = KVarNCache(cfg)
        elif fam == "mlxq":
            caches[i] = QuantizedKVCache(group_size=64, bits=b)
        else:
            caches[i] = TileCache(k_side, v_side)
    return caches


def method_bits(name):
    if name == "fp":
        return "16/16"
    cfg = method_config(name)
    if cfg is not None:
        return f"{cfg.k_bits}/{cfg.v_bits}"
    fam, b = _parse(name)
    return {"konly": f"{b}/fp", "vonly": f"fp/{b}"}.get(fam, f"{b}/{b}")


def cache_bytes(caches):
    """Measured bytes held by the caches (arrays, not formulas) and bits per
    quantized element (codes + scales over the elements stored in tiles)."""
    total = qbytes = qelems = tokens = 0
    for c in caches:
        if isinstance(c, KVarNCache):
            if c.empty():
                continue
            b = c.nbytes_breakdown()
            total += b["total"] - b["unused"]
            qbytes += b["codes"] + b["scales"]
            B, H, _, D = c.sink_k.shape
            qelems += 2 * B * H * c.n_tiles * c.config.group_size * D
        elif isinstance(c, TileCache):
            if c.empty():
                continue
            b = c.nbytes_breakdown()
            total += b["total"]
            # bits/element over the quantized side(s) only (K-only / V-only keep the other exact)
            held = [a for side, h in c.held if not isinstance(side, FullSide) for a in h if isinstance(a, mx.array)]
            qbytes += sum(a.nbytes for a in held)
            B, H, _, D = c.sink_k.shape
            sides = sum(not isinstance(s, FullSide) for s in (c.k_side, c.v_side))
            qelems += sides * B * H * c.n_tiles * c.G * D
        elif isinstance(c, QuantizedKVCache):
            if c.keys is None:
                continue
            used = sum(x.nbytes * c.offset // x.shape[2] for x in (*c.keys, *c.values))
            total += used
            qbytes += used
            B, H, _, _ = c.keys[0].shape
            qelems += 2 * B * H * c.offset * c.keys[0].shape[-1] * 32 // c.bits
        elif isinstance(c, KVCache):
            if c.keys is None:
                continue
            total += c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes
    bits = 8 * qbytes / qelems if qelems else None
    return {"bytes": int(total), "bits_per_quantized_element": bits}


def fp16_bytes(model, tokens):
    """What mlx-lm's KVCache holds for `tokens` tokens in a 2-byte dtype."""
    args = model.args
    H = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    D = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    return 2 * len(model.layers) * H * tokens * D * 2


