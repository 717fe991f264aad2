"""The precision tail (KVarNConfig.tail_tokens): the newest tokens stay in the
model's dtype and tiles are quantized as they leave the tail, in every cache
path: prefill chunks, decoding, batches, prompt-cache files, trim (speculative
decoding), the Metal kernel (tests/test_kernels.py) and the bytes counted.

Models are the tiny random-weight ones of tests/models.py (float32).
"""

import io

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache, trim_prompt_cache

from kvarn_mlx import byte_models, generate
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import KVarNConfig, get_preset
from kvarn_mlx.integration import make_cache
from kvarn_mlx.memory import cache_bytes
from kvarn_mlx.tiles import ARRAYS
from models import tiny_model, tokenizer, tokens
from test_batch import check_against_alone


def rand_kv(L, H=2, D=64, seed=0):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return (mx.random.normal((1, H, L, D), key=k1), mx.random.normal((1, H, L, D), key=k2))


# Prefill chunks, then decode steps, speculative-style 4-token steps and a chunk again.
STEPS = [100, 70, 130] + [1] * 150 + [4] * 30 + [200] + [1] * 70


def fed(preset, tail, steps=STEPS, seed=0):
    c = KVarNCache(get_preset(preset, tail_tokens=tail))
    k, v = rand_kv(sum(steps), seed=seed)
    a = 0
    for n in steps:
        mx.eval(c.update_and_fetch(k[:, :, a : a + n], v[:, :, a : a + n]))
        a += n
    return c, k, v


def tile_arrays(c):
    return [np.array(x) for x in c.tiles.valid().arrays()]


def test_config_checks_tail_tokens():
    assert KVarNConfig().tail_tokens == 0
    assert get_preset("k2v2_g128", tail_tokens=1024).tail_tokens == 1024
    for bad in (-128, 100, 64, 1.5, True):
        with pytest.raises(ValueError, match="multiple of the tile size group_size=128"):
            KVarNConfig(tail_tokens=bad)
    assert KVarNConfig(group_size=64, tail_tokens=64).tail_tokens == 64


def tails(caches):
    return {c.config.tail_tokens for c in caches if isinstance(c, KVarNCache)}


@pytest.mark.default_tail
def test_a_preset_asked_for_by_name_keeps_the_default_tail():
    model = tiny_model("llama64")
    assert tails(make_cache(model)) == {128}  # the default preset, auto4v2
    assert tails(make_cache(model, "k2v2_g128")) == {128}
    assert tails(make_cache(model, "k4v2_g64")) == {0}  # 64-token tiles: not measured with one
    assert tails(make_cache(model, "k2v2_g128", tail_tokens=0)) == {0}
    assert tails(make_cache(model, "k2v2_g128", tail_tokens=512)) == {512}
    # A config is taken as it is; the presets as get_preset names them have none.
    assert tails(make_cache(model, KVarNConfig(k_bits=2, v_bits=2))) == {0}
    assert get_preset("auto4v2").tail_tokens == 0
    # The server builds its caches the same way.
    from kvarn_mlx.server.hooks import cache_factory

    assert tails(cache_factory("auto4v2")(model)) == {128}
    assert tails(cache_factory("auto4v2", tail_tokens=0)(model)) == {0}
    # ... and /v1/kv_stats says which tail they keep.
    from argparse import Namespace

    from kvarn_mlx.server.handler import APIHandler

    def stated(preset, tail=None):
        settings = Namespace(kv_preset=preset, kv_tail_tokens=tail, kv_profile=None)
        return APIHandler.kv_tail_tokens(Namespace(settings=settings))

    assert [stated("auto4v2"), stated("auto4v2", 0), stated("k4v2_g64")] == [128, 0, 0]
    assert stated("fp16") is None


@pytest.mark.e2e
@pytest.mark.default_tail
def test_generate_says_the_default_tail(capsys, smollm):
    generate.main(["--prompt", "Hi", "--max-tokens", "2"])
    assert "newest 128 tokens in full precision" in capsys.readouterr().out


