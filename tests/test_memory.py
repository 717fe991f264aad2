"""kvarn_mlx.memory: bytes held by every kind of cache layer, and where KVarN starts saving."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import KVarNConfig, get_preset
from kvarn_mlx.memory import cache_bytes, layer_bytes, saving_starts_at


def kv(B, H, L, D, dtype, seed=0):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((B, H, L, D), key=k1).astype(dtype), mx.random.normal(
        (B, H, L, D), key=k2
    ).astype(dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_plain_kvcache(dtype):
    c = KVCache()
    assert layer_bytes(c) == {"held": 0, "unused": 0, "tokens": 0, "plain": 0, "fp16": 0}
    c.update_and_fetch(*kv(1, 3, 41, 64, dtype))
    b = layer_bytes(c)
    used = c.keys[..., :41, :].nbytes + c.values[..., :41, :].nbytes
    assert b == {
        "held": c.nbytes,
        "unused": c.nbytes - used,
        "tokens": 41,
        "plain": used,
        "fp16": 2 * 3 * 41 * 64 * 2,
    }
    assert b["held"] == 2 * 3 * 256 * 64 * dtype.size  # one 256-token step preallocated


def test_kvarn_layer_against_its_arrays():
    c = KVarNCache(get_preset("k4v2_g128", iters=1))
    c.update_and_fetch(*kv(1, 2, 128 + 3 * 128 + 50, 64, mx.float32))
    b = layer_bytes(c)
    assert b["held"] == c.nbytes == sum(x.nbytes for x in c.held_arrays())
    assert b["unused"] == c.nbytes_breakdown()["unused"] > 0
    assert b["tokens"] == c.offset == 562
    assert b["plain"] == 2 * 2 * 562 * 64 * 4
    assert b["fp16"] == 2 * 2 * 562 * 64 * 2
    assert b["held"] < b["plain"]


def test_quantized_and_rotating_layers():
    q = QuantizedKVCache(group_size=64, bits=4)
    q.update_and_fetch(*kv(1, 2, 10, 64, mx.float16))
    b = layer_bytes(q)
    assert b["held"] == q.nbytes and b["tokens"] == 10
    assert b["plain"] == b["fp16"] == 2 * 2 * 10 * 64 * 2
    assert b["held"] - b["unused"] == sum(x[..., :10, :].nbytes for x in (*q.keys, *q.values))

    r = RotatingKVCache(max_size=32)
    for i in range(40):
        r.update_and_fetch(*kv(1, 2, 1, 16, mx.float32, seed=i))
    b = layer_bytes(r)
    assert b["tokens"] == 32 and b["plain"] == 2 * 2 * 32 * 16 * 4 and b["unused"] == 0


def test_recurrent_state_counts_as_itself():
    a = ArraysCache(2)
    a[0] = mx.zeros((1, 4, 8), mx.float32)
    b = layer_bytes(a)
    assert (
        b["held"] == a.nbytes == 128 and b["plain"] == 128 and b["fp16"] == 64 and b["tokens"] == 0
    )


def test_cache_bytes_sums_and_ratios():
    caches = [KVarNCache(get_preset("k4v2_g128", iters=1)), KVCache()]
    s = cache_bytes(caches)
    assert s["held"] == 0 and s["ratio_plain"] == 0.0 and s["ratio_fp16"] == 0.0 and s["tiles"] == 0
    k, v = kv(1, 2, 128 + 2 * 128 + 5, 64, mx.float32)
    for c in caches:
        c.update_and_fetch(k, v)
    s = cache_bytes(caches)
    per = [layer_bytes(c) for c in caches]
    for key in ("held", "unused", "tokens", "plain", "fp16"):
        assert s[key] == per[0][key] + per[1][key]
    assert (s["kvarn_layers"], s["layers"], s["tiles"]) == (1, 2, 2)
    assert s["ratio_plain"] == s["plain"] / s["held"] and s["ratio_fp16"] == s["fp16"] / s["held"]


@pytest.mark.parametrize(
    "config, D, dtype",
    [
        (get_preset("k4v2_g128"), 64, mx.float16),
        (get_preset("k4v2_g128"), 64, mx.float32),
        (get_preset("auto2", sink=0), 64, mx.float16),
        (KVarNConfig(group_size=64, sink=16), 128, mx.float32),
    ],
)
def test_saving_starts_where_measured_caches_say(config, D, dtype):
    """Fed one token at a time, the cache holds at least the plain bytes just
    before the answer and fewer from it on (checked over two growth periods)."""
    n0 = saving_starts_at(config, D, dtype.size)
    c = KVarNCache(config)
    G = config.group_size
    held = []
    for i in range(n0 + 2 * (c.step_tiles + 1) * G):
        c.update_and_fetch(*kv(1, 1, 1, D, dtype, seed=i))
        held.append(c.nbytes)
        if i % 64 == 0:
            mx.eval(c.held_arrays())
    plain = [2 * (i + 1) * D * dtype.size for i in range(len(held))]
    assert held[n0 - 2] >= plain[n0 - 2]
    assert all(h < p for h, p in zip(held[n0 - 1 :], plain[n0 - 1 :]))
    assert n0 > config.sink_size  # nothing is saved before the first tile


def test_saving_starts_at_rejects_other_sizes():
    with pytest.raises(ValueError, match="dtype_bytes"):
        saving_starts_at(get_preset("k4v2_g128"), 64, 3)
