"""KVarNCache: an mlx-lm KV cache that holds its tokens as KVarN tiles.

Per layer (B batch rows, H kv heads, D head dim, G tile tokens; docs/algorithm.md,
"Tiles, sink and tail"):
    sink_k/v  [B, H, S, D]    first S tokens, model dtype
    tiles     TileStorage     quantized tiles in the rotated space (tiles.py)
    tail_k/v  [B, H, <T+G, D] newest tokens, model dtype: the config's tail_tokens T and
                              the tile being filled (up to T + G + tail_step after short
                              steps: its tile waits its turn)
Tiles are quantized once, when they leave the tail, and never again. Tile boundaries
are fixed (sink + k G), so T changes when a tile is quantized, never its tokens.
"""

import logging
import weakref

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from . import dispatch, quant, rotation, waiting_tiles
from .config import DEFAULT_PRESET, KVarNConfig, get_preset
from .mlx_lm_private import BaseCache
from .tiles import ARRAYS, StepView, Tiles, append, derived, keep_derived

log = logging.getLogger("kvarn_mlx")

_SETTINGS = (
    "k_bits",
    "v_bits",
    "group_size",
    "sink",
    "iters",
    "scale_dtype",
    "rotate_keys",
    "rotate_values",
    "tail_tokens",
)
_warned = set()


def _warn_once(msg):
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


BYPASSED = (
    "KVarN: the model attends without reading the packed tiles (it calls "
    "mx.fast.scaled_dot_product_attention itself, or attends on keys and values it derives from "
    "the cache's, as latent attention does); it gets keys and values dequantized from the tiles, "
    "correct but materialized at every step"
)


def cannot_hold(config, k_dim, v_dim):
    """Why a KVarNCache with this config cannot hold keys and values of these head
    dims, or None. Value codes pack along the head dim; key codes along the tile's
    tokens, so any key head dim packs."""
    if k_dim != v_dim:
        return f"keys and values of different head dims ({k_dim} and {v_dim})"
    try:
        quant.check_head_dim(v_dim, config.v_bits)
    except ValueError as e:
        return f"value {e}"
    return None


