"""Quantized tiles of one cache layer, their storage, and what one attention step reads.

A tile holds the packed codes and absorbed scales of G tokens in the rotated
space (docs/algorithm.md, "Rounding and packing", "Absorbed scales", "Storage
and bytes per token"). Quantizing full-precision tiles into Tiles is
dispatch.quantize (Metal kernel or MLX ops).

TileStorage keeps a layer's tiles tile-major, [capacity, B, H, ...], so the
first n tiles are a contiguous view: attention reads the storage in place
(the kernel gets the storage and the number of valid tiles), never a copy.
"""

import weakref
from dataclasses import dataclass, fields

import mlx.core as mx

from . import quant


@dataclass(eq=False)
class Tiles:
    """m packed tiles, batch-major [B, H, m, ...] (what a quantizer returns):

    k_words [.., D, G*kb/32], k_a, k_b [.., D], k_t [.., G]
    v_words [.., G, D*vb/32], v_a, v_b [.., G], v_c [.., D]
    """

    k_words: mx.array
    k_a: mx.array
    k_b: mx.array
    k_t: mx.array
    v_words: mx.array
    v_a: mx.array
    v_b: mx.array
    v_c: mx.array

    @property
    def count(self) -> int:
        return self.k_words.shape[2]

    def arrays(self):
        return tuple(getattr(self, n) for n in ARRAYS)

    def keys(self):
        return self.k_words, self.k_a, self.k_b, self.k_t

    @property
    def nbytes(self):
        return sum(x.nbytes for x in self.arrays())

    def dequantize(self, k_bits, v_bits, rotate_k, rotate_v):
        """Unrotated float32 K, V [B, H, m*G, D]."""
        k = quant.dequantize_keys(*self.keys(), k_bits)
        v = quant.dequantize_values(self.v_words, self.v_a, self.v_b, self.v_c, v_bits)
        k = quant.rotated_where(rotate_k, k, quant.unrotate)
        v = quant.unrotate(v) if rotate_v else v
        B, H, m, G, D = k.shape
        return k.reshape(B, H, m * G, D), v.reshape(B, H, m * G, D)


ARRAYS = tuple(f.name for f in fields(Tiles))


@dataclass(eq=False)
class TileStorage:
    """A layer's tiles, tile-major: eight arrays [capacity, B, H, ...] (the
    per-tile shapes of Tiles), of which tiles [0, count) are valid."""

    k_words: mx.array
    k_a: mx.array
    k_b: mx.array
    k_t: mx.array
    v_words: mx.array
    v_a: mx.array
    v_b: mx.array
    v_c: mx.array
    count: int = 0

    @property
    def capacity(self) -> int:
        return self.k_words.shape[0]

    @property
    def group_size(self) -> int:
        return self.k_t.shape[-1]

    def arrays(self):
        return tuple(getattr(self, n) for n in ARRAYS)

    def valid(self, n=None) -> Tiles:
        """The first n (default: count) tiles, batch-major (a transposed view)."""
        n = self.count if n is None else n
        return Tiles(*(mx.moveaxis(x[:n], 0, 2) for x in self.arrays()))

    def write(self, start, arrays):
        """Store batch-major arrays (in ARRAYS order, or the four key arrays) at tiles
        [start, start + m)."""
        m = arrays[0].shape[2]
        _derived.pop(self, None)
        for name, x in zip(ARRAYS, arrays):
            getattr(self, name)[start : start + m] = mx.moveaxis(x, 2, 0)

    def rows(self, idx):
        """The tiles of batch rows idx (an int list or array), as their own storage."""
        idx = mx.array(idx)
        return TileStorage(*(x[:, idx] for x in self.arrays()), count=self.count)

    @property
    def nbytes(self):
        return sum(x.nbytes for x in self.arrays())

    def nbytes_breakdown(self):
        """Bytes of the valid tiles' codes and scales, and the unused room."""
        used = {"codes": 0, "scales": 0}
        for name, x in zip(ARRAYS, self.arrays()):
            used["codes" if name.endswith("words") else "scales"] += (
                x.nbytes * self.count // self.capacity
            )
        return {**used, "unused": self.nbytes - used["codes"] - used["scales"]}

    def dequantize(self, k_bits, v_bits, rotate_k, rotate_v, n=None):
        """The first n tiles as unrotated float32 K, V [B, H, n*G, D]."""
        return self.valid(n).dequantize(k_bits, v_bits, rotate_k, rotate_v)


# Arrays built lazily from a storage's arrays and kept for later steps
# (KVarNCache._head), beside the storage rather than in it: unevaluated, they
# hold no data of their own. A write drops them.
_derived = weakref.WeakKeyDictionary()


def derived(storage):
    """What keep_derived stored for this storage since its last write, or None."""
    return _derived.get(storage)


def keep_derived(storage, value):
    _derived[storage] = value


def grown_capacity(need, step):
    """The capacity a storage grows to for `need` tiles: a whole number of `step`
    tiles (step 0: exactly `need`)."""
    return -(-need // step) * step if step else need


def append(storage, new: Tiles, step):
    """storage (TileStorage or None) with the tiles `new` stored after its valid ones.

    Grows to a whole number of `step` tiles (step 0: exactly what is needed): at
    most step - 1 tiles of room, so the capacity depends only on the most tiles
    the layer held (the planner's bound, byte_models.py, is exact), and decoding
    copies the tiles once per step tiles, while its every step's attention reads
    all of them."""
    if storage is not None and not isinstance(storage, TileStorage):
        return storage.append(new, step)  # a batch row's tiles (batch_tiles.RowTiles)
    count = 0 if storage is None else storage.count
    need = count + new.count
    capacity = 0 if storage is None else storage.capacity
    if need > capacity:
        grown = grown_capacity(need, step)
        if storage is None:
            arrays = [
                mx.zeros((grown, x.shape[0], x.shape[1], *x.shape[3:]), x.dtype)
                for x in new.arrays()
            ]
        else:  # one op per array: a decode step that commits a tile may grow the storage
            arrays = [
                mx.pad(x, [(0, grown - capacity)] + [(0, 0)] * (x.ndim - 1))
                for x in storage.arrays()
            ]
        storage = TileStorage(*arrays, count=count)
    storage.write(count, new.arrays())
    storage.count = need
    return storage


@dataclass(eq=False)
class StepView:
    """What one attention step reads: the sink, tiles [0, n_tiles) of the storage
    (quantized before this step), and every newer token in full precision.

    sink_k/v, recent_k/v [B, H, *, D] in the model's dtype (may hold 0 tokens);
    tiles: the storage, not a copy (None when the step sees no tile);
    rotate_k: a bool, or a bool per kv head."""

    sink_k: mx.array
    sink_v: mx.array
    tiles: TileStorage | None
    n_tiles: int
    recent_k: mx.array
    recent_v: mx.array
    k_bits: int
    v_bits: int
    rotate_k: bool | mx.array = True
    rotate_v: bool = True
    # A short step that completed a tile: its query rows from `after_tile_row` on read
    # `after_tile` (that tile quantized, as one-token decoding would see it).
    after_tile_row: int = 0
    after_tile: "StepView | None" = None
    # (k, v) buffers whose first R tokens are recent_k/v (R = recent_k.shape[2]), the
    # rest room: attention may read them whole with R as a count (a shape that
    # changes once per buffer growth, not every step). None: recent_k/v only.
    recent_room: tuple | None = None
