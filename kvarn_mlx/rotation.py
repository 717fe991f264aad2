"""The "auto" key rotation: per kv head, rotated or plain keys (docs/algorithm.md,
"Rotation" and "What happens when").

A layer's first key tiles are quantized both ways; the step's queries then
choose, per kv head, the variant whose attention distribution is closer to the
exact one. The choice is made once and used for every later tile.
"""

from dataclasses import dataclass

import mlx.core as mx

from . import dispatch, quant

# Keep key rotation unless unrotated keys' attention error is below this fraction
# of the rotated keys' (ties go to the paper's choice; 0.95 measured on tiny models
# with and without outlier key channels, tests/test_auto_rotation.py).
KEY_ROTATION_MARGIN = 0.95
# The choice reads the first DECIDE_TILES candidate tiles and the step's first
# DECIDE_ROWS query rows: what a prefill in 256-token chunks sees at its first
# tile. A long first chunk (2,048 tokens) would otherwise compare three
# float32 attention distributions over all its rows and tiles, a few times the
# cost of the chunk's own attention.
DECIDE_TILES = 2
DECIDE_ROWS = 256


@dataclass(eq=False)
class KeyCandidates:
    """Both quantized variants of a layer's first key tiles, until the choice.

    keys: the full-precision key tiles [B, H, m, G, D]; rotated, plain: their
    (words, a, b, t); start: their index in the tile storage."""

    keys: mx.array
    rotated: tuple
    plain: tuple
    start: int


def candidates(k_tiles, config, start) -> KeyCandidates:
    c = config
    rot = dispatch.quantize_keys(k_tiles, c.k_bits, c.iters, True, c.scale_dtype)
    plain = dispatch.quantize_keys(k_tiles, c.k_bits, c.iters, False, c.scale_dtype)
    return KeyCandidates(k_tiles, rot, plain, start)


def joined(first: KeyCandidates | None, then: KeyCandidates) -> KeyCandidates:
    """Candidates of consecutive tiles as one: a long step that commits a layer's
    waiting first tile and quantizes more before any query chose makes both, and
    the one choice must write every tile quantized both ways."""
    if first is None:
        return then
    if first.start + first.keys.shape[2] != then.start:
        raise ValueError("key candidates must be of consecutive tiles")

    def cat(x, y):
        return mx.concatenate([x, y], axis=2)

    return KeyCandidates(
        cat(first.keys, then.keys),
        tuple(map(cat, first.rotated, then.rotated)),
        tuple(map(cat, first.plain, then.plain)),
        first.start,
    )


def decide(cand: KeyCandidates, k_bits, queries=None):
    """Per kv head, whether to keep rotation: the key variant whose attention over
    the candidate tiles, softmax(q k_hat), is closer (L1) to softmax(q k).

    queries [B, H, rows, D] are the step's unrotated queries, already times the
    softmax scale, grouped by kv head; without them the keys (times D^-0.5) stand
    in. Only the first DECIDE_TILES tiles are compared. Returns
    (keep_rotation [H] bool, the chosen (words, a, b, t))."""
    B, H, m, G, D = cand.keys.shape
    n = min(m, DECIDE_TILES)
    k = cand.keys[:, :, :n].reshape(B, H, n * G, D).astype(mx.float32)
    q = k * D**-0.5 if queries is None else queries.astype(mx.float32)
    p = mx.softmax(q @ mx.swapaxes(k, -1, -2), axis=-1, precise=True)

    # Softmax ignores score errors that are the same for every key of a query;
    # comparing attention distributions counts only the errors that matter.
    def attention_error(words, a, b, t, rotated):
        words, a, b, t = (x[:, :, :n] for x in (words, a, b, t))
        k_hat = quant.dequantize_keys(words, a, b, t, k_bits).reshape(B, H, n * G, D)
        k_hat = quant.unrotate(k_hat) if rotated else k_hat
        p_hat = mx.softmax(q @ mx.swapaxes(k_hat, -1, -2), axis=-1, precise=True)
        return mx.mean(mx.abs(p_hat - p).sum(axis=-1), axis=(0, 2))  # per kv head

    keep = attention_error(*cand.rotated, True) * KEY_ROTATION_MARGIN <= attention_error(
        *cand.plain, False
    )
    chosen = tuple(
        mx.where(keep.reshape(1, H, *([1] * (r.ndim - 2))), r, p)
        for r, p in zip(cand.rotated, cand.plain)
    )
    return keep, chosen