class KVarNCache(BaseCache):
    """KV cache quantized with KVarN; drop-in for mlx-lm's KVCache.

    Attention over it runs in the packed domain once `kvarn_mlx.patch()` is on
    (make_cache does that): it reads `step_view()`. `update_and_fetch` also
    returns correct, lazily dequantized keys and values for code that bypasses
    the patched entry point. A step attends to its own tokens in full precision
    for as long as the arrays update_and_fetch returned are alive (as in every
    mlx-lm model).
    """

    step_tiles = 4  # tile storage capacity: a whole number of this many tiles
    tail_step = 32  # the tail buffer grows by this many tokens
    # make_cache sets this: say once when a model attends without packed attention
    # (a step nothing read through step_view before the next update).
    announce_bypass = False
    # Steps of at most this many tokens (decoding, speculative verification) leave
    # the tiles they fill in the tail until the next update, after any trim: tokens
    # a draft proposed and the model rejected never enter a quantized tile.
    short_step = 16

    def __init__(self, config: KVarNConfig | str = DEFAULT_PRESET):
        self.config = get_preset(config) if isinstance(config, str) else config
        self.offset = 0
        # Rotation flags, decided at the first update from the config and head dim;
        # rotate_k becomes a bool array [H] once an "auto" decision is made.
        self.rotate_k = self.rotate_v = None
        self.key_candidates = None  # "auto": both key variants of the first tiles, until decided
        self.decide_row = None  # the query row that decides them (None: every row of the step)
        # A short step's completed tile, quantized ahead into the storage's room:
        # "quantized", or "chose_rotation" if its queries also chose the "auto" key
        # rotation; committed (counted) at the next update, dropped by a trim into it.
        self.room_tile = None
        # (waiting_tiles.stamp, Tiles): the waiting tiles, quantized in another cache's commit.
        self.batched = None
        # Updates left before the waiting tiles are committed (waiting_tiles.register,
        # due); None: no turn given, commit at the next update.
        self.commit_in = None
        self.n_sink = self.n_tail = 0
        self.sink_k = self.sink_v = self.tail_k = self.tail_v = None
        self.tiles = None
        # The current step's StepView, alive as long as the arrays update_and_fetch returned.
        self._step = None
        self._fetched = None  # weak references to those arrays
        self._unread = False  # no attention read the current step yet
        self._reads_packed = False  # attention read the previous step through step_view

    @property
    def n_tiles(self):
        return 0 if self.tiles is None else self.tiles.count

    @property
    def choosing_key_rotation(self):
        """An "auto" cache whose key rotation is still to be chosen: rotate_k is True (None
        before the first update) until the choice makes it a bool per kv head; False: a
        head dim without rotation, nothing to choose."""
        return self.config.rotate_keys == "auto" and (
            self.rotate_k is None or self.rotate_k is True
        )

    # -- writing -------------------------------------------------------------

    def update_and_fetch(self, keys, values):
        step = self.update(keys, values)
        keys, values = self.dequantized(step)
        # The step's full-precision tokens serve this step only: the view lives as
        # long as the returned arrays (which hold those tokens anyway) and this step
        # is the cache's last. The weak reference's callback holds it: the callback
        # goes when the keys do, or with the reference at the next update (cheaper
        # than weakref.finalize, which registers every step globally).
        self._fetched = (weakref.ref(keys, lambda _, step=step: None), weakref.ref(values))
        return keys, values

    def update(self, keys, values) -> StepView:
        """Store keys and values [B, H, L, D]; the step's view, which step_view()
        returns for as long as the caller keeps it (update_and_fetch: as long as
        the arrays it returned)."""
        B, H, L, D = keys.shape
        G, S, T = self.config.group_size, self.config.sink_size, self.config.tail_tokens
        if self._unread and self.announce_bypass:
            _warn_once(BYPASSED)
        self._reads_packed = not self._unread
        if self.rotate_k is None:
            self._start(keys, values)
        else:
            # Check before changing anything: a mismatch (e.g. a prompt-cache file made for
            # another model) must leave the cache as it was.
            b, h, _, d = self.sink_k.shape
            if (B, H, D) != (b, h, d) or values.shape != keys.shape:
                raise ValueError(
                    f"this KVarNCache holds batch {b}, {h} kv heads, head dim {d}; "
                    f"got keys of shape {tuple(keys.shape)}, values {tuple(values.shape)} "
                    "(a prompt cache made for another model?)"
                )
        if self.key_candidates is not None:  # no attention call decided: the keys stand in
            self.decide_key_rotation()
        short = L <= self.short_step
        if self.n_tail >= G:  # a short step's whole tiles, before this step reads the tiles
            self._commit(short, L)
        n_seen = self.n_tiles
        self.offset += L

        # 1. The sink fills first.
        # It grows by concatenation: at most S tokens ever, and no unused room.
        if self.n_sink < S:
            n = min(L, S - self.n_sink)
            self.sink_k = mx.concatenate(
                [self.sink_k[..., : self.n_sink, :], keys[..., :n, :]], axis=2
            )
            self.sink_v = mx.concatenate(
                [self.sink_v[..., : self.n_sink, :], values[..., :n, :]], axis=2
            )
            self.n_sink += n
            keys, values = keys[..., n:, :], values[..., n:, :]
            L -= n

        # 2. The rest joins the tail; every whole tile that leaves the tail's newest T
        # tokens is quantized, once (a short step's at a later update).
        if self.n_tail + L < G + T or short:
            if self.n_tail + L > self.tail_k.shape[2]:
                self._grow_tail(self.n_tail + L)
            # [:, :, a:b] rather than [..., a:b, :]: a decode step's cheapest indexing
            self.tail_k[:, :, self.n_tail : self.n_tail + L] = keys
            self.tail_v[:, :, self.n_tail : self.n_tail + L] = values
            self.n_tail += L
            rk, rv = self.tail_k[:, :, : self.n_tail], self.tail_v[:, :, : self.n_tail]
            room = (self.tail_k, self.tail_v)
        else:
            rk = mx.concatenate([self.tail_k[..., : self.n_tail, :], keys], axis=2)
            rv = mx.concatenate([self.tail_v[..., : self.n_tail, :], values], axis=2)
            m = (rk.shape[2] - T) // G
            self._append(
                rk[..., : m * G, :].reshape(B, H, m, G, D),
                rv[..., : m * G, :].reshape(B, H, m, G, D),
            )
            self._new_tail(rk[..., m * G :, :], rv[..., m * G :, :])
            room = None
        step = self._view(n_seen, rk, rv, room)
        if short and self.n_tail > G + T > self.n_tail - L:  # a tile left the tail here
            step.after_tile_row = L - (self.n_tail - G - T)
            step.after_tile = self._after_tile_view(n_seen, step.after_tile_row)
        if short and self.n_tail >= G + T and not self.room_tile:
            waiting_tiles.register(self)  # quantized at the next update, with the other layers'
        self._step, self._fetched, self._unread = weakref.ref(step), None, True
        return step

    def _start(self, keys, values):
        B, H, _, D = keys.shape
        c = self.config
        problem = cannot_hold(c, D, values.shape[3])
        if problem:
            raise ValueError(
                f"a KVarNCache cannot hold this layer: {problem}. kvarn_mlx.make_cache leaves "
                "such layers plain"
            )
        if not quant.can_rotate(D) and (c.rotate_keys or c.rotate_values):
            _warn_once(
                f"head dim {D} has no Hadamard transform in MLX; KVarN runs without rotation there"
            )
        self.rotate_k = bool(c.rotate_keys) and quant.can_rotate(D)  # "auto" starts rotated
        self.rotate_v = c.rotate_values and quant.can_rotate(D)
        self.sink_k = mx.zeros((B, H, 0, D), keys.dtype)
        self.sink_v = mx.zeros((B, H, 0, D), values.dtype)
        self.tail_k = mx.zeros((B, H, 0, D), keys.dtype)
        self.tail_v = mx.zeros((B, H, 0, D), values.dtype)

    def _grow_tail(self, n):
        """Room for n tail tokens (tail_capacity)."""
        cap = self.tail_k.shape[2]
        if n > cap:
            pad = [(0, 0), (0, 0), (0, self.tail_capacity(cap, n) - cap), (0, 0)]
            self.tail_k, self.tail_v = mx.pad(self.tail_k, pad), mx.pad(self.tail_v, pad)

    def tail_capacity(self, cap, n):
        """The tail buffer's room once it holds n tokens, from room for cap: it grows
        tail_step tokens at a time (no per-token copies), beyond tail_tokens + a tile
        only while a short step's tiles wait to be committed."""
        if n <= cap:
            return cap
        new_cap = -(-n // self.tail_step) * self.tail_step
        full = self.config.group_size + self.config.tail_tokens
        return min(new_cap, full) if n <= full else new_cap

    def _new_tail(self, k, v):
        """Start a fresh tail buffer holding k, v [B, H, r, D]."""
        r = k.shape[2]
        cap = -(-r // self.tail_step) * self.tail_step
        pad = [(0, 0), (0, 0), (0, cap - r), (0, 0)]
        self.tail_k, self.tail_v = (
            mx.pad(k.astype(self.tail_k.dtype), pad),
            mx.pad(v.astype(self.tail_v.dtype), pad),
        )
        self.n_tail = r

    def _commit(self, short, L=0):
        """Quantize the whole tiles waiting in the tail (left by a short step); a
        tile quantized ahead into the room (room_tile) is only counted. A short
        step (L tokens) before the cache's turn (waiting_tiles.due) leaves them
        waiting, as long as the tail holds at most tail_tokens, a tile and tail_step
        tokens (one buffer step more than tail_tokens and a tile: the most a waiting
        layer holds unquantized, byte_models.SinkTilesTail). As in one-token
        decoding, a short step's first query row chooses the "auto" key rotation
        of tiles made here."""
        G, T = self.config.group_size, self.config.tail_tokens
        m = self.leaving_tiles()  # whole tiles older than the tail's newest T tokens
        if m == 0:
            return
        if (
            short
            and not self.room_tile
            and self.n_tail + L <= G + T + self.tail_step
            and not waiting_tiles.due(self)
        ):
            self.commit_in -= 1
            return
        self.commit_in = None
        k, v = self.tail_k[..., : self.n_tail, :], self.tail_v[..., : self.n_tail, :]
        if self.room_tile:
            self.tiles.count += 1
            m, self.room_tile = 1, None
        elif (new := waiting_tiles.take(self)) is not None:
            self.tiles = append(self.tiles, new, self.step_tiles)
        else:
            B, H, _, D = k.shape
            self._append(
                k[..., : m * G, :].reshape(B, H, m, G, D), v[..., : m * G, :].reshape(B, H, m, G, D)
            )
            if self.key_candidates is not None and short:
                self.decide_row = 0
        self._new_tail(k[..., m * G :, :], v[..., m * G :, :])

    def leaving_tiles(self):
        """Whole tiles in the tail beyond its newest tail_tokens: quantized at the next commit."""
        return max(0, self.n_tail - self.config.tail_tokens) // self.config.group_size

    def _after_tile_view(self, n_seen, row):
        """The view of a short step's query rows from `row` on, which follow the
        tile it completed: that tile quantized into the storage's room (committed
        at the next update unless a trim cuts into it), the tokens after it in
        full precision. Undecided "auto" key rotation is chosen by query `row`."""
        G = self.config.group_size
        B, H, _, D = self.tail_k.shape
        self._append(
            self.tail_k[..., :G, :].reshape(B, H, 1, G, D),
            self.tail_v[..., :G, :].reshape(B, H, 1, G, D),
        )
        self.tiles.count = n_seen
        self.room_tile = "quantized"
        if self.key_candidates is not None:
            self.decide_row, self.room_tile = row, "chose_rotation"
        return self._view(
            n_seen + 1, self.tail_k[..., G : self.n_tail, :], self.tail_v[..., G : self.n_tail, :]
        )

    def commit_key(self):
        """Caches with equal keys quantize their waiting tiles in one call (waiting_tiles.py);
        None: this one quantizes alone (the first tiles of an "auto" preset keep both
        key variants; a subclass may quantize another way)."""
        c = self.config
        if type(self).quantize is not KVarNCache.quantize or self.key_candidates is not None:
            return None
        if self.choosing_key_rotation:
            return None
        B, _, _, D = self.tail_k.shape
        return (
            c.k_bits,
            c.v_bits,
            c.group_size,
            c.iters,
            c.scale_dtype,
            bool(self.rotate_v),
            B,
            D,
            self.tail_k.dtype,
            self.leaving_tiles(),
        )

    def quantize(self, k, v) -> Tiles:
        """Full-precision tiles k, v [B, H, m, G, D] -> their packed Tiles.

        The one step a subclass replaces to store tiles quantized another way
        (attention reads whatever Tiles this returns)."""
        return dispatch.quantize(k, v, self.config, self.rotate_k, self.rotate_v)

    def _append(self, k_tiles, v_tiles):
        """Quantize tiles [B, H, m, G, D] into storage after the valid ones."""
        c = self.config
        # the first tiles: keep both key variants (with any still undecided before them)
        if self.choosing_key_rotation:
            cand = rotation.candidates(k_tiles, c, self.n_tiles)
            self.key_candidates = rotation.joined(self.key_candidates, cand)
            v = dispatch.quantize_values(v_tiles, c.v_bits, c.iters, self.rotate_v, c.scale_dtype)
            new = Tiles(*cand.rotated, *v)
        else:
            new = self.quantize(k_tiles, v_tiles)
        self.tiles = append(self.tiles, new, self.step_tiles)

    def decide_key_rotation(self, queries=None):
        """Choose rotated or plain keys per kv head for the "auto" candidates
        (rotation.decide); queries [B, H, rows, D] times the softmax scale, or None."""
        keep, chosen = rotation.decide(self.key_candidates, self.config.k_bits, queries)
        self.tiles.write(self.key_candidates.start, chosen)
        self.key_candidates = self.decide_row = None
        self.rotate_k = keep
        # The live step may read these tiles (a short step's, made at its start or
        # for its later rows): it reads them with the choice.
        step = None if self._step is None else self._step()
        for view in (step, step and step.after_tile):
            if view is not None:
                view.rotate_k = keep
        return keep

    def key_rotation_summary(self):
        """(rotated kv heads, all kv heads) for this layer, or None before any decision."""
        if self.rotate_k is None or self.key_candidates is not None:
            return None
        if isinstance(self.rotate_k, mx.array):
            return int(self.rotate_k.sum()), self.rotate_k.size
        return (self.sink_k.shape[1] if self.rotate_k else 0), self.sink_k.shape[1]

    # -- reading -------------------------------------------------------------

    def _view(self, n_tiles, recent_k, recent_v, room=None):
        c = self.config
        return StepView(
            self.sink_k,
            self.sink_v,
            self.tiles if n_tiles else None,
            n_tiles,
            recent_k,
            recent_v,
            c.k_bits,
            c.v_bits,
            self.rotate_k,
            self.rotate_v,
            recent_room=room,
        )

    def fetched(self, keys, values):
        """Whether keys and values are the arrays this step's update_and_fetch
        returned: only then is attention on them attention over this cache (a
        latent-attention model attends on arrays it derives from them)."""
        f = self._fetched
        return f is not None and f[0]() is keys and f[1]() is values

    def step_view(self) -> StepView:
        """What the current step's attention reads: tiles quantized before this
        step, and everything newer in full precision. Without a live step (e.g.
        right after loading from a file), every tile and the tail."""
        self._unread = False
        step = None if self._step is None else self._step()
        if step is None:
            step = self._view(
                self.n_tiles,
                self.tail_k[..., : self.n_tail, :],
                self.tail_v[..., : self.n_tail, :],
                (self.tail_k, self.tail_v),
            )
        return step

    def dequantized(self, step=None):
        """All keys and values in token order, model dtype (lazy: costs nothing unless used)."""
        s = self.step_view() if step is None else step
        head_k, head_v = self._head(s)
        return mx.concatenate([head_k, s.recent_k], axis=2), mx.concatenate(
            [head_v, s.recent_v], axis=2
        )

    def _head(self, s):
        """The view's sink and dequantized tiles in token order, model dtype, lazily.

        While the model reads the packed tiles (its previous step went through
        step_view), the arrays are built once per tile count and kept beside
        the storage, unevaluated: they only reference its arrays, and a decode step
        then adds two concatenations to the graph Python builds, not a whole
        dequantization it never evaluates. TileStorage.write drops them. A model
        that attends on these arrays itself gets them built afresh at every step,
        so that nothing keeps them once evaluated."""
        if s.tiles is None or not s.n_tiles:
            return s.sink_k, s.sink_v
        memo = derived(s.tiles)
        if (
            memo is not None
            and memo[0] == s.n_tiles
            and memo[1] is s.sink_k
            and memo[2] is s.rotate_k
        ):
            return memo[3]
        k, v = s.tiles.dequantize(s.k_bits, s.v_bits, s.rotate_k, s.rotate_v, s.n_tiles)
        head = (
            mx.concatenate([s.sink_k, k.astype(s.sink_k.dtype)], axis=2),
            mx.concatenate([s.sink_v, v.astype(s.sink_v.dtype)], axis=2),
        )
        keep_derived(
            s.tiles, (s.n_tiles, s.sink_k, s.rotate_k, head) if self._reads_packed else None
        )
        return head

    # -- mlx-lm cache protocol -------------------------------------------------

    def size(self):
        return self.offset

    def empty(self):
        return self.sink_k is None

    def is_trimmable(self):
        return True

    def make_mask(self, N, return_array=False, window_size=None):
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    def trim(self, n):
        """Drop the newest n tokens. Exact inside the tail, which holds the tokens
        of the last short step (speculative decoding trims only those); trimming
        into a quantized tile dequantizes that tile back into the tail (approximate)."""
        n = max(0, min(self.offset, n))
        if n == 0:
            return 0
        if self.key_candidates is not None:
            self.decide_key_rotation()
        keep = self.offset - n
        self.batched, self.commit_in = None, None
        S, G, T = self.config.sink_size, self.config.group_size, self.config.tail_tokens
        # A room tile needs its tokens and the tail_tokens after them (it leaves the tail
        # only then), and one that chose the rotation the token whose query chose it (else
        # the next tile's first query chooses).
        if self.room_tile and keep < S + (self.n_tiles + 1) * G + T + (
            self.room_tile == "chose_rotation"
        ):
            if self.room_tile == "chose_rotation":
                self.rotate_k = True
            self.room_tile = None
        if keep <= S:
            self.n_sink, self.n_tail = keep, 0
            self.sink_k, self.sink_v = self.sink_k[..., :keep, :], self.sink_v[..., :keep, :]
            if self.tiles is not None:
                self.tiles.count = 0
        elif keep >= S + self.n_tiles * G:
            self.n_tail = keep - S - self.n_tiles * G
        else:
            i, r = divmod(keep - S, G)
            k, v = self.tiles.dequantize(
                self.config.k_bits, self.config.v_bits, self.rotate_k, self.rotate_v, i + 1
            )
            self._new_tail(k[..., i * G : i * G + r, :], v[..., i * G : i * G + r, :])
            self.tiles.count = i
        self.offset = keep
        self._step, self._fetched, self._unread = None, None, False
        return n

    # -- bytes -----------------------------------------------------------------

    def held_arrays(self):
        """Every array this cache holds (the sink, the tail buffer, the tile storage)."""
        dense = [x for x in (self.sink_k, self.sink_v, self.tail_k, self.tail_v) if x is not None]
        return dense + ([] if self.tiles is None else list(self.tiles.arrays()))

    @property
    def nbytes(self):
        """Bytes of the arrays this cache holds, preallocated room included."""
        return sum(x.nbytes for x in self.held_arrays())

    def nbytes_breakdown(self):
        """Held bytes split into codes, scales, sink+tail (used), unused room, and total."""
        out = {"codes": 0, "scales": 0, "sink_tail": 0, "unused": 0}
        if self.empty():
            return {**out, "total": 0}
        if self.tiles is not None:
            for k, v in self.tiles.nbytes_breakdown().items():
                out[k] += v
        for x, n in (
            (self.sink_k, self.n_sink),
            (self.sink_v, self.n_sink),
            (self.tail_k, self.n_tail),
            (self.tail_v, self.n_tail),
        ):
            used = x.nbytes * n // x.shape[2] if x.shape[2] else 0
            out["sink_tail"] += used
            out["unused"] += x.nbytes - used
        out["total"] = sum(out.values())
        return out

    # -- prompt-cache files ----------------------------------------------------

    @property
    def state(self):
        if self.key_candidates is not None:
            self.decide_key_rotation()
        c = self.config
        s = {name: getattr(c, name) for name in _SETTINGS}
        s.update(
            offset=self.offset,
            rotate_k=self.rotate_k,
            rotate_v=self.rotate_v,
            n_sink=self.n_sink,
            n_tiles=self.n_tiles,
            n_tail=self.n_tail,
        )
        if not self.empty():
            s.update(
                sink_k=self.sink_k[..., : self.n_sink, :],
                sink_v=self.sink_v[..., : self.n_sink, :],
                tail_k=self.tail_k[..., : self.n_tail, :],
                tail_v=self.tail_v[..., : self.n_tail, :],
            )
            if self.n_tiles:
                s.update(zip(ARRAYS, self.tiles.valid().arrays()))
        return s

    @state.setter
    def state(self, s):
        # Restore into a fresh object: a corrupt state raises and leaves this cache as it was.
        new = type(self).__new__(type(self))
        new._set_state(s)
        self.__dict__.update(new.__dict__)

    def _set_state(self, s):
        if not isinstance(s, dict) or any(
            k not in s for k in (*_SETTINGS, "offset", "n_tiles") if k != "tail_tokens"
        ):
            raise ValueError(
                "not a KVarNCache state (missing settings): the prompt-cache file is corrupt "
                "or was written by another version; delete it and build the cache again"
            )
        # Files written before tail_tokens existed hold no tail beyond the tile being filled.
        settings = {k: _scalar(s[k]) for k in _SETTINGS if k in s}
        self.__init__(KVarNConfig(**settings))
        self.offset, n_tiles = int(s["offset"]), int(s["n_tiles"])
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
            self.tiles = (
                append(None, Tiles(*(s[name] for name in ARRAYS)), self.step_tiles)
                if n_tiles
                else None
            )
            ok = (
                sk.shape[2] == self.n_sink
                and tk.shape[2] == self.n_tail
                and self.offset == self.n_sink + n_tiles * G + self.n_tail
                and self.n_tiles == n_tiles
            )
        except (KeyError, ValueError, AttributeError, TypeError) as e:
            raise ValueError(
                f"corrupt KVarNCache state in prompt-cache file ({e}); "
                "delete it and build the cache again"
            ) from e
        if not ok:
            raise ValueError(
                "corrupt KVarNCache state: token counts and array shapes disagree; "
                "delete the file and build the cache again"
            )


def _scalar(x):
    return x.item() if isinstance(x, mx.array) and x.ndim == 0 else x


def _flag(x):
    """A rotation flag from a state: None, a bool, or a per-head bool array."""
    if x is None:
        return None
    if isinstance(x, mx.array) and x.ndim:
        return x.astype(mx.bool_)
    return bool(_scalar(x))
