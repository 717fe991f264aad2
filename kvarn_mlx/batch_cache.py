"""BatchKVarNCache: KVarN caches of several sequences run as one mlx-lm batch.

mlx-lm batches sequences of different lengths by padding them to a shared
layout (BatchKVCache in mlx_lm/models/cache.py): row b holds its tokens in
columns [left_padding[b], _idx), and while a right-padded prompt is processed
(`prepare(lengths=, right_padding=)` ... `finalize()`), its new tokens end
before the padding. This cache keeps that bookkeeping and, per row, one
single-sequence KVarNCache holding only the row's real tokens: padding never
enters a sink, a tile or its statistics, each sequence keeps its own sink and
tile boundaries at its own token positions, and the tiles, quantizer and bits
are those of the single cache.

The rows' tiles live side by side in one storage (batch_tiles.py), written once
per tile, so a decode step (one token per row) attends over every row in one
graph: the shared tiles up to the longest row's count, the sinks padded to the
longest row's, the rows' recent tokens side by side in one buffer, and a mask
of each row's own columns, as mlx-lm's BatchKVCache masks its left padding (on
Metal, the attention kernel given each row's lengths). Longer query chunks
(prompts) attend per row over the row's cache.

A decode step costs the host the same few ops whatever the number of rows:
every row's new token goes into the recent buffer in one op, and a row whose
step only appends to its tail (most steps) is not touched; its counters and its
own tail catch up when something reads the row (`rows`, extract, filter, trim,
state) or its next step does more than append (a tile leaves the tail).
"""

import copy
import weakref

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from . import attention, batch_tiles, dispatch, kernels, waiting_tiles
from .batch_tiles import RowTiles
from .cache import KVarNCache
from .mlx_lm_private import BaseCache
from .tiles import StepView, TileStorage

# Masks this module made for full causal attention over the batch layout:
# attention recognizes them (by identity) and runs each row causally on its
# own tokens, which is what the row's single cache would get.
_causal_masks = weakref.WeakValueDictionary()


