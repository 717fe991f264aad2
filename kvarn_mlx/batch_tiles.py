"""The tiles of a batch's rows in one storage, so that a decode step attends
over every row in one graph (batch_cache.py).

BatchTiles holds one TileStorage of B rows, [capacity, B, H, ...] (tiles.py's
layout); row b's tiles are [0, count) of column b, the rest is room (padding,
for rows with fewer tiles than the longest). Each row's KVarNCache holds a
RowTiles in place of its own TileStorage: the same interface, reading and
writing column b of the shared arrays, so every rule of the single cache
(commit turns, the room tile, trim, the "auto" key choice) runs unchanged, and
a tile is written once, where the batch's attention reads it.

A RowTiles also counts the capacity the row's own storage would have grown to
(`alone_capacity`, tiles.append's rule): `alone()` gives the row back as the
single cache would hold it, bit for bit and byte for byte.
"""

import mlx.core as mx

from .tiles import ARRAYS, Tiles, TileStorage, grown_capacity, keep_derived


class BatchTiles:
    """The rows' tiles side by side; `storage` is None until a row holds a tile."""

    def __init__(self, storage, rows):
        self.storage = storage
        self.rows = rows
        self.version = 0  # counts writes: what was built from the arrays before is stale

    def reserve(self, need, step, like: Tiles):
        """Room for `need` tiles in every row: a whole number of `step` tiles
        (one copy per `step` tiles, as tiles.append)."""
        cap = 0 if self.storage is None else self.storage.capacity
        if need <= cap:
            return
        grown = grown_capacity(need, step)
        if self.storage is None:
            B = len(self.rows)
            arrays = [
                mx.zeros((grown, B, x.shape[1], *x.shape[3:]), x.dtype) for x in like.arrays()
            ]
        else:
            arrays = [
                mx.pad(x, [(0, grown - cap)] + [(0, 0)] * (x.ndim - 1))
                for x in self.storage.arrays()
            ]
        self.storage = TileStorage(*arrays)
        self.forget()

    def write(self, b, start, arrays):
        """Row b's batch-major arrays [1, H, m, ...] (ARRAYS order, or the four key
        arrays) at its tiles [start, start + m)."""
        m = arrays[0].shape[2]
        self.forget()
        for name, x in zip(ARRAYS, arrays):
            getattr(self.storage, name)[start : start + m, b : b + 1] = mx.moveaxis(x, 2, 0)

    def forget(self):
        """Drop what rows built lazily from the arrays before a write (KVarNCache._head):
        nothing then holds the old arrays, and the write updates them in place."""
        self.version += 1
        for r in self.rows:
            keep_derived(r, None)


class RowTiles:
    """Row b of a BatchTiles, with TileStorage's interface."""

    def __init__(self, batch, b, count, alone_capacity):
        self.batch, self.b = batch, b
        self.count = count
        self.alone_capacity = alone_capacity

    @property
    def capacity(self) -> int:
        s = self.batch.storage
        return 0 if s is None else s.capacity

    @property
    def group_size(self) -> int:
        return self.batch.storage.group_size

    def arrays(self):
        s = self.batch.storage
        return () if s is None else tuple(getattr(self, name) for name in ARRAYS)

    def valid(self, n=None) -> Tiles:
        n = self.count if n is None else n
        b = self.b
        return Tiles(*(mx.moveaxis(x[:n, b : b + 1], 0, 2) for x in self.batch.storage.arrays()))

    def write(self, start, arrays):
        self.batch.write(self.b, start, arrays)

    def append(self, new: Tiles, step):
        """tiles.append for a batch row: the new tiles after its valid ones."""
        need = self.count + new.count
        if need > self.alone_capacity:
            self.alone_capacity = grown_capacity(need, step)
        self.batch.reserve(need, step, new)
        self.write(self.count, new.arrays())
        self.count = need
        return self

    @property
    def nbytes(self):
        return sum(x.nbytes for x in self.arrays())

    def nbytes_breakdown(self):
        """Bytes of the row's valid tiles' codes and scales, and its unused room
        (its share of the shared storage's capacity)."""
        used = {"codes": 0, "scales": 0}
        cap = self.capacity
        for name, x in zip(ARRAYS, self.arrays()):
            used["codes" if name.endswith("words") else "scales"] += x.nbytes * self.count // cap
        return {**used, "unused": self.nbytes - used["codes"] - used["scales"]}

    def dequantize(self, k_bits, v_bits, rotate_k, rotate_v, n=None):
        return self.valid(n).dequantize(k_bits, v_bits, rotate_k, rotate_v)

    def alone(self) -> TileStorage | None:
        """The row's tiles as its own storage, of the capacity the single cache's
        would have (a copy; the room beyond the valid tiles keeps the room tile)."""
        s = self.batch.storage
        if s is None or self.alone_capacity == 0:
            return None
        cap, keep = self.alone_capacity, min(self.alone_capacity, s.capacity)
        arrays = [
            mx.pad(x[:keep, self.b : self.b + 1], [(0, cap - keep)] + [(0, 0)] * (x.ndim - 1))
            for x in s.arrays()
        ]
        return TileStorage(*arrays, count=self.count)


def _column(name):
    return property(lambda self: getattr(self.batch.storage, name)[:, self.b : self.b + 1])


# k_words, k_a, ... v_c: the row's column of each shared array, [capacity, 1, H, ...]
for _name in ARRAYS:
    setattr(RowTiles, _name, _column(_name))


def join(storages) -> BatchTiles:
    """One BatchTiles holding the given rows' storages (TileStorage or None, all
    of one kind: the same per-tile shapes and dtypes), copied once."""
    held = [s for s in storages if s is not None]
    cap = max((s.capacity for s in held), default=0)
    batch = BatchTiles(None, [])
    batch.rows = [
        RowTiles(batch, b, 0 if s is None else s.count, 0 if s is None else s.capacity)
        for b, s in enumerate(storages)
    ]
    if not held or cap == 0:
        return batch

    first = held[0].arrays()

    def column(s, i):
        if s is None:
            return mx.zeros((cap, *first[i].shape[1:]), first[i].dtype)
        x = s.arrays()[i]
        return mx.pad(x, [(0, cap - x.shape[0])] + [(0, 0)] * (x.ndim - 1))

    arrays = [mx.concatenate([column(s, i) for s in storages], axis=1) for i in range(len(first))]
    batch.storage = TileStorage(*arrays)
    return batch
