"""Tile caches that quantize another way than KVarN, on KVarNCache's token flow
(the same sink, tiles quantized once when the tail fills, and tail): each
replaces only KVarNCache.quantize, the step from full-precision tiles to Tiles.

OracleKeysCache keeps KVarN's tile layout, so packed attention reads it as it
reads KVarN's. The others store what that layout cannot express (mlx-lm's
per-token affine groups, one side in full precision); attention over them runs
on their dequantized tokens.
"""

import mlx.core as mx

from .. import dispatch, quant
from ..cache import KVarNCache
from ..tiles import StepView, Tiles


class OracleKeysCache(KVarNCache):
    """Keys: rotated, divided per token by its exact std over channels (float32,
    from the full-precision tile), per-channel RTN, the std kept as the token
    scale t. Values: rotation only (iters=0). Asks whether exact token scales
    alone close the gap to KVarN's iterated dual scaling."""

    def quantize(self, k, v):
        c = self.config
        M = mx.swapaxes(
            quant.rotated_where(self.rotate_k, k.astype(mx.float32), quant.rotate), -1, -2
        )  # [.., D, G]
        t = mx.maximum(mx.sqrt(mx.var(M, axis=-2, keepdims=True, ddof=1)), 1e-6)
        code, scale, lo = quant.rtn(M / t, c.k_bits)
        dt = getattr(mx, c.scale_dtype)
        keys = (
            quant.pack(code, c.k_bits),
            scale[..., 0].astype(dt),
            lo[..., 0].astype(dt),
            t[..., 0, :],
        )
        return Tiles(*keys, *dispatch.quantize_values(v, c.v_bits, 0, self.rotate_v, c.scale_dtype))


class _DequantizedView(KVarNCache):
    """Tiles packed attention cannot read: a step's view holds them dequantized,
    with the recent tokens, in full precision."""

    quantized_sides = ("k", "v")

    def dequantize_tiles(self, tiles):
        """Valid Tiles -> K, V [B, H, n*G, D] in float32."""
        raise NotImplementedError

    def dequantized(self, step=None):
        s = self.step_view() if step is None else step
        if s.tiles is None:
            return super().dequantized(s)
        k, v = self.dequantize_tiles(s.tiles.valid(s.n_tiles))
        return (
            mx.concatenate([s.sink_k, k.astype(s.sink_k.dtype), s.recent_k], axis=2),
            mx.concatenate([s.sink_v, v.astype(s.sink_v.dtype), s.recent_v], axis=2),
        )

    def step_view(self):
        s = super().step_view()
        if s.tiles is None:
            return s
        k, v = self.dequantized(s)
        n = s.sink_k.shape[2]
        return StepView(
            s.sink_k,
            s.sink_v,
            None,
            0,
            k[..., n:, :],
            v[..., n:, :],
            s.k_bits,
            s.v_bits,
            False,
            False,
        )


def _tokens(x):
    """Tiles [B, H, m, G, D] -> tokens [B, H, m*G, D]."""
    B, H, m, G, D = x.shape
    return x.reshape(B, H, m * G, D)


class KeysOnlyCache(_DequantizedView):
    """KVarN on the keys; value tiles stay in the model's dtype (in v_words)."""

    quantized_sides = ("k",)

    def quantize(self, k, v):
        c = self.config
        none = mx.zeros((*k.shape[:3], 0), k.dtype)
        return Tiles(
            *dispatch.quantize_keys(k, c.k_bits, c.iters, self.rotate_k, c.scale_dtype),
            v,
            none,
            none,
            none,
        )

    def dequantize_tiles(self, tiles):
        k = quant.dequantize_keys(*tiles.keys(), self.config.k_bits)
        return _tokens(quant.unrotate(k) if self.rotate_k else k), _tokens(tiles.v_words)


class ValuesOnlyCache(_DequantizedView):
    """KVarN on the values; key tiles stay in the model's dtype (in k_words)."""

    quantized_sides = ("v",)

    def quantize(self, k, v):
        c = self.config
        none = mx.zeros((*k.shape[:3], 0), k.dtype)
        return Tiles(
            k,
            none,
            none,
            none,
            *dispatch.quantize_values(v, c.v_bits, c.iters, self.rotate_v, c.scale_dtype),
        )

    def dequantize_tiles(self, tiles):
        c = self.config
        v = quant.dequantize_values(tiles.v_words, tiles.v_a, tiles.v_b, tiles.v_c, c.v_bits)
        return _tokens(tiles.k_words), _tokens(quant.unrotate(v) if self.rotate_v else v)


class AffineCache(_DequantizedView):
    """mx.quantize affine per token along D, groups of 64 (32 if D is not a
    multiple of 64): mlx-lm's QuantizedKVCache format, in tiles."""

    def quantize(self, k, v):
        c = self.config
        none = mx.zeros((*k.shape[:3], 0), mx.float16)
        return Tiles(*self._affine(k, c.k_bits), none, *self._affine(v, c.v_bits), none)

    @staticmethod
    def _affine(x, bits):
        return mx.quantize(x, group_size=64 if x.shape[-1] % 64 == 0 else 32, bits=bits)

    def dequantize_tiles(self, tiles):
        c = self.config
        out = []
        for (w, s, b), bits in (
            ((tiles.k_words, tiles.k_a, tiles.k_b), c.k_bits),
            ((tiles.v_words, tiles.v_a, tiles.v_b), c.v_bits),
        ):
            D = w.shape[-1] * 32 // bits
            x = mx.dequantize(w, s, b, group_size=D // s.shape[-1], bits=bits)
            B, H, m, G, _ = x.shape
            out.append(x.reshape(B, H, m * G, D))
        return tuple(out)