@pytest.mark.parametrize("preset", ["k4v2_g64", "k2v2_g64_auto"])
@pytest.mark.parametrize("tail", [64, 256])
def test_tiles_are_those_of_no_tail_and_the_tail_is_exact(preset, tail):
    # "auto" decides at its first tiles, by the keys here (no attention runs): steps
    # whose first tile is made alone with and without the tail give the same choice.
    steps = [128] + [64] * 5 + STEPS if "auto" in preset else STEPS
    plain, k, v = fed(preset, 0, steps)
    c, _, _ = fed(preset, tail, steps)
    S, G = c.config.sink_size, c.config.group_size
    assert c.offset == plain.offset == k.shape[2]
    # The tail holds the newest tokens beyond the tile being filled (at most a tile
    # more while one waits for its commit turn).
    assert tail <= c.n_tail < tail + 2 * G
    assert c.n_tiles == (c.offset - S - c.n_tail) // G
    # Every tile it quantized is bit for bit the one the cache without a tail made
    # for the same tokens (the "auto" choice here made by the keys, as no attention ran).
    ours, theirs = tile_arrays(c), tile_arrays(plain)
    n = c.n_tiles
    for name, a, b in zip(ARRAYS, ours, theirs):
        np.testing.assert_array_equal(a[:, :, :n], b[:, :, :n], err_msg=name)
    # The tail is the tokens themselves, and dequantized() is tiles then tail.
    start = S + n * G
    np.testing.assert_array_equal(
        np.array(c.tail_k[..., : c.n_tail, :]), np.array(k[..., start:, :])
    )
    K, V = c.dequantized()
    K0, _ = plain.dequantized()
    np.testing.assert_array_equal(np.array(K[..., :start, :]), np.array(K0[..., :start, :]))
    np.testing.assert_array_equal(np.array(V[..., start:, :]), np.array(v[..., start:, :]))


def test_bytes_count_the_tail_from_held_arrays():
    plain, _, _ = fed("k4v2_g64", 0)
    c, _, _ = fed("k4v2_g64", 256)
    b0, b = c.nbytes_breakdown(), plain.nbytes_breakdown()
    assert c.nbytes == sum(x.nbytes for x in c.held_arrays())
    # The tail's tokens in float32 (2 heads x 64 dims, keys and values) and the sink.
    assert b0["sink_tail"] == (c.n_sink + c.n_tail) * 2 * 2 * 64 * 4
    assert b0["codes"] < b["codes"]
    held = cache_bytes([c])
    assert held["held"] == c.nbytes and held["tokens"] == c.offset


def test_generate_stats_name_the_tail_bytes():
    model = tiny_model("llama64")
    cache = make_cache(model, "k4v2_g64", tail_tokens=128)
    model(mx.array(tokens(400, seed=8))[None], cache=cache)
    out = io.StringIO()
    generate.print_stats("k4v2_g64", None, cache, out=out)
    dense = sum(c.nbytes_breakdown()["sink_tail"] for c in cache)
    assert f"the newest 128 tokens and the tile being filled), {generate.mib(dense)}" in (
        out.getvalue()
    )
    assert dense == sum((c.n_sink + c.n_tail) * c.sink_k.shape[1] * 64 * 2 * 4 for c in cache)


def test_generation_reads_the_tail_in_full_precision():
    # A tail as long as the whole run: nothing is quantized, so greedy decoding is the
    # plain cache's (the sink and the tail are full precision).
    model = tiny_model("llama64")
    prompt = tokens(300, seed=3)
    plain = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=20)]
    cache = make_cache(model, "k2v2_g128", tail_tokens=512)
    ours = [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=20, prompt_cache=cache)
    ]
    assert ours == plain and all(c.n_tiles == 0 for c in cache)
    # A shorter tail quantizes the older tiles, and decoding goes on across tile exits.
    cache = make_cache(model, "k2v2_g128", tail_tokens=128)
    out = list(generate_step(mx.array(prompt), model, max_tokens=100, prompt_cache=cache))
    assert len(out) == 100 and cache[0].n_tiles >= 1 and cache[0].n_tail >= 128


def test_prompt_cache_file_round_trips_the_tail(tmp_path):
    model = tiny_model("llama64")
    prompt = tokens(500, seed=4)
    cache = make_cache(model, "k4v2_g128", tail_tokens=256)
    model(mx.array(prompt)[None], cache=cache)
    save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert [c.config for c in loaded] == [c.config for c in cache]
    assert loaded[0].n_tail == cache[0].n_tail >= 256
    # A file written by another tail setting keeps its own: continuing it is exact.
    nxt = mx.array(tokens(140, seed=5))[None]
    a, b = model(nxt, cache=cache), model(nxt, cache=loaded)
    np.testing.assert_array_equal(np.array(a), np.array(b))
    # Files written before tail_tokens existed load as tail_tokens=0.
    state = dict(make_cache(model, "k4v2_g128")[0].state)
    state.pop("tail_tokens")
    c = KVarNCache.__new__(KVarNCache)
    c.state = state
    assert c.config.tail_tokens == 0
    state["tail_tokens"] = 100
    with pytest.raises(ValueError, match="multiple of the tile size"):
        c.state = state


