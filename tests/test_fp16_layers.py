"""Layers kept in full precision: make_cache(model, preset, fp16_layers=[0, -1])."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from kvarn_mlx import make_cache
from kvarn_mlx.cache import KVarNCache
from models import tiny_model, tokens


def kinds(caches):
    return [type(c).__name__ for c in caches]


def test_chosen_layers_stay_plain():
    model = tiny_model("llama64")  # 2 layers
    assert kinds(make_cache(model, "k4v2_g64", fp16_layers=[0])) == ["KVCache", "KVarNCache"]
    assert kinds(make_cache(model, "k4v2_g64", fp16_layers=[-1])) == ["KVarNCache", "KVCache"]
    assert kinds(make_cache(model, "k4v2_g64", fp16_layers=(0, -1))) == ["KVCache", "KVCache"]
    # With per-layer presets too; the caller's list is left as it was.
    presets = ["k8v8_g128", "k3v3_g128"]
    caches = make_cache(model, presets, fp16_layers=[1])
    assert kinds(caches) == ["KVarNCache", "KVCache"] and caches[0].config.k_bits == 8
    assert presets == ["k8v8_g128", "k3v3_g128"]


def test_negative_indices_count_model_layers():
    # Gemma-3: layers 0 and 2 slide (left as they are), 1 and 3 are global.
    model = tiny_model("gemma3")
    caches = make_cache(model, "k4v4_g128", fp16_layers=[-1])
    assert kinds(caches) == ["RotatingKVCache", "KVarNCache", "RotatingKVCache", "KVCache"]
    assert isinstance(caches[0], RotatingKVCache) and type(caches[3]) is KVCache


@pytest.mark.parametrize("bad", [2, -3, 10])
def test_a_layer_that_does_not_exist_is_a_clear_error(bad):
    with pytest.raises(
        ValueError, match=rf"fp16 layer {bad} does not exist: the model has 2 layers"
    ):
        make_cache(tiny_model("llama64"), "k4v2_g64", fp16_layers=[bad])


def test_full_precision_layers_attend_like_the_plain_cache():
    """Every layer kept plain: the logits are the plain cache's, bit for bit; one layer
    kept plain: the rest quantized as before."""
    model = tiny_model("llama64")
    prompt = mx.array(tokens(300, seed=2))[None]
    plain = model(prompt, cache=make_prompt_cache(model))
    both = model(prompt, cache=make_cache(model, "k2v2_g128", fp16_layers=[0, 1]))
    assert np.array_equal(np.array(plain), np.array(both))
    caches = make_cache(model, "k2v2_g128", sink=0, fp16_layers=[0])
    mx.eval(model(prompt, cache=caches))
    assert (
        type(caches[0]) is KVCache and isinstance(caches[1], KVarNCache) and caches[1].n_tiles == 2
    )


# python -m kvarn_mlx.generate --kv-fp16-layers ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from model_folder import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("models") / "tiny")


def _main(argv):
    from kvarn_mlx import generate

    return generate.main(["--max-tokens", "3", "--prompt", "hi", *argv])


@pytest.mark.parametrize("value", ["a,b", "0;1", "", "1.5"])
def test_generate_bad_layer_list_is_one_line_before_loading(value, monkeypatch):
    monkeypatch.setattr(
        "kvarn_mlx.loader.load", lambda *a, **k: pytest.fail("loaded before checking flags")
    )
    with pytest.raises(SystemExit) as e:
        _main(["--kv-fp16-layers", value])
    assert str(e.value.code).startswith(f"error: --kv-fp16-layers {value!r}: use layer indices")


def test_generate_keeps_the_layers_plain(tiny_folder, capsys, monkeypatch):
    from kvarn_mlx import generate

    made = []
    real = generate.make_cache
    monkeypatch.setattr(
        generate, "make_cache", lambda *a, **k: made.append(real(*a, **k)) or made[-1]
    )
    _main(["--model", str(tiny_folder), "--kv-preset", "k3v5_g64", "--kv-fp16-layers", "-1"])
    assert "KV cache: k3v5_g64, layers -1 plain" in capsys.readouterr().out
    assert kinds(made[0]) == ["KVarNCache", "KVCache"] and made[0][0].config.v_bits == 5
    with pytest.raises(SystemExit) as e:
        _main(["--model", str(tiny_folder), "--kv-fp16-layers", "0,2"])
    assert e.value.code.startswith(
        "error: --kv-fp16-layers 0,2: fp16 layer 2 does not exist: the model has 2 layers"
    )
