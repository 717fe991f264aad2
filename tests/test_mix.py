"""Per-layer widths from a calibration profile: the allocation (exact, monotone in
the budget, never above a preset's bytes at its bytes), make_cache(profile=...)
and the refusals, on tiny models with synthetic profiles."""

import copy
import itertools
import json
import random

import mlx.core as mx
import pytest

from kvarn_mlx import generate, integration, memory
from kvarn_mlx import mix as M
from kvarn_mlx import profile as P
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import get_preset
from kvarn_mlx.integration import make_cache, profile_mix
from models import tiny_model

WIDTHS = [2, 3, 4, 5, 6, 8]
PRESETS = ["auto2", "auto4v2", "k4v4_g128", "k6v4_g128", "k8v8_g128"]


def synthetic(model, seed=0, layers=None):
    """A profile of this model with made-up KLs: falling 4x per bit, each layer
    and side its own scale (what calibration measures, in shape)."""
    rng = random.Random(seed)
    layers = integration.quantizable_layers(model)[0] if layers is None else layers
    entries = [
        {
            "layer": l,
            **{
                s: {str(w): rng.uniform(0.2, 5) * 0.3 * 4.0 ** -(w - 2) for w in WIDTHS}
                for s in "kv"
            },
        }
        for l in layers
    ]
    return {
        "format": P.FORMAT,
        "format_version": P.FORMAT_VERSION,
        "model": {"model": "tiny", "fingerprint": P.fingerprint(model)},
        "settings": {k: getattr(get_preset("auto4v2"), k) for k in P.SETTINGS},
        "widths": WIDTHS,
        "layers": entries,
        "text": {"tokens": 1024},
    }


def with_fp8(p, cost=1.05):
    """p with its 2-4 bit widths measured with one-byte scales too, each KL `cost` times
    the float16-scale one (the reconstruction error fp8.py measures: within 7%)."""
    p = copy.deepcopy(p)
    p["fp8_widths"] = [2, 3, 4]
    for e in p["layers"]:
        for s in "kv":
            e[s + "_fp8"] = {str(w): cost * e[s][str(w)] for w in (2, 3, 4)}
    return p


def save(tmp_path, p, name="p.json"):
    path = tmp_path / name
    path.write_text(json.dumps(p))
    return str(path)


@pytest.fixture(scope="module")
def models():
    return {name: tiny_model(name) for name in ("llama64", "gemma3", "llama128")}


def test_allocate_is_exact():
    """The dynamic programme finds the least total KL within the budget, as a brute force does."""
    rng = random.Random(0)
    for _ in range(20):
        groups = [[(rng.randint(0, 6), rng.uniform(0, 1)) for _ in range(3)] for _ in range(4)]
        for budget in range(0, 25):
            chosen, best = M.allocate(groups, budget)
            fits = [
                (sum(g[i][1] for g, i in zip(groups, pick)), pick)
                for pick in itertools.product(range(3), repeat=4)
                if sum(g[i][0] for g, i in zip(groups, pick)) <= budget
            ]
            if not fits:
                assert chosen is None
                continue
            assert sum(g[i][0] for g, i in zip(groups, chosen)) <= budget
            assert sum(g[i][1] for g, i in zip(groups, chosen)) == pytest.approx(min(fits)[0])
            assert best[budget] == pytest.approx(min(fits)[0])


