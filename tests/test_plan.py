"""python -m kvarn_mlx.plan against real caches.

"Measured" here means the caches the CLIs build for the model (mlx-lm's
make_prompt_cache on its model class, kvarn_mlx.make_cache for the presets,
QuantizedKVCache for the layers mlx-lm quantizes), fed keys and values of the
shape the config gives, as mlx_lm.generate feeds them (prompt chunks, then one
token per step), and summed with nbytes. Long runs on full-size configs feed
unevaluated zeros: nbytes is fixed by the arrays' shapes and dtypes, which
test_unevaluated_caches_hold_what_evaluated_ones_do checks against evaluated
random data.
"""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.utils import _get_classes

import archmodels
from grid import grid
from kvarn_mlx import byte_models, model_info, plan
from kvarn_mlx.config import PRESETS
from kvarn_mlx.integration import make_cache
from model_folder import tiny_model_folder
from models import tokens

ROOT = Path(__file__).resolve().parents[1]

QWEN3 = dict(
    model_type="qwen3",
    hidden_size=2560,
    num_hidden_layers=36,
    intermediate_size=9728,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1e6,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
)
# Gemma-3 text: 5 of every 6 layers attend over a 512-token sliding window.
GEMMA3 = dict(
    model_type="gemma3_text",
    hidden_size=640,
    num_hidden_layers=6,
    intermediate_size=2048,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    rms_norm_eps=1e-6,
    vocab_size=262144,
    sliding_window=512,
    sliding_window_pattern=6,
    query_pre_attn_scalar=256,
    max_position_embeddings=32768,
    torch_dtype="bfloat16",
)


@pytest.fixture(scope="module")
def smollm2():
    """config.json of the embedded default model (llama, 30 layers, 3 kv heads, head dim 64,
    float32)."""
    return model_info.read_model(None).config


def small(config, layers):
    """The same kv shape with fewer layers (and a small hidden size: the model never runs)."""
    c = dict(config, num_hidden_layers=layers, hidden_size=64, intermediate_size=64, vocab_size=256)
    c.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return c


def kv_shape(config):
    return config["num_key_value_heads"], config.get("head_dim") or config["hidden_size"] // config[
        "num_attention_heads"
    ]


def real_caches(config, cache):
    """The caches the CLIs build for this model and cache name (no weight is computed)."""
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    if cache.startswith("plain"):
        return make_prompt_cache(model)
    if cache.startswith("mlx-lm"):
        bits = int(cache.split()[1].split("-")[0])
        return [
            QuantizedKVCache(byte_models.MLX_KV_GROUP_SIZE, bits) if type(c) is KVCache else c
            for c in make_prompt_cache(model)
        ]
    return make_cache(model, cache, iters=1)  # normalization iterations change values, not bytes


def cache_dtype(config, cache):
    return "float16" if cache == "plain (float16)" else config["torch_dtype"]


def run(caches, config, dtype, prompt, n, evaluate=False, seed=0):
    """Feed prompt chunks (a list of token counts), then one token per step up to n
    tokens. Returns each layer's most bytes held after any step, and the most the
    layers held together."""
    H, D = kv_shape(config)
    dt = getattr(mx, dtype)
    peaks, total = [0] * len(caches), 0
    key = mx.random.key(seed)
    for L in [*prompt, *[1] * (n - sum(prompt))]:
        if evaluate:
            key, k1, k2 = mx.random.split(key, 3)
            k, v = (mx.random.normal((1, H, L, D), key=x).astype(dt) for x in (k1, k2))
        else:
            k = v = mx.zeros((1, H, L, D), dt)
        for c in caches:
            c.update_and_fetch(k, v)
        if evaluate:
            mx.eval([c.state for c in caches])
        held = [c.nbytes for c in caches]
        peaks = [max(p, h) for p, h in zip(peaks, held)]
        total = max(total, sum(held))
    return peaks, total


def chunks(n, step=byte_models.PREFILL_STEP_SIZE):
    return [min(step, n - i) for i in range(0, n, step)]


