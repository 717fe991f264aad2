"""Speculative decoding on KVarN caches: a verification step's draft tokens
that the model rejects never enter a quantized tile, and mlx-lm's speculative
generation gives the tokens of plain greedy decoding.

Short steps (decoding, verifying drafts) leave the tile they fill in the tail
until the next update, after mlx-lm has trimmed the rejected drafts.
"""

import mlx.core as mx
import numpy as np
import pytest

from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import KVarNConfig

CFG = KVarNConfig(k_bits=4, v_bits=2, group_size=64, sink=16)
H, D = 2, 64


def kv(n, seed):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((1, H, n, D), key=k1), mx.random.normal((1, H, n, D), key=k2)


def assert_same_state(a, b):
    sa, sb = a.state, b.state
    assert sa.keys() == sb.keys()
    for name, x in sa.items():
        if isinstance(x, mx.array):
            np.testing.assert_array_equal(np.array(x), np.array(sb[name]), err_msg=name)
        else:
            assert x == sb[name], name


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_rejected_drafts_across_a_tile_boundary_never_enter_a_tile(accepted):
    # The tail holds G - 2 tokens; a step verifies [token, 3 drafts], which would
    # fill the tile with draft tokens; mlx-lm then trims the rejected ones.
    prefix = CFG.sink_size + CFG.group_size + CFG.group_size - 2
    k, v = kv(prefix + 4 + 6, seed=accepted)
    spec, alone = KVarNCache(CFG), KVarNCache(CFG)
    for c in (spec, alone):
        c.update_and_fetch(k[:, :, :prefix], v[:, :, :prefix])
    drafts_k = mx.concatenate([k[:, :, prefix : prefix + 1 + accepted], 50 + k[:, :, prefix + 1 + accepted : prefix + 4]], 2)
    drafts_v = mx.concatenate([v[:, :, prefix : prefix + 1 + accepted], 50 + v[:, :, prefix + 1 + accepted : prefix + 4]], 2)
    spec.update_and_fetch(drafts_k, drafts_v)
    assert spec.trim(3 - accepted) == 3 - accepted
    alone.update_and_fetch(k[:, :, prefix : prefix + 1 + accepted], v[:, :, prefix : prefix + 1 + accepted])
    assert_same_state(spec, alone)
    # and the next steps (one token, then a verification) go on identically
    n = prefix + 1 + accepted
    for c in (spec, alone):
        c.update_and_fetch(k[:, :, n : n + 1], v[:, :, n : n + 1])
        c.update_and_fetch(k[:, :, n + 1 : n + 5], v[:, :, n + 1 : n + 5])
        c.update_and_fetch(k[:, :, n + 5 : n + 6], v[:, :, n + 5 : n + 6])
    assert spec.n_tiles == 2
    assert_same_state(spec, alone)


def test_without_the_deferral_the_drafts_would_be_quantized(monkeypatch):
    # The check above can fail: committing a short step's tile at once puts the
    # rejected drafts into it, and trimming then dequantizes it (approximately).
    monkeypatch.setattr(KVarNCache, "short_step", 0)
    prefix = CFG.sink_size + 2 * CFG.group_size - 2
    k, v = kv(prefix + 4, seed=9)
    spec, alone = KVarNCache(CFG), KVarNCache(CFG)
    for c in (spec, alone):
        c.update_and_fetch(k[:, :, :prefix], v[:, :, :prefix])
    spec.update_and_fetch(k[:, :, prefix:], v[:, :, prefix:] + 50)
    spec.trim(3)
    alone.update_and_fetch(k[:, :, prefix : prefix + 1], v[:, :, prefix : prefix + 1])
    with pytest.raises(AssertionError):
        assert_same_state(spec, alone)


def test_a_decode_step_quantizes_the_tile_it_filled_at_the_next_step():
    c = KVarNCache(CFG)
    k, v = kv(CFG.sink_size + CFG.group_size + 1, seed=3)
    n = CFG.sink_size + CFG.group_size - 1
    c.update_and_fetch(k[:, :, :n], v[:, :, :n])
    c.update_and_fetch(k[:, :, n : n + 1], v[:, :, n : n + 1])  # fills the tile
    assert (c.n_tiles, c.n_tail) == (0, CFG.group_size)
    c.update_and_fetch(k[:, :, n + 1 :], v[:, :, n + 1 :])
    assert (c.n_tiles, c.n_tail) == (1, 1)
    # a prefill step (longer than short_step) quantizes at once
    p = KVarNCache(CFG)
    p.update_and_fetch(k[:, :, : n + 1], v[:, :, : n + 1])
    assert (p.n_tiles, p.n_tail) == (1, 0)
