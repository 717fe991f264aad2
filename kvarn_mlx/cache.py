"""KVarNCache: an mlx-lm KV cache that holds its tokens as KVarN tiles.

Layout per layer (B batch rows, H kv heads, D head dim, G tile tokens):
    sink_k/v  [B, H, S, D]   first S tokens, model dtype
    tiles     [B, H, N, ...] quantized tiles in the rotated space (KVARN_SPEC 4, 7):
        k_words [.., D, G*kbits/32], k_a, k_b [.., D], k_t [.., G]
        v_words [.., G, D*vbits/32], v_a, v_b [.., G], v_c [.., D]
    tail_k/v  [B, H, <G, D]  newest tokens that do not fill a tile, model dtype
Tiles are quantized once, when the tail fills, and never again.
"""

import logging
import weakref

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from . import kernels, quant
from .config import DEFAULT_PRESET, FP16, KVarNConfig, get_preset

log = logging.getLogger("kvarn_mlx")

_TILE_ARRAYS = ("k_words", "k_a", "k_b", "k_t", "v_words", "v_a", "v_b", "v_c")
_SETTINGS = ("k_bits", "v_bits", "group_size", "sink", "iters", "scale_dtype", "rotate_keys", "rotate_values")
_warned = set()


def _warn_once(msg):
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