def plans(config, **kw):
    return {c.name: c for c in plan.cache_plans(config, config["torch_dtype"], **kw)}


# -- the model's layers ---------------------------------------------------------------------


def test_layers_come_from_the_model_class(smollm2):
    layers = byte_models.model_layers(model_info.lazy_model(smollm2, "float32"))
    assert len(layers) == 30 and {(l.kind, l.heads, l.k_dim, l.dtype) for l in layers} == {
        ("kv", 3, 64, "float32")
    }
    gemma = byte_models.model_layers(model_info.lazy_model(GEMMA3, "bfloat16"))
    assert [(l.kind, l.window, l.heads, l.k_dim) for l in gemma] == [
        ("window", 512, 1, 256)
    ] * 5 + [("kv", 0, 1, 256)]
    qwen = byte_models.model_layers(model_info.lazy_model(QWEN3, "bfloat16"))
    assert len(qwen) == 36 and {(l.kind, l.heads, l.k_dim, l.dtype) for l in qwen} == {
        ("kv", 8, 128, "bfloat16")
    }


def test_hybrid_recurrent_layers_hold_a_fixed_state():
    # Qwen3-Next-style: three linear-attention (recurrent) layers to one full-attention layer.
    cfg = dict(
        model_type="qwen3_next",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        moe_intermediate_size=32,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        vocab_size=256,
        rope_theta=1e4,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    layers = byte_models.model_layers(model_info.lazy_model(cfg, "bfloat16"))
    assert [l.kind for l in layers] == ["state"] * 3 + ["kv"]
    p = plans(cfg)
    for name in ("plain (bfloat16)", "k4v2_g128"):
        state = p[name].models[0]
        assert (
            state.per_token == 0
            and state.peak(10) == state.peak(10**6) == layers[0].state_bytes > 0
        )
    assert p["plain (bfloat16)"].per_token == 2 * 2 * 64 * 2  # only the attention layer grows


# -- against measured caches --------------------------------------------------------------------


def test_unevaluated_caches_hold_what_evaluated_ones_do():
    cfg = small(QWEN3, 1)
    for name in ("plain (bfloat16)", "mlx-lm 4-bit", "auto4v2", "k4v2_g64"):
        lazy = run(real_caches(cfg, name), cfg, "bfloat16", [700], 900)
        computed = run(real_caches(cfg, name), cfg, "bfloat16", [700], 900, evaluate=True)
        assert lazy == computed, name
    g = small(GEMMA3, 6)
    assert run(real_caches(g, "auto4v2"), g, "bfloat16", [600, 300], 950) == run(
        real_caches(g, "auto4v2"), g, "bfloat16", [600, 300], 950, evaluate=True
    )


CONFIGS = {"smollm2": None, "gemma3": GEMMA3, "qwen3": QWEN3}
SMALL = {"smollm2": 2, "gemma3": 6, "qwen3": 2}  # layers in the evaluated runs


def config_of(name, smollm2):
    return smollm2 if name == "smollm2" else CONFIGS[name]


# Bytes are per layer: by default each config cut to a few layers (small) checks the same
# rules; the full-size configs (smollm2 30 layers, qwen3 36) run with -m slow.
SIZES = grid(CONFIGS, ("small", "full"), covering=[(m, "small") for m in CONFIGS], ids="-".join)


def sized(model, size, smollm2):
    cfg = config_of(model, smollm2)
    return cfg if size == "full" else small(cfg, SMALL[model])


@pytest.mark.parametrize("model,size", SIZES)
def test_bytes_per_token_match_measured_caches(model, size, smollm2):
    # Between two prompts whose chunks fill whole room steps, tiles and prefill chunks,
    # the bytes added per token are the marginal rate, to the byte.
    cfg = sized(model, size, smollm2)
    n1, n2 = 4096, 8192
    checked = 0
    for name, c in plans(cfg).items():
        if c.error:
            continue
        dtype = cache_dtype(cfg, name)
        held = [run(real_caches(cfg, name), cfg, dtype, chunks(n), n)[1] for n in (n1, n2)]
        measured = (held[1] - held[0]) / (n2 - n1)
        assert c.per_token == pytest.approx(measured, rel=0.02), name
        assert c.per_token == pytest.approx(measured, abs=1e-9), name  # in fact exact
        checked += 1
    assert checked == len(PRESETS) + 3 + (cfg["torch_dtype"] == "float32")
    H, D = kv_shape(cfg)
    full = sum(
        1
        for l in byte_models.model_layers(model_info.lazy_model(cfg, cfg["torch_dtype"]))
        if l.kind == "kv"
    )
    itemsize = 4 if cfg["torch_dtype"] == "float32" else 2
    assert plans(cfg)[f"plain ({cfg['torch_dtype']})"].per_token == 2 * full * H * D * itemsize


# By default every cache and every config once, plain on both the windowed (gemma3) and the
# float32 (smollm2, all-decoding run) config; the other pairs: -m slow.
PEAK_GRID = grid(
    ["plain", "mlx-lm 4-bit", "k4v2_g128", "k4v2_g64", "auto2"],
    CONFIGS,
    ids="-".join,
    covering=[
        ("plain", "gemma3"),
        ("plain", "smollm2"),
        ("mlx-lm 4-bit", "qwen3"),
        ("k4v2_g128", "qwen3"),
        ("k4v2_g64", "smollm2"),
        ("auto2", "gemma3"),
    ],
)


@pytest.mark.parametrize("cache,model", PEAK_GRID)
def test_peak_bytes_are_the_most_any_prompt_length_gives(model, cache, smollm2):
    # Evaluated caches, a few layers, several tiles: over prompts of different lengths
    # (then decoding), no run holds more than the planner says at any point up to n,
    # and for every layer some run holds exactly that.
    cfg = small(config_of(model, smollm2), SMALL[model])
    p = plans(cfg)
    name = f"plain ({cfg['torch_dtype']})" if cache == "plain" else cache
    cp = p[name]
    c = PRESETS.get(cache)
    S, G = (c.sink_size, c.group_size) if c else (128, 128)
    n = S + 6 * G + 40
    # One prompt; a prompt then decoding across one or two tiles; two prompts (a chat's
    # second turn), the second ending on a room step so that the next token adds a step;
    # a short second prompt that finishes a tile, which waits in the tail with the
    # token after it (a tile and a tail step: the most a tail holds).
    prompts = [
        [n],
        [S + 4 * G],
        [S + 5 * G],
        [S + 2 * G, S + 2 * G],
        [n - 257, 256],
        [S + 6 * G - 1, 2],
    ]
    if model == "smollm2":
        prompts.append([1])  # all decoding
    runs = [
        run(real_caches(cfg, name), cfg, cfg["torch_dtype"], prompt, n, evaluate=True)
        for prompt in prompts
    ]
    for peaks, total in runs:
        assert total <= cp.peak(n)
        assert all(m <= model.peak(n) for m, model in zip(peaks, cp.models))
    most = [max(r[0][i] for r in runs) for i in range(len(cp.models))]
    assert most == [m.peak(n) for m in cp.models]


def worst_runs(n, step, S, G):
    """Prompts (chunks of at most `step`) ending at n tokens after which the caches
    hold the most: plain prompt chunks; a last chunk of a whole step (sliding windows
    hold window - 1 + step); a second prompt ending on a room step, then one token
    (a new room step); a prompt, then decoding to a tile boundary - 1 (full tail)."""
    runs = [chunks(n, step), chunks(n - 257, step) + [256]]
    if n > step:
        runs.append(chunks(n - step, step) + [step])
    boundary = S + (n - S + 1) // G * G - 1  # the last count <= n with a full tail
    return [(r, n) for r in runs] + [(chunks(boundary - G + 1, step), boundary)]


@pytest.mark.parametrize("model,size", SIZES)
def test_longest_context_matches_measured_caches(model, size, smollm2):
    # Unevaluated caches: with a KV budget of what the planner says 60K tokens take,
    # measured caches fit at the planner's longest context whatever the prompt, and some
    # prompt makes them exceed the budget 2% further. The prefill step matters only to
    # sliding-window layers: one chunk elsewhere keeps this fast.
    cfg = sized(model, size, smollm2)
    step = 8192 if model == "gemma3" else 10**6
    for name, c in plans(cfg, prefill=step).items():
        if c.error:
            continue
        kv_budget = c.peak(60_000)
        n = byte_models.longest_context(c.peak, c.per_token, kv_budget)
        assert n >= 60_000
        preset = PRESETS.get(name)
        S, G = (preset.sink_size, preset.group_size) if preset else (128, 128)
        dtype = cache_dtype(cfg, name)

        def most(count):
            return max(
                run(real_caches(cfg, name), cfg, dtype, prompt, end)[1]
                for prompt, end in worst_runs(count, step, S, G)
            )

        assert most(n) <= kv_budget, name
        assert most(int(n * 1.02)) > kv_budget, name


# -- the CLI ---------------------------------------------------------------------------------


def test_cli_table_and_json_for_the_default_model(capsys):
    plan.main(["--memory", "24GB"])
    table = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in table and "24.0 GiB" in table
    for name in ["plain (float32)", "plain (float16)", "mlx-lm 8-bit", "mlx-lm 4-bit", *PRESETS]:
        assert f"\n{name} " in table
    plan.main(["--memory", "24GB", "--json", "--context", "128000"])
    out = json.loads(capsys.readouterr().out)
    assert out["budget_bytes"] == 24 * 2**30 and out["context"] == 128000
    assert out["kv_budget_bytes"] == out["budget_bytes"] - out["weights_bytes"] - 2**30
    rows = {r["cache"]: r for r in out["caches"]}
    assert rows["plain (float32)"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    for r in rows.values():
        assert r["fits_context"] == (r["longest_context"] >= 128000)
        assert r["kv_bytes_at_context"] <= out["kv_budget_bytes"] or not r["fits_context"]


def test_cli_context_says_which_fit(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    plan.main(["--model", str(tmp_path), "--memory", "16GB", "--context", "128000", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["weights_source"].startswith("counted from the model's parameters")
    assert out["weights_bytes"] == pytest.approx(
        4.02e9 * 2, rel=0.01
    )  # Qwen3-4B: 4.02B bfloat16 parameters
    fits = {r["cache"]: r["fits_context"] for r in out["caches"]}
    assert not fits["plain (bfloat16)"] and not fits["mlx-lm 8-bit"] and fits["k2v2_g128"]


def test_cli_bad_input(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit, match="cannot read '24 gigs' as a size"):
        plan.main(["--memory", "24 gigs"])
    with pytest.raises(SystemExit, match="has no config.json"):
        plan.main(["--model", str(tmp_path)])
    with pytest.raises(SystemExit, match="--context 0"):
        plan.main(["--context", "0"])
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        SystemExit, match=r"could not read nobody/no-such-model's config.json .* \(no network\?\)"
    ):
        plan.main(["--model", "nobody/no-such-model"])
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    plan.main(["--model", str(tmp_path), "--memory", "8GB"])
    assert "the weights and the allowance alone exceed the budget" in capsys.readouterr().out


def test_parse_bytes():
    assert (
        byte_models.parse_bytes("24GB")
        == byte_models.parse_bytes("24GiB")
        == byte_models.parse_bytes("24g")
        == 24 * 2**30
    )
    assert (
        byte_models.parse_bytes("1.5GB") == 3 * 2**29 and byte_models.parse_bytes("512MB") == 2**29
    )
    assert byte_models.parse_bytes("1000") == 1000


def test_default_budget_is_this_machine():
    budget, source = plan.machine_budget()
    assert budget > 2**28
    assert ("RAM" in source) != mx.metal.is_available()


# -- every architecture of tests/archmodels.py ---------------------------------------------------

ARCH = {**archmodels.FAMILIES, **archmodels.SHAPES}


@pytest.mark.parametrize("family", ARCH)
def test_architectures_planned_from_their_real_caches(family):
    # Through the real (tiny, float32) model: the planner's layers are the caches the model
    # fills; after a prompt and two decode steps no layer holds more than planned; a preset
    # the planner calls not applicable is one whose cache raises on this model.
    from mlx_lm.generate import maybe_quantize_kv_cache

    cfg = ARCH[family]
    model = archmodels.tiny_model(family)
    p = {c.name: c for c in plan.cache_plans(cfg, "float32")}
    layers = byte_models.model_layers(model_info.lazy_model(cfg, "float32"))
    n = 128 + 2 * 128 + 50
    prompt = mx.array(tokens(n - 2, seed=3))[None]
    for name in ("plain (float32)", "mlx-lm 4-bit", "k4v2_g128", "k2v2_g128"):
        caches = real_caches(cfg, name.replace("mlx-lm 4-bit", "plain"))
        try:
            mx.eval(model(prompt, cache=caches))
            if name == "mlx-lm 4-bit":
                maybe_quantize_kv_cache(caches, 0, byte_models.MLX_KV_GROUP_SIZE, 4)
            for t in (5, 6):
                mx.eval(model(mx.array([[t]]), cache=caches))
        except NotImplementedError:
            assert (
                name == "mlx-lm 4-bit"
                and p[name].warning
                and "NotImplementedError" in p[name].warning
            )
            continue
        except (ValueError, TypeError) as e:
            assert p[name].error, (
                f"{name}: the model raised with this cache ({e}) but the planner has numbers"
            )
            continue
        assert not p[name].error, (
            f"{name}: planned as not applicable ({p[name].error}) but the cache works"
        )
        flat = list(byte_models.flat_caches(caches))
        assert len(flat) == len(layers) == len(p[name].models)
        for (c, _), layer, m in zip(flat, layers, p[name].models):
            if name.startswith("plain") and layer.kind != "state":
                assert (c.keys.shape[1], c.keys.shape[3], c.values.shape[3]) == (
                    layer.heads,
                    layer.k_dim,
                    layer.v_dim,
                )
            assert c.nbytes <= m.peak(n), (name, type(c).__name__, layer)


def test_hub_model_reads_config_and_file_sizes_only(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    asked = []

    def download(repo, filename, **kw):
        asked.append(filename)
        return str(tmp_path / filename)

    class File:
        def __init__(self, name, size):
            self.rfilename, self.size = name, size

    class Api:
        def model_info(self, repo, files_metadata=False):
            assert files_metadata
            return type(
                "Info",
                (),
                {
                    "siblings": [
                        File("model-00001-of-00002.safetensors", 3_957_900_840),
                        File("model-00002-of-00002.safetensors", 4_087_036_176),
                        File("consolidated.safetensors", 8_044_936_192),  # not what mlx-lm loads
                        File("config.json", 726),
                    ]
                },
            )()

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    info = model_info.read_model("Qwen/Qwen3-4B")
    assert asked == ["config.json"] and info.config == QWEN3
    assert (
        info.weights_bytes == 3_957_900_840 + 4_087_036_176 and "on the Hub" in info.weights_source
    )

    def gated(repo, filename, **kw):
        e = GatedRepoError.__new__(GatedRepoError)  # its __init__ wants an HTTP response
        Exception.__init__(e, "gated")
        raise e

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", gated)
    with pytest.raises(
        byte_models.PlanError, match="is gated on the Hugging Face Hub: .*`hf auth login`"
    ):
        model_info.read_model("google/gemma-3-270m")


def test_embedded_model_names(capsys):
    # As generate and the server take them: embedded:<key>, or the key alone.
    from kvarn_mlx import loader

    plan.main(["--model", f"embedded:{loader.DEFAULT.key}", "--memory", "24GB", "--json"])
    assert json.loads(capsys.readouterr().out)["model"] == loader.DEFAULT.name
    with pytest.raises(SystemExit, match="no embedded model 'nope'"):
        plan.main(["--model", "embedded:nope"])


# -- quality: --max-kl and --profile ---------------------------------------------------------

PROFILE = ROOT / "benchmarks" / "results" / "profile_smollm2.json"


def test_cli_quotes_measured_kl_only_for_the_model_measured(tmp_path, capsys):
    plan.main(["--memory", "16GB", "--context", "65536", "--max-kl", "0.005", "--json"])
    out = json.loads(capsys.readouterr().out)
    table = json.loads((ROOT / "kvarn_mlx" / "measured_kl.json").read_text())[
        "smollm2-135m-instruct"
    ]["kl"]
    rows = {r["cache"]: r for r in out["caches"]}
    assert rows["plain (float32)"]["kl"] == 0 and rows["plain (float16)"]["kl"] is None
    for name in PRESETS:
        assert rows[name]["kl"] == table[name] and rows[name]["kl_source"] == "measured"
        assert rows[name]["within_max_kl"] == (table[name] <= 0.005)
    within = [r for r in rows.values() if r["within_max_kl"]]
    best = max(within, key=lambda r: r["longest_context"])
    assert out["longest_context_at_max_kl"] == {
        "cache": best["cache"],
        "tokens": best["longest_context"],
    }
    plan.main(["--memory", "16GB", "--max-kl", "0.005"])
    text = capsys.readouterr().out
    assert "\nk8v8_g128 " in text and "\nk2v2_g128 " not in text
    assert f"longest context at mean KL <= 0.005: {best['longest_context']:,} tokens" in text
    # Another model: nothing measured, nothing claimed.
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    plan.main(["--model", str(tmp_path), "--memory", "16GB", "--max-kl", "0.005", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert all(r["kl"] is None and r["within_max_kl"] is None for r in out["caches"])
    assert out["longest_context_at_max_kl"] is None
    plan.main(["--model", str(tmp_path), "--memory", "16GB", "--max-kl", "0.005"])
    text = capsys.readouterr().out
    assert "no cache has a known mean KL <= 0.005" in text and "not measured for this model" in text
    with pytest.raises(SystemExit, match="--max-kl -1.0: give a KL in nats > 0"):
        plan.main(["--max-kl", "-1"])


def test_cli_profile_predicts_and_adds_the_calibrated_mix(tmp_path, capsys):
    from kvarn_mlx import profile

    p = profile.read(PROFILE)
    plan.main(["--memory", "16GB", "--profile", str(PROFILE), "--max-kl", "0.005", "--json"])
    out = json.loads(capsys.readouterr().out)
    rows = {r["cache"]: r for r in out["caches"]}
    auto = sum(e["k"]["4"] + e["v"]["2"] for e in p["layers"])
    assert (
        rows["auto4v2"]["kl"] == pytest.approx(auto) and rows["auto4v2"]["kl_source"] == "predicted"
    )
    assert rows["k4v2_g128"]["kl_source"] == "measured"  # measured with other settings
    a, b = p["text"]["measured_positions"]  # the context a prediction is for
    assert f"positions {a:,}..{b:,} of a {p['text']['tokens']:,}-token text" in out["kl_source"]
    mix = rows["calibrated mix"]
    assert mix["kl"] <= 0.005 and mix["within_max_kl"] and mix["kl"] == out["mix"]["predicted_kl"]
    assert (
        mix["bytes_per_token"] < rows["k4v3_g128"]["bytes_per_token"]
    )  # the cheapest preset within
    assert out["longest_context_at_max_kl"]["cache"] == "calibrated mix"
    # A profile of another model is refused, naming it.
    folder = tiny_model_folder(tmp_path / "tiny")
    with pytest.raises(SystemExit, match="was calibrated on embedded SmolLM2-135M-Instruct"):
        plan.main(["--model", str(folder), "--memory", "16GB", "--profile", str(PROFILE)])
    with pytest.raises(SystemExit, match="--profile: no profile file at"):
        plan.main(["--profile", str(tmp_path / "none.json")])


def test_cli_profile_with_growth_predicts_at_the_context(capsys):
    # profile_smollm2_1024.json holds a growth measurement (python -m kvarn_mlx.calibrate
    # --add-growth): auto4v2's and auto2's mean KL with every layer quantized, to 4,096 tokens.
    from kvarn_mlx import mix as mixes
    from kvarn_mlx import profile

    path = ROOT / "benchmarks" / "results" / "profile_smollm2_1024.json"
    p = profile.read(path)  # calibrated on 1,024 tokens
    growth = p["growth"]["presets"]
    for context, max_kl in ((4096, 0.005), (65536, 0.02)):
        args = ["--memory", "16GB", "--profile", str(path), "--context", str(context)]
        plan.main([*args, "--max-kl", str(max_kl), "--json"])
        out = json.loads(capsys.readouterr().out)
        rows = {r["cache"]: r for r in out["caches"]}
        # the presets measured for the growth: their layers' sum times how much their KL
        # grew from 1,024 to 4,096 tokens (and beyond, at least that: it is not extrapolated
        # to fall)
        for name in ("auto4v2", "auto2"):
            at_4k = mixes.preset_kl(p, PRESETS[name]) * growth[name]["4096"] / growth[name]["1024"]
            assert rows[name]["kl"] >= at_4k * (1 - 1e-9)
            if context == 4096:
                assert rows[name]["kl"] == pytest.approx(at_4k)
        assert f"at {context:,} tokens" in out["kl_source"]
        assert ("extrapolated beyond" in out["kl_source"]) == (context > 4096)
        mix = rows["calibrated mix"]  # the fewest bytes predicting max_kl at this context
        assert mix["kl"] <= max_kl and mix["kl"] >= out["mix"]["predicted_kl"]
    for context in (4096, 16384):  # SmolLM2 takes 8,192 tokens: past them, KLs are flagged
        plan.main(["--memory", "16GB", "--profile", str(path), "--context", str(context)])
        text = capsys.readouterr().out
        assert ("past the model's context" in text) == (context > 8192)
    plan.main(["--memory", "16GB", "--profile", str(path), "--json"])
    out = json.loads(capsys.readouterr().out)  # no context: the layers' sum, and how to scale it
    assert "give --context" in out["kl_source"]
    assert {r["cache"]: r for r in out["caches"]}["calibrated mix"]["kl"] == pytest.approx(
        out["mix"]["predicted_kl"]
    )


@pytest.mark.default_tail
def test_cli_kv_tail_tokens_sets_the_presets_tail(capsys):
    def kv_at_4k(*flag):
        plan.main(["--memory", "16GB", "--context", "4096", "--json", *flag])
        out = json.loads(capsys.readouterr().out)
        rows = {r["cache"]: r for r in out["caches"]}
        return out["kv_tail_tokens"], rows["auto4v2"]["kv_bytes_at_context"], rows["k4v2_g64"]

    default, none, long = (
        kv_at_4k(),
        kv_at_4k("--kv-tail-tokens", "0"),
        kv_at_4k("--kv-tail-tokens", "1024"),
    )
    assert (default[0], none[0], long[0]) == (None, 0, 1024)
    # The default: 128 float32 tokens more than none, in 30 layers of 3 kv heads of dim 64.
    assert default[1] - none[1] == 128 * 30 * 3 * 64 * 2 * 4
    assert long[1] > default[1]
    assert default[2] == none[2]  # 64-token tiles keep no default tail
    with pytest.raises(SystemExit, match="--kv-tail-tokens: tail_tokens=100 must be 0 or"):
        plan.main(["--kv-tail-tokens", "100"])