@pytest.mark.parametrize("drop", [3, 20, 200, 700])
def test_trim_into_the_tail_and_past_it(drop):
    # Speculative decoding trims the newest tokens: inside the tail exactly; past it
    # into the quantized tiles, as without a tail (the cut tile comes back dequantized).
    c, k, v = fed("k4v2_g64", 256)
    keep, inside = c.offset - drop, drop <= c.n_tail
    assert c.trim(drop) == drop and c.offset == keep
    S, G = c.config.sink_size, c.config.group_size
    if inside:
        start = S + c.n_tiles * G
        assert c.n_tail == keep - start
        np.testing.assert_array_equal(
            np.array(c.tail_k[..., : c.n_tail, :]), np.array(k[..., start:keep, :])
        )
    # Refilled with the same tokens, it holds the tiles the cache without a tail holds.
    a = keep
    for n in [1] * 5 + [60, 200]:
        mx.eval(c.update_and_fetch(k[:, :, a : a + n], v[:, :, a : a + n]))
        a += n
    plain = KVarNCache(get_preset("k4v2_g64"))
    mx.eval(plain.update_and_fetch(k[:, :, :a], v[:, :, :a]))
    if inside:  # nothing was dequantized: every tile exact
        for x, y in zip(tile_arrays(c), tile_arrays(plain)):
            np.testing.assert_array_equal(x, y[:, :, : c.n_tiles])


def test_speculative_decoding_equals_plain_decoding_with_a_tail():
    model, draft = tiny_model("llama64", seed=0), tiny_model("qwen2", seed=1)
    prompt = mx.array(tokens(128 + 240, seed=15))  # the first tile leaves the tail mid-run
    plain = [
        int(t)
        for t, _ in generate_step(
            prompt, model, max_tokens=40, prompt_cache=make_cache(model, tail_tokens=128)
        )
    ]
    cache = make_cache(model, tail_tokens=128) + make_cache(draft, tail_tokens=128)
    spec = list(
        speculative_generate_step(
            prompt, model, draft, num_draft_tokens=3, max_tokens=40, prompt_cache=cache
        )
    )
    assert [int(t) for t, _, _ in spec] == plain
    assert cache[0].n_tiles >= 1 and any(not d for _, _, d in spec[1:])


def test_trim_prompt_cache_with_a_tail():
    model = tiny_model("llama64")
    cache = make_cache(model, "k2v2_g128", tail_tokens=256)
    model(mx.array(tokens(600, seed=6))[None], cache=cache)
    assert trim_prompt_cache(cache, 50) == 50 and cache[0].offset == 550


def test_batch_generate_with_a_tail_equals_each_prompt_alone():
    # One KVarNCache per row: each row's tail and tile exits at its own positions.
    model, tok = tiny_model("llama64"), tokenizer()
    prompts = [[t % 255 for t in tokens(n, seed=i)] for i, n in enumerate([20, 170, 300])]
    make = lambda: make_cache(model, "k4v2_g128", sink=16, tail_tokens=128)
    assert check_against_alone(model, tok, prompts, make, 40) <= 1


@pytest.mark.parametrize("tail", [0, 128, 256])
def test_byte_model_is_the_most_any_order_of_steps_holds(tail):
    # The planner's per-layer rule (byte_models.SinkTilesTail): over prompts of several
    # lengths then decoding, no cache holds more than peak(n) at any count up to n (with
    # the tail's tokens counted as tiles, a tail of 128 float32 tokens would exceed it).
    cfg = get_preset("k4v2_g64", tail_tokens=tail)
    layer = byte_models.Layer("kv", heads=2, k_dim=64, v_dim=64, dtype="float32")
    m = byte_models.sink_tiles_tail_of(cfg, layer)
    S, G = cfg.sink_size, cfg.group_size
    n = S + tail + 6 * G + 40
    for prompt in ([n], [S + tail + 4 * G], [S + tail + 5 * G - 1], [S + 2 * G, 2 * G + tail], [1]):
        c, seen = KVarNCache(cfg), 0
        k, v = rand_kv(n, seed=len(prompt))
        for L in [*prompt, *[1] * (n - sum(prompt))]:
            mx.eval(c.update_and_fetch(k[:, :, seen : seen + L], v[:, :, seen : seen + L]))
            seen += L
            assert c.nbytes <= m.peak(seen), (prompt, seen)
        if prompt == [n]:
            assert c.n_tail == tail + 40