class KVarNCache(_BaseCache):
    """KV cache quantized with KVarN; drop-in for mlx-lm's KVCache.

    Attention over it runs in the packed domain once `kvarn_mlx.patch()` is on
    (make_cache does that); `update_and_fetch` still returns correct, lazily
    dequantized keys and values for code that bypasses the patched entry point.
    A step attends to its own tokens in full precision for as long as the
    arrays update_and_fetch returned are alive (as in every mlx-lm model).
    """

    step_tiles = 4  # tile storage grows by at least this many tiles
    tail_step = 32  # the tail buffer grows by this many tokens

    def __init__(self, config: KVarNConfig | str = DEFAULT_PRESET):
        self.config = get_preset(config) if isinstance(config, str) else config
        self.offset = 0
        # Rotation flags, decided at the first update from the config and head dim;
        # rotate_k becomes a bool array [H] once an "auto" decision is made.
        self.rotate_k = self.rotate_v = None
        self._key_candidates = None  # "auto": both key variants of the first tiles, until decided
        self.n_sink = self.n_tiles = self.n_tail = 0
        self.sink_k = self.sink_v = self.tail_k = self.tail_v = None
        for name in _TILE_ARRAYS:
            setattr(self, name, None)
        # What this step's attention sees: tiles [0, n_seen) plus `recent` in full precision.
        self._n_seen = 0
        self._recent = None

    # -- writing -------------------------------------------------------------

    def update_and_fetch(self, keys, values):
        B, H, L, D = keys.shape
        G, S = self.config.group_size, self.config.sink_size
        if self.rotate_k is None:
            self._start(keys, values)
        else:
            # Check before changing anything: a mismatch (e.g. a prompt-cache file made for
            # another model) must leave the cache as it was.
            for x, held in ((keys, self.sink_k), (values, self.sink_v)):
                if x.shape[:2] != held.shape[:2] or x.shape[3] != held.shape[3]:
                    b, h, _, d = held.shape
                    raise ValueError(
                        f"this KVarNCache holds batch {b}, {h} kv heads, head dim {d}; got keys/values of "
                        f"shape {tuple(x.shape)} (a prompt cache made for another model?)")
        self._n_seen = self.n_tiles
        self.offset += L

        # 1. The sink fills first.
        # It grows by concatenation: at most S tokens ever, and no unused room.
        n = min(L, S - self.n_sink)
        if n > 0:
            self.sink_k = mx.concatenate([self.sink_k[..., : self.n_sink, :], keys[..., :n, :]], axis=2)
            self.sink_v = mx.concatenate([self.sink_v[..., : self.n_sink, :], values[..., :n, :]], axis=2)
            self.n_sink += n
            keys, values = keys[..., n:, :], values[..., n:, :]
        L = keys.shape[2]

        # 2. The rest joins the tail; every whole tile is quantized, once.
        if self.n_tail + L < G:
            self._grow_tail(self.n_tail + L)
            self.tail_k[..., self.n_tail : self.n_tail + L, :] = keys
            self.tail_v[..., self.n_tail : self.n_tail + L, :] = values
            self.n_tail += L
            self._recent = (self.tail_k[..., : self.n_tail, :], self.tail_v[..., : self.n_tail, :])
        else:
            rk = mx.concatenate([self.tail_k[..., : self.n_tail, :], keys], axis=2)
            rv = mx.concatenate([self.tail_v[..., : self.n_tail, :], values], axis=2)
            self._recent = (rk, rv)
            m = rk.shape[2] // G
            self._append_tiles(rk[..., : m * G, :].reshape(B, H, m, G, D),
                               rv[..., : m * G, :].reshape(B, H, m, G, D))
            self._new_tail(rk[..., m * G :, :], rv[..., m * G :, :])
        keys, values = self.dequantized()
        # `_recent` serves this step's attention only. packed_attention drops it;
        # for models that attend on the returned arrays instead, drop it with them.
        weakref.finalize(keys, _forget_recent, weakref.ref(self), self._recent)
        return keys, values

    def _start(self, keys, values):
        B, H, _, D = keys.shape
        c = self.config
        for bits in (c.k_bits, c.v_bits):
            quant.check_head_dim(D, bits)
        if not quant.can_rotate(D) and (c.rotate_keys or c.rotate_values):
            _warn_once(f"head dim {D} has no Hadamard transform in MLX; KVarN runs without rotation there")
        self.rotate_k = bool(c.rotate_keys) and quant.can_rotate(D)  # "auto" starts rotated
        self.rotate_v = c.rotate_values and quant.can_rotate(D)
        self.sink_k = mx.zeros((B, H, 0, D), keys.dtype)
        self.sink_v = mx.zeros((B, H, 0, D), values.dtype)
        self.tail_k = mx.zeros((B, H, 0, D), keys.dtype)
        self.tail_v = mx.zeros((B, H, 0, D), values.dtype)

    def _grow_tail(self, n):
        """Room for n tail tokens, added tail_step tokens at a time (no per-token copies)."""
        cap = self.tail_k.shape[2]
        if n > cap:
            new_cap = min(-(-n // self.tail_step) * self.tail_step, self.config.group_size)
            pad = [(0, 0), (0, 0), (0, new_cap - cap), (0, 0)]
            self.tail_k, self.tail_v = mx.pad(self.tail_k, pad), mx.pad(self.tail_v, pad)

    def _new_tail(self, k, v):
        """Start a fresh tail buffer holding k, v [B, H, r, D]."""
        r = k.shape[2]
        cap = -(-r // self.tail_step) * self.tail_step
        pad = [(0, 0), (0, 0), (0, cap - r), (0, 0)]
        self.tail_k, self.tail_v = mx.pad(k.astype(self.tail_k.dtype), pad), mx.pad(v.astype(self.tail_v.dtype), pad)
        self.n_tail = r

    def _append_tiles(self, k_tiles, v_tiles):
        """Quantize tiles [B, H, m, G, D] into storage at [n_tiles, n_tiles + m)."""
        c = self.config
        if self._key_candidates is not None:  # nobody decided with queries (fallback path)
            self.decide_key_rotation()
        if c.rotate_keys == "auto" and self.rotate_k is True:
            k = self._quantize_key_candidates(k_tiles)
        else:
            k = self._quantize_keys(k_tiles)
        v = kernels.quantize_values(v_tiles, c.v_bits, c.iters, self.rotate_v, c.scale_dtype)
        m = k_tiles.shape[2]
        need = self.n_tiles + m
        capacity = 0 if self.k_words is None else self.k_words.shape[2]
        if need > capacity:
            # What a prefill needs, or step_tiles more: at most step_tiles - 1 tiles of room. Growing copies
            # the tiles once per step_tiles*G tokens, while every decode step's
            # attention reads all of them: the copies add < 1/(step_tiles*G) to that.
            new_cap = max(need, capacity + self.step_tiles)
            for name, x in zip(_TILE_ARRAYS, (*k, *v)):
                room = mx.zeros((*x.shape[:2], new_cap - capacity, *x.shape[3:]), x.dtype)
                old = getattr(self, name)
                setattr(self, name, room if old is None else mx.concatenate([old, room], axis=2))
        for name, x in zip(_TILE_ARRAYS, (*k, *v)):
            getattr(self, name)[:, :, self.n_tiles : need] = x
        self.n_tiles = need

    def _quantize_keys(self, k_tiles):
        c = self.config
        if isinstance(self.rotate_k, mx.array):  # per-head choice: rotate only those heads
            k_tiles = quant.sanitize(k_tiles)
            k_tiles = mx.where(self.rotate_k[:, None, None, None], quant.rotate(k_tiles), k_tiles)
            return kernels.quantize_keys(k_tiles, c.k_bits, c.iters, False, c.scale_dtype)
        return kernels.quantize_keys(k_tiles, c.k_bits, c.iters, self.rotate_k, c.scale_dtype)

    # -- "auto" key rotation (beyond the paper) ----------------------------------

    def _quantize_key_candidates(self, k_tiles):
        """Quantize the first key tiles both ways; keep both until decide_key_rotation."""
        c = self.config
        rot = kernels.quantize_keys(k_tiles, c.k_bits, c.iters, True, c.scale_dtype)
        plain = kernels.quantize_keys(k_tiles, c.k_bits, c.iters, False, c.scale_dtype)
        self._key_candidates = (k_tiles, rot, plain, self.n_tiles)
        return rot

    def decide_key_rotation(self, queries=None):
        """Per kv head, keep the key variant whose attention over these tiles,
        softmax(q k_hat), is closer (L1) to softmax(q k).

        queries [B, H, rows, D] are the step's unrotated queries, already times
        the softmax scale, grouped by kv head; without them the keys stand in.
        Rotation stays unless the unrotated keys' error is below
        KEY_ROTATION_MARGIN times the rotated keys' error."""
        k_tiles, rot, plain, start = self._key_candidates
        self._key_candidates = None
        B, H, m, G, D = k_tiles.shape
        k = k_tiles.reshape(B, H, m * G, D).astype(mx.float32)
        q = k * D**-0.5 if queries is None else queries.astype(mx.float32)
        p = mx.softmax(q @ mx.swapaxes(k, -1, -2), axis=-1, precise=True)
        c = self.config

        # Softmax ignores score errors that are the same for every key of a query;
        # comparing attention distributions counts only the errors that matter.
        def attention_error(words, a, b, t, rotated):
            k_hat = quant.dequantize_keys(words, a, b, t, c.k_bits).reshape(B, H, m * G, D)
            k_hat = quant.unrotate(k_hat) if rotated else k_hat
            p_hat = mx.softmax(q @ mx.swapaxes(k_hat, -1, -2), axis=-1, precise=True)
            return mx.mean(mx.abs(p_hat - p).sum(axis=-1), axis=(0, 2))  # per kv head

        keep_rot = attention_error(*rot, True) * KEY_ROTATION_MARGIN <= attention_error(*plain, False)
        self.rotate_k = keep_rot
        chosen = [mx.where(keep_rot.reshape(1, H, *([1] * (r.ndim - 2))), r, p) for r, p in zip(rot, plain)]
        for name, x in zip(_TILE_ARRAYS[:4], chosen):
            getattr(self, name)[:, :, start : start + m] = x
        return keep_rot

    def key_rotation_summary(self):
        """(rotated kv heads, all kv heads) for this layer, or None before any decision."""
        if self.rotate_k is None or self._key_candidates is not None:
            return None
        if isinstance(self.rotate_k, mx.array):
            return int(self.rotate_k.sum()), self.rotate_k.size
        return (self.sink_k.shape[1] if self.rotate_k else 0), self.sink_k.shape[1]

    # -- reading -------------------------------------------------------------

    def tiles(self, n=None):
        """The valid tile arrays (first n tiles), in _TILE_ARRAYS order."""
        n = self.n_tiles if n is None else n
        return tuple(getattr(self, name)[:, :, :n] for name in _TILE_ARRAYS)

    def attention_view(self):
        """(sink_k, sink_v, tiles, recent_k, recent_v) for the current step's attention:
        tiles quantized before this step, and everything newer in full precision."""
        sk, sv = self.sink_k[..., : self.n_sink, :], self.sink_v[..., : self.n_sink, :]
        tiles = self.tiles(self._n_seen) if self._n_seen else None
        if self._recent is None:  # e.g. right after loading from a file
            self._n_seen = self.n_tiles
            tiles = self.tiles() if self.n_tiles else None
            self._recent = (self.tail_k[..., : self.n_tail, :], self.tail_v[..., : self.n_tail, :])
        return sk, sv, tiles, *self._recent

    def dequantized(self):
        """All keys and values in token order, model dtype (lazy: costs nothing unless used)."""
        sk, sv, tiles, rk, rv = self.attention_view()
        if tiles is None:
            return mx.concatenate([sk, rk], axis=2), mx.concatenate([sv, rv], axis=2)
        k, v = self._dequantize_tiles(tiles)
        return (mx.concatenate([sk, k.astype(sk.dtype), rk], axis=2),
                mx.concatenate([sv, v.astype(sv.dtype), rv], axis=2))

    def _dequantize_tiles(self, tiles):
        """Tiles -> unrotated float32 K, V [B, H, n*G, D]."""
        c = self.config
        kw, ka, kb, kt, vw, va, vb, vc = tiles
        k = quant.dequantize_keys(kw, ka, kb, kt, c.k_bits)
        v = quant.dequantize_values(vw, va, vb, vc, c.v_bits)
        k = quant.rotated_where(self.rotate_k, k, quant.unrotate)
        v = quant.unrotate(v) if self.rotate_v else v
        B, H, n, G, D = k.shape
        return k.reshape(B, H, n * G, D), v.reshape(B, H, n * G, D)

    # -- mlx-lm cache protocol -------------------------------------------------

    def size(self):
        return self.offset

    def empty(self):
        return self.sink_k is None

    def is_trimmable(self):
        return True

    def make_mask(self, N, return_array=False, window_size=None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def trim(self, n):
        """Drop the newest n tokens. Exact inside the tail; trimming into a
        quantized tile dequantizes that tile back into the tail (approximate)."""
        n = max(0, min(self.offset, n))
        if n == 0:
            return 0
        keep = self.offset - n
        S, G = self.config.sink_size, self.config.group_size
        if keep <= S:
            self.n_sink, self.n_tiles, self.n_tail = keep, 0, 0
        elif keep >= S + self.n_tiles * G:
            self.n_tail = keep - S - self.n_tiles * G
        else:
            i, r = divmod(keep - S, G)
            k, v = self._dequantize_tiles(self.tiles(i + 1))
            self._new_tail(k[..., i * G : i * G + r, :], v[..., i * G : i * G + r, :])
            self.n_tiles = i
        self.offset = keep
        self._n_seen, self._recent = self.n_tiles, None
        return n

    # -- bytes -----------------------------------------------------------------

    def _held(self):
        return [x for x in (self.sink_k, self.sink_v, self.tail_k, self.tail_v,
                            *(getattr(self, a) for a in _TILE_ARRAYS)) if x is not None]

    @property
    def nbytes(self):
        """Bytes of the arrays this cache holds, preallocated room included."""
        return sum(x.nbytes for x in self._held())

    def nbytes_breakdown(self):
        """Held bytes split into codes, scales, sink+tail (used), unused room, and total."""
        out = {"codes": 0, "scales": 0, "sink_tail": 0, "unused": 0}
        if self.empty():
            return {**out, "total": 0}
        for name in _TILE_ARRAYS:
            x = getattr(self, name)
            if x is None:
                continue
            used = x.nbytes * self.n_tiles // x.shape[2]
            out["codes" if name.endswith("words") else "scales"] += used
            out["unused"] += x.nbytes - used
        for x, n in ((self.sink_k, self.n_sink), (self.sink_v, self.n_sink),
                     (self.tail_k, self.n_tail), (self.tail_v, self.n_tail)):
            used = x.nbytes * n // x.shape[2] if x.shape[2] else 0
            out["sink_tail"] += used
            out["unused"] += x.nbytes - used
        out["total"] = sum(out.values())
        return out

    def fp16_nbytes(self):
        """What mlx-lm's KVCache would hold for these tokens in a 2-byte dtype, unpadded."""
        if self.empty():
            return 0
        B, H, _, D = self.sink_k.shape
        return 2 * B * H * self.offset * D * 2

    # -- prompt-cache files ----------------------------------------------------

    @property
    def state(self):
        if self._key_candidates is not None:
            self.decide_key_rotation()
        c = self.config
        s = {name: getattr(c, name) for name in _SETTINGS}
        s.update(offset=self.offset, rotate_k=self.rotate_k, rotate_v=self.rotate_v, n_sink=self.n_sink,
                 n_tiles=self.n_tiles, n_tail=self.n_tail)
        if not self.empty():
            s.update(sink_k=self.sink_k[..., : self.n_sink, :], sink_v=self.sink_v[..., : self.n_sink, :],
                     tail_k=self.tail_k[..., : self.n_tail, :], tail_v=self.tail_v[..., : self.n_tail, :])
            if self.n_tiles:
                s.update(zip(_TILE_ARRAYS, self.tiles()))
        return s

    @state.setter
    def state(self, s):
        # Restore into a fresh object: a corrupt state raises and leaves this cache as it was.
        new = KVarNCache.__new__(KVarNCache)
        new._set_state(s)
        self.__dict__.update(new.__dict__)

    def _set_state(self, s):
        if not isinstance(s, dict) or any(k not in s for k in (*_SETTINGS, "offset", "n_tiles")):
            raise ValueError(
                "not a KVarNCache state (missing settings): the prompt-cache file is corrupt "
                "or was written by another version; delete it and build the cache again"
            )
        self.__init__(KVarNConfig(**{k: _scalar(s[k]) for k in _SETTINGS}))
        self.offset, self.n_tiles = int(s["offset"]), int(s["n_tiles"])
        self.n_sink, self.n_tail = int(s["n_sink"]), int(s["n_tail"])
        self.rotate_k = _flag(s.get("rotate_k"))
        self.rotate_v = None if s.get("rotate_v") is None else bool(s["rotate_v"])
        if self.offset == 0 and "sink_k" not in s:
            return
        try:
            sk, sv, tk, tv = s["sink_k"], s["sink_v"], s["tail_k"], s["tail_v"]
            B, H, _, D = sk.shape
            G = self.config.group_size
            self.sink_k, self.sink_v = sk, sv
            self.tail_k, self.tail_v = tk, tv
            for name in _TILE_ARRAYS:
                setattr(self, name, s[name] if self.n_tiles else None)
            ok = (sk.shape[2] == self.n_sink and tk.shape[2] == self.n_tail
                  and self.offset == self.n_sink + self.n_tiles * G + self.n_tail
                  and (not self.n_tiles or self.k_words.shape[2] == self.n_tiles))
        except (KeyError, ValueError, AttributeError) as e:
            raise ValueError(f"corrupt KVarNCache state in prompt-cache file ({e}); delete it and build the cache again") from e
        if not ok:
            raise ValueError("corrupt KVarNCache state: token counts and array shapes disagree; delete the file and build the cache again")
        self._n_seen, self._recent = self.n_tiles, None


def _forget_recent(cache_ref, recent):
    cache = cache_ref()
    if cache is not None and cache._recent is recent:
        cache._recent = None


def _scalar(x):
    return x.item() if isinstance(x, mx.array) and x.ndim == 0 else x


def _flag(x):
    """A rotation flag from a state: None, a bool, or a per-head bool array."""
    if x is None:
        return None
    if isinstance(x, mx.array) and x.ndim:
        return x.astype(mx.bool_)
    return bool(_scalar(x))


# Keep key rotation unless unrotated keys' attention error is below this fraction
# of the rotated keys' (ties go to the paper's choice; 0.95 measured on tiny models
# with and without outlier key channels, tests/test_auto_rotation.py).
KEY_ROTATION_MARGIN = 0.95


# load_prompt_cache resolves class names in mlx_lm.models.cache's globals.
mlx_cache.KVarNCache = KVarNCache


def make_cache(model, preset=DEFAULT_PRESET, **overrides):
    """The model's prompt cache with plain KVCache layers replaced by KVarNCache.

    preset: a preset name, a KVarNConfig, "fp16" (plain cache), or a list with
    one of those (or None, meaning plain) per layer. overrides set config fields
    (e.g. sink=0). Other cache kinds (sliding-window, recurrent) are left as
    they are. Also turns on the packed-attention patch.
    """
    from .attention import patch

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
        cfg = get_preset(p, **overrides) if isinstance(p, str) else p
        caches[i] = KVarNCache(cfg)
    if skipped:
        _warn_once(f"KVarN left {', '.join(sorted(skipped))} layers as they were (only plain KVCache layers are quantized)")
    patch()
    return caches