@pytest.mark.parametrize("name", ["llama64", "gemma3", "llama128"])
def test_mix_is_monotone_in_the_budget_and_never_above_a_preset(name, models):
    model = models[name]
    p = synthetic(model)
    layers, shapes = integration.quantizable_layers(model)
    mixes = sorted(
        (M.choose(p, shapes, bytes_like=b) for b in PRESETS), key=lambda m: m.budget["tile_bytes"]
    )
    for a, b in zip(mixes, mixes[1:]):
        assert b.predicted_kl <= a.predicted_kl
    for m in mixes:
        assert m.tile_bytes <= m.budget["tile_bytes"]
        assert m.predicted_kl <= m.budget["predicted_kl"] + 1e-15
    # the least KL per budget, every budget from 0 up, never rises
    groups = M._options(p, shapes)
    unit = 2
    scaled = [[(c // unit, kl) for _, c, kl in opts] for _, opts in groups]
    _, best = M.allocate(scaled, mixes[-1].budget["tile_bytes"] // unit)
    finite = best[best < float("inf")]
    assert (finite[1:] <= finite[:-1]).all()


def test_mix_predicts_less_than_the_uniform_preset_when_layers_differ(models):
    model = models["llama64"]
    p = synthetic(model)
    p["layers"][0]["k"] = {
        str(w): 10 * v for w, v in p["layers"][0]["k"].items()
    }  # keys of layer 0 matter more
    shapes = integration.quantizable_layers(model)[1]
    m = M.choose(p, shapes, bytes_like="auto4v2")
    assert m.predicted_kl < m.budget["predicted_kl"]
    assert m.widths[0][0] >= m.widths[1][0]  # key bits go where they matter


@pytest.mark.parametrize("name", ["llama64", "gemma3"])
def test_held_bytes_of_the_mix_never_exceed_the_preset(name, models, tmp_path):
    model = models[name]
    path = save(tmp_path, synthetic(model))
    x = (mx.arange(700) % 200)[None]
    for preset in ("auto2", "auto4v2"):
        mixed = make_cache(model, profile=path, bytes_like=preset)
        plain = make_cache(model, preset)
        model(x, cache=mixed)
        model(x, cache=plain)
        held = memory.cache_bytes(mixed)["held"], memory.cache_bytes(plain)["held"]
        assert held[0] <= held[1]
        assert any(isinstance(c, KVarNCache) for c in mixed)
        widths = {
            i: (c.config.k_bits, c.config.v_bits)
            for i, c in enumerate(mixed)
            if isinstance(c, KVarNCache)
        }
        assert widths == profile_mix(model, path, preset)[0].widths


def test_one_byte_scales_let_a_mix_beat_the_narrowest_preset(models, tmp_path):
    """With only float16 scales the mix at auto2's bytes is auto2 (2 bits is the narrowest
    width); one-byte scales make some layers cheaper and pay for wider codes elsewhere:
    less predicted KL, no more bytes held, and those layers' caches store e4m3 scales.
    (Head dim 64: two layers' saved scale bytes pay for one side's third bit; the tiny
    models with wider heads have too few layers to.)"""
    model = models["llama64"]
    p = synthetic(model)
    shapes = integration.quantizable_layers(model)[1]
    plain = M.choose(p, shapes, bytes_like="auto2")
    assert set(plain.widths.values()) == {(2, 2)} and not plain.fp8
    assert plain.predicted_kl == pytest.approx(plain.budget["predicted_kl"])
    m = M.choose(with_fp8(p), shapes, bytes_like="auto2")
    assert m.fp8 and any(max(w) > 2 for w in m.widths.values())
    assert m.predicted_kl < 0.9 * m.budget["predicted_kl"]
    assert m.tile_bytes <= m.budget["tile_bytes"]
    path = save(tmp_path, with_fp8(p))
    mixed, preset = make_cache(model, profile=path, bytes_like="auto2"), make_cache(model, "auto2")
    x = (mx.arange(700) % 200)[None]
    model(x, cache=mixed)
    model(x, cache=preset)
    assert memory.cache_bytes(mixed)["held"] <= memory.cache_bytes(preset)["held"]
    for i, c in enumerate(mixed):
        if isinstance(c, KVarNCache):
            assert (c.config.scale_dtype == "fp8") == (i in m.fp8)
            assert (c.config.k_bits, c.config.v_bits) == m.widths[i]
    assert "/fp8" in m.describe() and any("/fp8" in w for w in m.summary()["widths"].values())
    # an expensive fp8 (KL 3x float16's) is not worth its saved bytes at auto4v2's
    assert not M.choose(with_fp8(p, cost=3.0), shapes, bytes_like="auto4v2").fp8


def test_tile_bytes_are_those_a_real_cache_holds():
    cfg = get_preset("k4v2_g128")
    kb, vb = M.tile_bytes(cfg, 2, 64, mx.float16)
    c = KVarNCache(cfg)
    x = mx.random.normal((1, 2, 128 + 3 * 128, 64)).astype(mx.float16)
    c.update_and_fetch(x, x)
    b = c.nbytes_breakdown()
    assert (kb + vb) * c.n_tiles == b["codes"] + b["scales"]
    assert kb > vb  # 4-bit keys against 2-bit values


def test_max_kl_gives_the_fewest_bytes_below_it(models):
    model = models["llama64"]
    p = synthetic(model)
    shapes = integration.quantizable_layers(model)[1]
    for target in (0.5, 0.05, 0.01, 0.003):
        m = M.choose(p, shapes, max_kl=target)
        assert m.predicted_kl <= target
        smaller = [M.choose(p, shapes, bytes_like=b) for b in PRESETS]
        for s in smaller:  # a preset-sized mix that meets the target is never cheaper
            if s.predicted_kl <= target:
                assert m.tile_bytes <= s.tile_bytes
    with pytest.raises(ValueError, match="at best"):
        M.choose(p, shapes, max_kl=1e-12)


def test_max_kl_at_a_context_holds_there(models):
    """With a context, max_kl bounds the KL predicted there: with every cache's KL
    measured to double from 1K to 4K tokens, the mix for max_kl at 4K is exactly the
    mix for max_kl / 2 on the sum; the fewest bytes that predict it."""
    model = models["llama64"]
    p = synthetic(model)
    shapes = integration.quantizable_layers(model)[1]
    s2, s4 = (M.preset_kl(p, get_preset(n)) for n in ("auto2", "auto4v2"))
    g = with_growth(p, {1024: s2, 4096: 2 * s2}, {1024: s4, 4096: 2 * s4})
    for target in (0.05, 0.01, 0.003):
        m = M.choose(g, shapes, max_kl=target, context=4096)
        half = M.choose(g, shapes, max_kl=target / 2)
        assert (m.widths, m.fp8, m.tile_bytes) == (half.widths, half.fp8, half.tile_bytes)
        assert m.context == 4096 and m.context_kl == pytest.approx(2 * m.predicted_kl)
        assert m.context_kl <= target and "at 4,096 tokens" in m.target
        assert "at 4,096 tokens" in m.describe() and m.summary()["context"] == 4096
        # at the calibration's length, nothing to scale: the mix of the sum
        at_1k = M.choose(g, shapes, max_kl=target, context=1024)
        assert at_1k.widths == M.choose(g, shapes, max_kl=target).widths
    # a profile without a growth measurement chooses on the sum at any context
    assert (
        M.choose(p, shapes, max_kl=0.01, context=4096).widths
        == M.choose(p, shapes, max_kl=0.01).widths
    )
    with pytest.raises(ValueError, match=r"at 4,096 tokens at best"):
        M.choose(g, shapes, max_kl=1e-12, context=4096)
    with pytest.raises(ValueError, match="context"):
        M.choose(g, shapes, max_kl=0.01, context=-5)


def test_make_cache_max_kl_holds_over_the_models_context(models, tmp_path):
    """make_cache(profile=, max_kl=) predicts at the model's context length unless
    given another; a model that states none gets the sum."""
    model = models["gemma3"]  # max_position_embeddings 4096
    p = synthetic(model)
    layers, shapes = integration.quantizable_layers(model)
    s2, s4 = (M.preset_kl(p, get_preset(n)) for n in ("auto2", "auto4v2"))
    path = save(tmp_path, with_growth(p, {1024: s2, 4096: 4 * s2}, {1024: s4, 4096: 4 * s4}))
    mix = profile_mix(model, path, max_kl=0.01)[0]
    assert mix.context == 4096 and mix.context_kl <= 0.01
    assert mix.widths == M.choose(P.read(path), shapes, max_kl=0.0025).widths
    assert (
        profile_mix(model, path, max_kl=0.01, context=1024)[0].widths
        == M.choose(P.read(path), shapes, max_kl=0.01).widths
    )
    caches = make_cache(model, profile=path, max_kl=0.01)
    held = {i: (c.config.k_bits, c.config.v_bits) for i, c in enumerate(caches) if i in layers}
    assert held == mix.widths
    no_context = models["llama64"]  # states no context length: near the calibration's
    path = save(tmp_path, with_growth(synthetic(no_context), *[{1024: 1, 4096: 4}] * 2), "n.json")
    assert profile_mix(no_context, path, max_kl=0.01)[0].context is None


def test_refusals_come_before_any_cache_is_built(models, tmp_path, monkeypatch):
    model = models["llama64"]
    good = synthetic(model)
    other = save(tmp_path, synthetic(tiny_model("llama64", seed=1)), "other.json")
    missing = copy.deepcopy(good)
    missing["layers"] = missing["layers"][:1]
    wide = copy.deepcopy(good)
    wide["widths"] = [2, 4, 7]
    narrow = copy.deepcopy(good)
    narrow["layers"][1]["v"]["1"] = 0.5
    negative = copy.deepcopy(good)
    negative["layers"][0]["k"]["4"] = -1
    fp8_wide = with_fp8(good)
    fp8_wide["fp8_widths"] = [2, 5]
    fp8_missing = with_fp8(good)
    del fp8_missing["layers"][1]["v_fp8"]
    fp8_twice = with_fp8(good)
    fp8_twice["settings"]["scale_dtype"] = "fp8"

    def built(*a, **k):
        raise AssertionError("a KVarNCache was built before the profile was refused")

    monkeypatch.setattr(KVarNCache, "__init__", built)
    cases = [
        (other, "calibrated on tiny .* not on the model loaded now"),
        (save(tmp_path, missing, "m.json"), r"no measurements for layer\(s\) \[1\]"),
        (save(tmp_path, wide, "w.json"), "width 7 is not one KVarN supports"),
        (save(tmp_path, narrow, "n.json"), "width '1' is not one KVarN supports"),
        (save(tmp_path, negative, "neg.json"), "is not a number >= 0"),
        (save(tmp_path, fp8_wide, "f1.json"), "fp8 width 5: one-byte scales take widths of 2 to 4"),
        (save(tmp_path, fp8_missing, "f2.json"), "layer 1 'v_fp8': no measurements"),
        (save(tmp_path, fp8_twice, "f3.json"), "already store one-byte scales"),
        (str(tmp_path / "absent.json"), "no profile file"),
        (save(tmp_path, {"format": "x"}, "x.json"), "not a kvarn-mlx profile"),
    ]
    for path, message in cases:
        with pytest.raises(P.ProfileError, match=message):
            make_cache(model, profile=path, bytes_like="auto4v2")


def test_make_cache_options(models, tmp_path):
    model = models["llama64"]
    path = save(tmp_path, synthetic(model))
    with pytest.raises(ValueError, match="exactly one"):
        make_cache(model, profile=path)
    with pytest.raises(ValueError, match="exactly one"):
        make_cache(model, profile=path, bytes_like="auto2", max_kl=0.1)
    with pytest.raises(ValueError, match="pass profile= too"):
        make_cache(model, bytes_like="auto2")
    with pytest.raises(ValueError, match="do not combine"):
        make_cache(model, profile=path, bytes_like="auto2", fp16_layers=(0,))
    with pytest.raises(ValueError, match="max_kl"):
        make_cache(model, profile=path, max_kl=-1)
    mix = profile_mix(model, path, "auto4v2")[0]
    assert "KV widths from the profile (the bytes of auto4v2)" in mix.describe()
    assert set(mix.summary()["widths"]) == {"0", "1"}


def test_generate_flags(tmp_path, models):
    parse = generate.setup_arg_parser().parse_args
    with pytest.raises(generate.UsageError, match="pass --kv-profile"):
        generate.check_args(parse(["--kv-max-kl", "0.01"]))
    with pytest.raises(generate.UsageError, match="no profile file"):
        generate.check_args(parse(["--kv-profile", str(tmp_path / "none.json")]))
    path = save(tmp_path, synthetic(models["llama64"]))
    with pytest.raises(generate.UsageError, match="give one"):
        generate.check_args(
            parse(["--kv-profile", path, "--kv-max-kl", "0.01", "--kv-bytes-like", "auto2"])
        )
    with pytest.raises(generate.UsageError, match="--kv-bytes-like"):
        generate.check_args(parse(["--kv-profile", path, "--kv-bytes-like", "k9v2"]))
    assert generate.kv_profile(parse(["--kv-profile", path])) == (path, "auto4v2", None, None)
    # the profile's tile size (128), not the preset's, is what a tail must be a multiple of
    with pytest.raises(generate.UsageError, match="--kv-tail-tokens with --kv-profile"):
        generate.check_args(parse(["--kv-profile", path, "--kv-tail-tokens", "64"]))
    tail = parse(["--kv-profile", path, "--kv-tail-tokens", "256", "--kv-preset", "k4v2_g64"])
    generate.check_args(tail)
    assert generate.kv_profile(tail) == (path, "auto4v2", None, None)
    assert generate.kv_profile(parse(["--kv-profile", path, "--kv-max-kl", "0.01"])) == (
        path,
        None,
        0.01,
        None,
    )
    at = ["--kv-profile", path, "--kv-max-kl", "0.01", "--kv-context", "8192"]
    assert generate.kv_profile(parse(at)) == (path, None, 0.01, 8192)
    for argv, message in (
        (["--kv-context", "8192"], "pass --kv-profile"),
        (["--kv-profile", path, "--kv-context", "8192"], "give --kv-max-kl"),
        (["--kv-profile", path, "--kv-max-kl", "0.01", "--kv-context", "0"], "--kv-context 0"),
    ):
        with pytest.raises(generate.UsageError, match=message):
            generate.check_args(parse(argv))


def test_eval_method_of_a_profile(models, tmp_path):
    from kvarn_mlx.eval import methods

    model = models["llama64"]
    path = save(tmp_path, synthetic(model))
    assert methods.profile_method(f"{path}@kl0.01") == (path, None, 0.01)
    assert methods.profile_method("auto4v2") is None
    caches = methods.make_caches(model, f"{path}@auto4v2")
    widths = {i: (c.config.k_bits, c.config.v_bits) for i, c in enumerate(caches)}
    assert widths == profile_mix(model, path, "auto4v2")[0].widths
    assert methods.method_bits(f"{path}@auto2") == "mixed"
    with pytest.raises(ValueError, match="unknown KVarN preset"):
        methods.method_bits(f"{path}@k9v9")


def with_growth(p, auto2, auto4v2):
    """p with growth measurements: {tokens: measured KL} of auto2 and auto4v2."""
    p = copy.deepcopy(p)
    p["growth"] = {
        "presets": {
            "auto2": {str(c): kl for c, kl in auto2.items()},
            "auto4v2": {str(c): kl for c, kl in auto4v2.items()},
        }
    }
    return p


def test_predict_scales_the_sum_by_the_measured_growth(models):
    p = synthetic(models["llama64"])  # calibrated on 1,024 tokens
    s2, s4 = (M.preset_kl(p, get_preset(n)) for n in ("auto2", "auto4v2"))
    assert M.predict(p, s4, 4096) == s4  # no growth measured: the sum at any context
    # from 1,024 to 4,096 tokens auto4v2's measured KL doubles, auto2's grows 4x (the
    # measured values need not be the sums: only how they grow scales a sum)
    g = with_growth(p, {1024: 0.5 * s2, 4096: 2 * s2}, {1024: 3 * s4, 4096: 6 * s4})
    P.validate(g)
    assert M.predict(g, s4) == s4  # no context: the sum
    assert M.predict(g, s4, 1024) == pytest.approx(s4)  # at the calibration's length
    assert M.predict(g, s4, 4096) == pytest.approx(2 * s4)
    assert M.predict(g, s4, 2048) == pytest.approx(2**0.5 * s4)  # log-log between lengths
    assert M.predict(g, s4, 512) == pytest.approx(s4)  # below: the shortest length's KL
    assert M.predict(g, s4, 16384) == pytest.approx(4 * s4)  # the power law of the last two
    assert M.predict(g, s2, 4096) == pytest.approx(4 * s2)
    # between the presets' sums, the growth is interpolated by log sum: halfway, sqrt(2 * 4)
    mid = (s2 * s4) ** 0.5
    assert M.predict(g, mid, 4096) == pytest.approx(mid * 8**0.5)
    assert M.predict(g, 10 * s2, 4096) == pytest.approx(40 * s2)  # beyond: the nearest preset's
    # a KL that fell from 1K to 4K is not extrapolated to fall further
    falling = with_growth(p, {1024: s2, 4096: 0.5 * s2}, {1024: s4, 4096: 0.5 * s4})
    assert M.predict(falling, s4, 65536) == pytest.approx(0.5 * s4)


@pytest.mark.parametrize(
    "growth, match",
    [
        ({"presets": {}}, "growth"),
        ({"presets": {"nope": {"1024": 0.1}}}, "not a preset"),
        ({"presets": {"auto2": {"x": 0.1}}}, "not a number of tokens"),
        ({"presets": {"auto2": {"1024": -1}}}, "not a number >= 0"),
        ({"presets": {"auto2": {"1024": float("nan")}}}, "not a number >= 0"),
    ],
)
def test_a_bad_growth_field_is_refused(models, growth, match):
    p = synthetic(models["llama64"])
    p["growth"] = growth
    with pytest.raises(P.ProfileError, match=match):
        P.validate(p)