class BatchKVarNCache(BaseCache):
    """One KVarNCache per sequence, with mlx-lm's batch protocol on top."""

    def __init__(self, rows, left_padding=None):
        self._rows = list(rows)
        sizes = [r.offset for r in self._rows]
        self._idx = max(sizes, default=0)
        # Row b's tokens sit in columns [left[b], _idx) of the batch layout.
        self._left = [self._idx - n for n in sizes]
        if left_padding is not None:
            self.prepare(left_padding=left_padding)
        self._limit = None  # per row, the column its prompt ends at while right-padded
        # per row, the query positions [s, e) of the last update that were its own
        self._spans = None
        self._v_dim = None
        # the rows' tiles in one storage; _head: (tile state, rotation flags, sinks, the
        # tiles dequantized), see _head_of
        self._tiles, self._head = _share_tiles(self._rows), None
        self._flags = (None, None)  # the rows' key rotation flags -> their [B, H] array
        self._together = None  # a decode step's view of all rows, and its mask
        # Decode steps: every row's recent tokens (its tail) in one buffer pair
        # [B, H, W, D], row b's from column 0, its count its row's n_tail. A row's
        # own tail is either dropped (_held[b]: what giving it back needs) or behind
        # (_own[b]: the tokens it holds itself) until _sync; see _decode.
        self._recent = self._own = None
        self._sinks = self._rot = self._tile_view = None  # kept between decode steps
        self._pending = []  # rows' tails _sync wrote: evaluated with the next decode step
        self._read = self._reads_packed = False  # attention read this / the last step

    @classmethod
    def merge(cls, caches):
        """A batch of copies of the single caches (no data is copied; the
        caches passed in are left as they are)."""
        for c in caches:
            if not isinstance(c, KVarNCache):
                raise TypeError(f"BatchKVarNCache.merge takes KVarNCaches, got {type(c).__name__}")
        return cls([_detached(c) for c in caches])

    @property
    def rows(self):
        """The sequences' single caches, each holding all its tokens."""
        self._sync()
        return self._rows

    # -- the batch layout -------------------------------------------------------

    @property
    def left_padding(self):
        return mx.array(self._left)

    @property
    def offset(self):
        """Per row, the position of the next token (RoPE reads this)."""
        return mx.array([self._idx - lp for lp in self._left])

    def size(self):
        return self._idx

    def empty(self):
        return all(r.empty() for r in self._rows)

    def is_trimmable(self):
        return True

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if not self.empty():
                raise ValueError("left padding can only be added to an empty BatchKVarNCache")
            self._left = [lp + int(p) for lp, p in zip(self._left, _ints(left_padding))]
        if right_padding is not None and max(_ints(right_padding), default=0) > 0:
            if lengths is None:
                raise ValueError(
                    "prepare(right_padding=...) needs lengths= (each row's new tokens)"
                )
            self._limit = [self._idx + int(n) for n in _ints(lengths)]

    def finalize(self):
        """After a right-padded prompt: each row's padding becomes left padding
        (bookkeeping only; the padding never reached the rows' caches)."""
        if self._limit is not None:
            self._left = [lp + self._idx - end for lp, end in zip(self._left, self._limit)]
            self._limit = None

    def make_mask(self, N, return_array=False, window_size=None):
        mask = create_causal_mask(
            N, offset=self._idx, left_padding=self.left_padding, window_size=window_size
        )
        if window_size is None:
            _causal_masks[id(mask)] = mask
        return mask

    # -- writing ------------------------------------------------------------------

    def update_and_fetch(self, keys, values):
        """Each row's real tokens into its own cache. Returns the keys and values
        of the whole batch layout [B, H, _idx, D], dequantized lazily (zeros in
        padding) for code that bypasses the patched attention entry point."""
        B, H, L, _ = keys.shape
        if B != len(self._rows):
            raise ValueError(
                f"this BatchKVarNCache holds {len(self._rows)} sequences; got keys of batch {B}"
            )
        self._reads_packed, self._read = self._read, False
        self._v_dim = values.shape[-1]
        if (
            L == 1
            and self._limit is None
            and self._tiles is not None
            and (self._recent is not None or not any(r.empty() for r in self._rows))
        ):
            return self._decode(keys, values)
        self._close_recent()
        self._together = None
        prev = self._idx
        self._idx += L
        self._spans, fetched = [], []
        for b, row in enumerate(self._rows):
            end = self._idx if self._limit is None else min(self._idx, self._limit[b])
            s, e = max(prev, self._left[b]) - prev, max(end, prev) - prev
            e = max(s, e)
            self._spans.append((s, e))
            if e > s:
                fetched.append(
                    row.update_and_fetch(keys[b : b + 1, :, s:e], values[b : b + 1, :, s:e])
                )
            else:
                fetched.append(None if row.empty() else row.dequantized())
        k, v = (
            mx.concatenate([self._in_layout(b, f, i, x) for b, f in enumerate(fetched)])
            for i, x in ((0, keys), (1, values))
        )
        # Each updated row's step (its new tokens in full precision) lives as
        # long as the arrays its cache returned: as long as these.
        weakref.finalize(k, _keep_alive, fetched)
        return k, v

    def _decode(self, keys, values):
        """One token for every row, written into the recent buffer of all rows at once.
        Most steps only append to every row's tail: the rows do not even count the
        token then (_lag: tokens the rows' counters are behind, caught up by _settle)
        and their tails live in the buffer only (_release, given back by _sync). The
        other steps go row by row (_step_rows). The step's view of all rows is built
        from the buffer, for attention and for the arrays returned (the batch layout,
        gathered from that view)."""
        self._idx += 1
        rows = self._rows
        self._spans = [(0, 1)] * len(rows)
        if self._recent is None:
            self._open_recent()
        if not self._free:
            self._settle()
        if self._given:  # rows given their tails back (_sync) drop them again
            for b in self._given:
                r = rows[b]
                if b not in self._held and r.commit_in is None and self._own[b] == r.n_tail:
                    self._release(b)
            self._given = set()
        rk, rv = self._recent
        sinks, tiles, tails = self._counts
        lag = self._lag
        pos = tuple(t + lag for t in tails) if lag else tails
        if max(pos) >= rk.shape[2]:
            pad = [(0, 0), (0, 0), (0, ROOM), (0, 0)]
            rk, rv = mx.pad(rk, pad), mx.pad(rv, pad)
        at = _positions(pos)
        rk = mx.put_along_axis(rk, at, _as(keys, rk.dtype), axis=2)
        rv = mx.put_along_axis(rv, at, _as(values, rv.dtype), axis=2)
        if self._free:  # every row only appends
            self._lag, self._free = lag + 1, self._free - 1
            counts = (sinks, tiles, tuple(t + 1 for t in pos))
            updated = steps = ()
        else:
            self._recent = (rk, rv)
            updated, steps = self._step_rows(keys, values)
            rk, rv = self._recent
            counts = self._counts = _row_counts(rows)
        self._recent = (rk, rv)
        c = rows[0].config
        G = c.group_size
        if self._sinks is None:  # (the rows' sinks, as one [B, H, S, D] pair)
            S_max = max(counts[0])
            self._sinks = (
                [r.sink_k for r in rows],
                _padded([r.sink_k for r in rows], S_max),
                _padded([r.sink_v for r in rows], S_max),
            )
        if self._rot is None:
            self._rot = self._rotate_k([r.rotate_k for r in rows], rows[0].sink_k.shape[1])
        n, W = max(counts[1]), rk.shape[2]
        view = StepView(
            *self._sinks[1:],
            self._tiles_up_to(n),
            n,
            rk,
            rv,
            c.k_bits,
            c.v_bits,
            self._rot,
            rows[0].rotate_v,
        )
        # A row choosing its "auto" key rotation attends on its own (attention()).
        together = not any(r.key_candidates is not None for r in updated)
        self._together = (view, counts, W, updated) if together else None
        head = self._head_of(view, keys.dtype)
        index = _layout_index(tuple(self._left), counts, G, W)
        zero = _zeros((*keys.shape[:2], 1, keys.shape[3]), keys.dtype)
        k, v = (
            mx.take_along_axis(
                mx.concatenate([h, _as(recent, keys.dtype), zero], axis=2), index, axis=2
            )
            for h, recent in zip(head, (rk, rv))
        )
        if steps:  # the updated rows' steps live as long as these
            weakref.finalize(k, _keep_alive, steps)
        return k, v

    def _step_rows(self, keys, values):
        """A step that is more than appending in some row (_settle found which): a row
        that only appends counts the token; one whose tile completes or waits for its
        commit turn also counts its turn and registers again, as its update would
        (the completing row first takes its tail back: peers quantizing with it read
        its tile there); the others (_slow) run their own update, and the buffer
        takes their tails. Returns the updated rows and their steps."""
        rows = self._rows
        for b, r in enumerate(rows):
            if b in self._slow:
                continue
            r.offset += 1
            r.n_tail += 1
            self._grow(b, r)
            if b in self._waiting:
                if r.commit_in is None:
                    self._sync([b])
                else:
                    r.commit_in -= 1
                waiting_tiles.register(r)
        updated = [rows[b] for b in self._slow]
        if not updated:
            return updated, []
        self._sync(self._slow)
        rk, rv = self._recent
        steps = []
        for b, r in zip(self._slow, updated):
            steps.append(r.update(keys[b : b + 1], values[b : b + 1]))
            n = self._own[b] = r.n_tail
            if n:
                rk[b : b + 1, :, :n] = r.tail_k[:, :, :n].astype(rk.dtype)
                rv[b : b + 1, :, :n] = r.tail_v[:, :, :n].astype(rv.dtype)
            if r.commit_in is None:
                self._release(b)
        self._recent = (rk, rv)
        self._rot = None
        if self._sinks and any(r.sink_k is not self._sinks[0][b] for b, r in enumerate(rows)):
            self._sinks = None
        if any(r.key_candidates is not None for r in updated):
            self._sync()  # attention runs row by row (attention()), on the rows' own tails
        return updated, steps

    def _open_recent(self):
        """The recent buffer from the rows' own tails (all of them up to date)."""
        rows = self._rows
        W = -(-(max(r.n_tail for r in rows) + 1) // ROOM) * ROOM
        self._recent = tuple(
            _padded([x[:, :, : r.n_tail] for r, x in zip(rows, xs)], W)
            for xs in ([r.tail_k for r in rows], [r.tail_v for r in rows])
        )
        self._own = [r.n_tail for r in rows]
        self._held, self._given = {}, set()
        self._lag = self._free = 0
        self._sinks = self._rot = None
        for b, r in enumerate(rows):
            if r.commit_in is None:
                self._release(b)

    def _release(self, b):
        """Row b's tail now lives only in the recent buffer: the row drops its own
        (no second copy of the same tokens), and _held keeps what _sync needs to give
        it back as the single cache would hold it: room, and dtypes."""
        r = self._rows[b]
        self._held[b] = (r.tail_k.shape[2], r.tail_k.dtype, r.tail_v.dtype)
        r.tail_k = r.tail_v = None

    def _grow(self, b, r):
        """Room for row b's tail tokens, as its single cache grows it."""
        if b in self._held:
            cap, dk, dv = self._held[b]
            self._held[b] = (r.tail_capacity(cap, r.n_tail), dk, dv)
        elif r.n_tail > r.tail_k.shape[2]:
            r._grow_tail(r.n_tail)

    def _settle(self):
        """The rows count the tokens they are behind, and what the next token does in
        each row is found: only append (most rows), append while the tile it completed
        waits for its commit turn (_waiting: the row counts its turn and registers
        again, as its update would), or anything else (_slow: the row's own update).
        _free: how many steps from now on only append in every row."""
        rows, lag = self._rows, self._lag
        if lag:
            for b, r in enumerate(rows):
                r.offset += lag
                r.n_tail += lag
                self._grow(b, r)
            self._lag = 0
        c = rows[0].config
        S, full = c.sink_size, c.group_size + c.tail_tokens
        self._slow, self._waiting = [], set()
        for b, r in enumerate(rows):
            if r.n_sink != S or r.key_candidates is not None or r.room_tile:
                self._slow.append(b)
            elif r.commit_in is None:
                if r.n_tail + 1 == full:  # its tile completes: it waits for its turn
                    self._waiting.add(b)
                elif r.n_tail + 1 > full:
                    self._slow.append(b)
            elif r.commit_in > 0 and full <= r.n_tail < full + r.tail_step:
                self._waiting.add(b)  # (KVarNCache._commit before the row's turn)
            else:
                self._slow.append(b)  # its turn: the tile is quantized
        quiet = not self._slow and not self._waiting
        self._free = min(full - 1 - r.n_tail for r in rows) if quiet else 0
        self._counts = _row_counts(rows)

    def _sync(self, which=None):
        """Rows (all, or those indexed) take the tokens the recent buffer holds beyond
        their own tails: each then holds what its single cache would."""
        if self._recent is None:
            return
        if self._lag:
            self._settle()
        rk, rv = self._recent
        for b in range(len(self._rows)) if which is None else which:
            r, own = self._rows[b], self._own[b]
            n = self._own[b] = r.n_tail
            if b in self._held:
                self._given.add(b)
                cap, dk, dv = self._held.pop(b)
                pad = [(0, 0), (0, 0), (0, cap - n), (0, 0)]
                r.tail_k = mx.pad(rk[b : b + 1, :, :n].astype(dk), pad)
                r.tail_v = mx.pad(rv[b : b + 1, :, :n].astype(dv), pad)
            elif n > own:
                r.tail_k[:, :, own:n] = rk[b : b + 1, :, own:n].astype(r.tail_k.dtype)
                r.tail_v[:, :, own:n] = rv[b : b + 1, :, own:n].astype(r.tail_v.dtype)
            else:
                continue
            r._step, r._fetched, r._unread = None, None, False
            self._pending += [r.tail_k, r.tail_v]

    def _close_recent(self):
        """Back to the rows' own tails (before anything but a decode step)."""
        self._sync()
        self._recent = self._own = None
        self._sinks = self._rot = self._tile_view = None

    def _tiles_up_to(self, n):
        """The shared storage with count n, one object while it and n stay (attention's
        per-storage memos, kernels._step_memo, keep their answers as long)."""
        if not n:
            return None
        key = (self._tiles.version, n)
        if self._tile_view is None or self._tile_view[0] != key:
            self._tile_view = (key, TileStorage(*self._tiles.storage.arrays(), count=n))
        return self._tile_view[1]

    def _head_of(self, view, dtype):
        """The view's sink and dequantized tiles side by side, [B, H, S + n*G, D] each for
        keys and values, lazily. While attention reads the tiles (it read the last
        step), kept unevaluated until a tile or sink is written: a step then adds a
        gather, not a dequantization it never evaluates (as KVarNCache._head)."""
        key = (self._tiles.version, view.n_tiles, dtype)
        held = self._head
        if (
            held is not None
            and held[0] == key
            and held[1] is view.rotate_k
            and held[2] is view.sink_k
        ):
            return held[3]
        sink = (_as(view.sink_k, dtype), _as(view.sink_v, dtype))
        if view.n_tiles:
            k, v = view.tiles.dequantize(
                view.k_bits, view.v_bits, view.rotate_k, view.rotate_v, view.n_tiles
            )
            head = tuple(mx.concatenate([s, x.astype(dtype)], axis=2) for s, x in zip(sink, (k, v)))
        else:
            head = sink
        self._head = (key, view.rotate_k, view.sink_k, head) if self._reads_packed else None
        return head

    def _in_layout(self, b, fetched, i, like):
        """Row b's keys (i=0) or values (i=1) padded to the batch layout [1, H, _idx, D]."""
        H, D = like.shape[1], like.shape[3]
        if fetched is None:
            return mx.zeros((1, H, self._idx, D), like.dtype)
        x = fetched[i].astype(like.dtype)
        lp = self._left[b]
        return mx.pad(x, [(0, 0), (0, 0), (lp, self._idx - lp - x.shape[2]), (0, 0)])

    def trim(self, n):
        self._close_recent()
        n = max(0, min(self._idx, n))
        for row in self._rows:
            row.trim(n)
        self._idx -= n
        self._left = [self._idx - r.offset for r in self._rows]
        self._spans = self._together = None
        return n

    # -- attention ----------------------------------------------------------------

    def attention(self, queries, scale, mask=None, sinks=None):
        """Packed attention per row over its own cache, for the query positions
        that were the row's own tokens in the last update; zeros elsewhere
        (padding positions, whose outputs mlx-lm discards)."""
        B, Hq, L, _ = queries.shape
        if self._spans is None or len(self._spans) != B:
            raise RuntimeError("BatchKVarNCache.attention runs right after update_and_fetch")
        causal = mask is None or isinstance(mask, str) or _causal_masks.get(id(mask)) is mask
        self._read = True
        if causal and L == 1 and self._together is not None:
            return self._attend_together(queries, scale, sinks)
        self._sync()  # the rows attend on their own tails
        self._rot = None  # a row's attention may choose its "auto" key rotation
        zeros = mx.zeros((1, Hq, L, self._v_dim), queries.dtype)
        out = []
        for b, (row, (s, e)) in enumerate(zip(self._rows, self._spans)):
            if e == s:
                out.append(zeros)
                continue
            if causal:
                m = "causal" if e - s > 1 else None
            else:
                m = self._row_mask(mask, b, s, e)
            o = attention.packed_attention(queries[b : b + 1, :, s:e], row, scale, m, sinks)
            out.append(mx.pad(o, [(0, 0), (0, 0), (s, L - e), (0, 0)]) if e - s < L else o)
        return mx.concatenate(out, axis=0)

    def _attend_together(self, queries, scale, sinks):
        """One decode step of every row in one graph: the shared tiles [0, most
        tiles of a row), the sinks padded to the longest, the recent buffer, and a
        mask of each row's own columns (the view _decode built; a tile a row
        quantized at this step is in it, so the output depends on its write); on
        Metal the attention kernel, given each row's lengths."""
        view, counts, R, updated = self._together
        for r in updated:
            r._unread = False  # read (as step_view marks it): the model attends on the tiles
        out = None
        if view.tiles is not None and sinks is None and dispatch.use_metal():
            reason = kernels.attention_unsupported(queries, view)
            if reason is None:  # the kernel reads each row's own lengths
                out = kernels.packed_attention_metal(queries, view, scale, False, _lengths(counts))
            else:
                dispatch.fallback("attention", reason)
        if out is None:
            mask = _own_columns(counts, self._rows[0].config.group_size, R)
            if attention.COMPILE and sinks is None:
                out = _attend_compiled(queries, view, scale, mask)
            else:
                out = attention.attend(queries, view, scale, mask, sinks)
        if self._pending:  # evaluated now: unevaluated, each would hold a recent buffer
            out = mx.depends(out, self._pending)
            self._pending = []
        return out

    def _rotate_k(self, flags, H):
        """The rows' key rotation flags: one bool if they agree, else [B, H] (kept
        while the rows' flags are the same objects)."""
        if all(isinstance(f, bool) for f in flags) and len(set(flags)) == 1:
            return flags[0]
        held, array = self._flags
        if held is None or len(held) != len(flags) or any(a is not b for a, b in zip(held, flags)):
            array = mx.stack(
                [f if isinstance(f, mx.array) else mx.full((H,), f, mx.bool_) for f in flags]
            )
            self._flags = (flags, array)
        return array

    def _row_mask(self, mask, b, s, e):
        """Row b's part of a mask over the batch layout: its queries [s, e) and
        the columns of its own tokens."""
        lp = self._left[b]
        mask = mask[b : b + 1] if mask.shape[0] > 1 else mask
        mask = mask[..., s:e, :] if mask.shape[-2] > 1 else mask
        return mask[..., lp : lp + self._rows[b].offset]

    # -- moving sequences ---------------------------------------------------------

    def filter(self, batch_indices):
        """Keep the given rows (in that order), then drop the left padding they all share."""
        idx = _ints(batch_indices)
        self._close_recent()
        self._rows = [self._rows[i] for i in idx]
        self._left = [self._left[i] for i in idx]
        if self._limit is not None:
            self._limit = [self._limit[i] for i in idx]
        self._spans = self._together = None
        self._tiles, self._head = _share_tiles(self._rows), None
        shift = min(self._left, default=0)
        if shift > 0:
            self._left = [lp - shift for lp in self._left]
            self._idx -= shift
            if self._limit is not None:
                self._limit = [end - shift for end in self._limit]

    def extend(self, other):
        """Append the rows of another batch (right-aligned at the longer write position)."""
        if (self._limit is None) != (other._limit is None):
            raise ValueError(
                "cannot join a batch in the middle of a right-padded prompt with one that is not"
            )
        self._close_recent()
        other._close_recent()
        idx = max(self._idx, other._idx)
        left = [lp + idx - self._idx for lp in self._left] + [
            lp + idx - other._idx for lp in other._left
        ]
        if self._limit is not None:
            self._limit = [end + idx - self._idx for end in self._limit] + [
                end + idx - other._idx for end in other._limit
            ]
        self._rows = self._rows + other._rows
        self._left, self._idx = left, idx
        self._spans = self._together = None
        self._tiles, self._head = _share_tiles(self._rows), None
        self._v_dim = self._v_dim or other._v_dim

    def extract(self, idx):
        """Sequence idx as its own KVarNCache (a copy: the batch goes on without it)."""
        self._sync([idx])
        return _detached(self._rows[idx])

    # -- bytes and state ----------------------------------------------------------

    @property
    def nbytes(self):
        """The bytes of the rows' arrays and of the recent buffer (a row whose tail
        lives in the buffer holds no tail of its own then)."""
        held = sum(r.nbytes for r in self._rows)
        return held + (0 if self._recent is None else sum(x.nbytes for x in self._recent))

    @property
    def state(self):
        return {
            "rows": [r.state for r in self.rows],
            "left_padding": list(self._left),
            "idx": self._idx,
        }

    @state.setter
    def state(self, s):
        rows = []
        for rs in s["rows"]:
            row = KVarNCache.__new__(KVarNCache)
            row.state = rs
            rows.append(row)
        self.__init__(rows)
        self._left = [int(x) for x in _ints(s["left_padding"])]
        self._idx = int(s["idx"])
        if any(self._idx - lp != r.offset for lp, r in zip(self._left, self._rows)):
            raise ValueError("corrupt BatchKVarNCache state: padding and row token counts disagree")


# Settings that give tiles their shapes and dtypes: rows that agree share one storage.
_TILE_SETTINGS = ("k_bits", "v_bits", "group_size", "scale_dtype")


def _share_tiles(rows):
    """Rows of one kind (plain KVarNCaches, the same tile settings) keep their
    tiles in one BatchTiles (copied once); None: each keeps its own storage, and
    attention runs per row (subclasses may store tiles their own way)."""
    kinds = {(type(r), *(getattr(r.config, f) for f in _TILE_SETTINGS)) for r in rows}
    if len(kinds) != 1 or type(rows[0]) is not KVarNCache:
        for r in rows:
            if isinstance(r.tiles, RowTiles):
                r.tiles = r.tiles.alone()
        return None
    for r in rows:
        if isinstance(r.tiles, RowTiles):
            r.tiles = r.tiles.alone()
    shared = batch_tiles.join([r.tiles for r in rows])
    for r, t in zip(rows, shared.rows):
        r.tiles = t
    return shared


# A decode step's recent tokens are padded to a multiple of this many (a row's tail
# buffer grows by as many, KVarNCache.tail_step).
ROOM = 32


# Decode steps on the ops path run attention.attend through mx.compile, as
# attention.py does for a single cache's (traced once per shape, replayed from
# C++), with the mask of the rows' own columns as an input: the shapes change at
# a tile and every ROOM steps, not at every step.
def _attend_arrays(q, sk, sv, rk, rv, mask, rotate_k, arrays, n, bits, rotate_v, scale, _):
    tiles = TileStorage(*arrays, count=n) if n else None
    view = StepView(sk, sv, tiles, n, rk, rv, *bits, rotate_k, rotate_v)
    return attention.attend(q, view, scale, mask)


_compiled = dispatch.Compiled(_attend_arrays)


def _attend_compiled(queries, view, scale, mask):
    return _compiled(
        queries,
        view.sink_k,
        view.sink_v,
        view.recent_k,
        view.recent_v,
        mask,
        view.rotate_k,
        view.tiles.arrays() if view.n_tiles else (),
        view.n_tiles,
        (view.k_bits, view.v_bits),
        view.rotate_v,
        float(scale),
        attention.trace_streams(view.n_tiles, queries.shape[0]),
    )


# (sink, tiles, recent tokens per row, G, R) -> the mask of a one-graph step; the
# layers of a step share one (a few differ while their tiles wait for a commit).
_masks = {}


def _own_columns(counts, G, R):
    """[B, 1, 1, columns] True at each row's own sink, tile and recent columns of a
    decode step's view (its recent tokens padded to R). Built by MLX ops from the
    rows' counts (no host array of the mask's size at each step)."""
    key = (counts, G, R)
    if key not in _masks:
        if len(_masks) > 64:
            _masks.clear()
        S, n = max(counts[0]), max(counts[1])
        s, t, r = (x.reshape(-1, 1, 1, 1) for x in _per_row(*counts))
        c = mx.arange(S + n * G + R)
        own = (c < s) | ((c >= S) & (c < S + t * G)) | ((c >= S + n * G) & (c < S + n * G + r))
        _masks[key] = own
    return _masks[key]


def _per_row(*counts):
    """The rows' counts as int32 arrays [B] each (one small array per step)."""
    return mx.split(mx.array(list(zip(*counts)), mx.int32), len(counts), axis=1)


_lens = {}


def _lengths(counts):
    """The Metal kernel's row_lens [B, 3] (tiles, sink, recent tokens per row), made once
    per step (the layers share it)."""
    if counts not in _lens:
        if len(_lens) > 64:
            _lens.clear()
        sinks_n, tiles_n, recent_n = counts
        _lens[counts] = mx.array(list(zip(tiles_n, sinks_n, recent_n)), mx.int32)
    return _lens[counts]


# (left padding, sink, tiles, recent tokens per row, G) -> for each column of the
# batch layout, its column in a decode step's view (sink, tiles, recent, one zero).
_layouts = {}


def _layout_index(left, counts, G, R):
    """[B, 1, columns, 1] int32: where each column of the batch layout (row b's
    tokens from column left[b] on, zeros before) is in a decode step's view (its
    recent tokens padded to R, then one zero column). Built by MLX ops, as
    _own_columns."""
    key = (left, counts, G, R)
    if key not in _layouts:
        if len(_layouts) > 64:
            _layouts.clear()
        sinks_n, tiles_n, recent_n = counts
        S, n = max(sinks_n), max(tiles_n)
        width = left[0] + sinks_n[0] + tiles_n[0] * G + recent_n[0]
        lp, s, t = (x.reshape(-1, 1) for x in _per_row(left, sinks_n, tiles_n))
        j = mx.arange(width)[None] - lp  # the column's token in the row, < 0 in padding
        index = mx.where(
            j < 0,
            S + n * G + R,
            mx.where(j < s, j, mx.where(j < s + t * G, S + j - s, S + n * G + j - s - t * G)),
        )
        _layouts[key] = index[:, None, :, None].astype(mx.int32)
    return _layouts[key]


_at = {}


def _positions(pos):
    """[B, 1, 1, 1] int32: the column of each row's new token in the recent buffer, made
    once per step (the layers share it)."""
    if pos not in _at:
        if len(_at) > 64:
            _at.clear()
        _at[pos] = mx.array(pos, mx.int32).reshape(-1, 1, 1, 1)
    return _at[pos]


_zero_columns = {}


def _zeros(shape, dtype):
    """An evaluated zero array of that shape, made once (a decode step's padding column)."""
    key = (shape, dtype)
    if key not in _zero_columns:
        if len(_zero_columns) > 64:
            _zero_columns.clear()
        _zero_columns[key] = mx.zeros(shape, dtype)
        mx.eval(_zero_columns[key])
    return _zero_columns[key]


def _as(x, dtype):
    return x if x.dtype == dtype else x.astype(dtype)


def _row_counts(rows):
    """(sink, tiles, tail tokens) of each row, three tuples."""
    return (
        tuple(r.n_sink for r in rows),
        tuple(r.n_tiles for r in rows),
        tuple(r.n_tail for r in rows),
    )


def _padded(xs, n):
    """Rows [1, H, <=n, D] as one [B, H, n, D], zeros after each row's own tokens."""
    return mx.concatenate(
        [
            x if x.shape[2] == n else mx.pad(x, [(0, 0), (0, 0), (0, n - x.shape[2]), (0, 0)])
            for x in xs
        ]
    )


def _detached(cache):
    """A copy of a KVarNCache that shares no array object with it. MLX arrays
    are immutable values under their Python handles: deepcopy copies handles,
    not data, and in-place updates of one copy leave the other as it was. A
    batch row's tiles come back as its own storage, as the single cache holds them."""
    tiles = cache.tiles
    if isinstance(tiles, RowTiles):
        cache.tiles = None
        try:
            c = copy.deepcopy(cache)
        finally:
            cache.tiles = tiles
        c.tiles = tiles.alone()
    else:
        c = copy.deepcopy(cache)
    c._step = None  # the step of the cache copied from, not this one's
    return c


def _ints(x):
    return x.tolist() if isinstance(x, mx.array) else list(x)


def _keep_alive(*_):
    """Finalizer callback: its arguments live exactly as long as the finalized object."""
