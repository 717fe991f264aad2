"""kvarn_mlx.prompt_cache: naming, atomic and safe writes, model identity on load."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import save_prompt_cache

from kvarn_mlx import make_cache, prompt_cache
from kvarn_mlx.prompt_cache import (
    PromptCacheError,
    cache_path,
    check_writable,
    load,
    model_identity,
    save,
)
from models import tiny_model, tokenizer, tokens


def _filled(name="llama64", seed=0, n=150):
    model = tiny_model(name, seed=seed)
    cache = make_cache(model, "k4v2_g64", sink=0)
    model(mx.array([tokens(n)]), cache=cache)
    return model, cache


def _info(model, spec="tiny"):
    return model_identity(None if spec is None else spec, model, tokenizer())


def test_name_without_extension_is_the_file_written_and_read(tmp_path):
    model, cache = _filled()
    info = _info(model)
    written = save(tmp_path / "chat", cache, info)
    assert written == tmp_path / "chat.safetensors" == cache_path(tmp_path / "chat")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.safetensors"]  # no temp file left
    loaded, meta = load(tmp_path / "chat", info)
    assert meta["model"] == "tiny" and meta["format"] == prompt_cache.FORMAT
    assert loaded[0].offset == 150 and loaded[0].n_tiles == cache[0].n_tiles
    assert mx.array_equal(loaded[0].tiles.valid(2).k_words, cache[0].tiles.valid(2).k_words)


def test_never_overwrites_a_file_of_another_kind(tmp_path):
    model, cache = _filled()
    weights = tmp_path / "weights.safetensors"
    mx.save_safetensors(str(weights), {"w": mx.ones((4,))})
    before = weights.read_bytes()
    with pytest.raises(
        PromptCacheError, match="not a kvarn-mlx prompt-cache file; refusing to overwrite"
    ):
        save(tmp_path / "weights", cache, _info(model))
    assert weights.read_bytes() == before
    # an explicit request overwrites it
    save(tmp_path / "weights", cache, _info(model), overwrite=True)
    assert prompt_cache.is_prompt_cache(weights)
    # a cache of this format is replaced without asking
    save(weights, cache, _info(model))


def test_plain_mlx_lm_cache_is_not_taken_for_ours(tmp_path):
    model, cache = _filled()
    save_prompt_cache(str(tmp_path / "mlx.safetensors"), cache, {"model": "x"})
    assert not prompt_cache.is_prompt_cache(tmp_path / "mlx.safetensors")
    with pytest.raises(PromptCacheError, match="not a kvarn-mlx prompt-cache file"):
        load(tmp_path / "mlx.safetensors", _info(model))


def test_missing_folder_or_folder_that_is_a_file_fails_up_front(tmp_path):
    with pytest.raises(PromptCacheError, match="does not exist; create the folder"):
        check_writable(tmp_path / "nope" / "c")
    (tmp_path / "f").write_text("x")
    with pytest.raises(PromptCacheError, match="is not a folder"):
        check_writable(tmp_path / "f" / "c")
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(PromptCacheError, match="it is a folder"):
        check_writable(tmp_path / "d")


def test_unwritable_folder(tmp_path, monkeypatch):
    # root may write anywhere; make the probe fail as it does for a read-only folder
    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(prompt_cache.tempfile, "mkstemp", denied)
    with pytest.raises(PromptCacheError, match="is not writable .*Permission denied"):
        check_writable(tmp_path / "c")


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    model, cache = _filled()
    path = save(tmp_path / "c", cache, _info(model))
    before = path.read_bytes()

    def crash(file_name, *a, **k):
        with open(file_name, "wb") as f:
            f.write(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(prompt_cache, "save_prompt_cache", crash)
    with pytest.raises(PromptCacheError, match="could not save .*disk full"):
        save(path, cache, _info(model))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


def test_interrupt_during_write_keeps_the_old_file(tmp_path, monkeypatch):
    model, cache = _filled()
    path = save(tmp_path / "c", cache, _info(model))
    before = path.read_bytes()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(prompt_cache, "save_prompt_cache", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(path, cache, _info(model))
    assert path.read_bytes() == before and len(list(tmp_path.iterdir())) == 1


def test_same_shapes_other_weights_is_refused_naming_both(tmp_path):
    a_model, cache = _filled(seed=0)
    b_model = tiny_model("llama64", seed=1)  # same config, other weights
    a_dir, b_dir = tmp_path / "model-a", tmp_path / "model-b"
    for d, m in ((a_dir, a_model), (b_dir, b_model)):
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama"}')
        m.save_weights(str(d / "model.safetensors"))
    a, b = model_identity(str(a_dir), a_model), model_identity(str(b_dir), b_model)
    assert a["model_hash"] != b["model_hash"]
    path = save(tmp_path / "c", cache, a)
    with pytest.raises(PromptCacheError, match=f"saved with model {a_dir} .*loaded now, {b_dir}"):
        load(path, b)
    load(path, a)  # the right model still loads it


def test_other_kv_heads_is_refused(tmp_path):
    model, cache = _filled("llama64")  # 2 kv heads
    other = tiny_model("llama128")  # 1 kv head
    path = save(tmp_path / "c", cache, _info(model))
    with pytest.raises(
        PromptCacheError, match=r"tiny \(2 layers, 2 kv heads\).*tiny \(2 layers, 1 kv heads\)"
    ):
        load(path, _info(other))
    # same identity claimed (e.g. a hash collision or a hand-edited file): the shapes still catch it
    with pytest.raises(PromptCacheError, match="holds 2 kv heads per layer but tiny has 1"):
        load(path, {**_info(other), "model_hash": _info(model)["model_hash"]})


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "header"])
def test_damaged_file_is_one_clear_error(tmp_path, damage):
    model, cache = _filled()
    path = save(tmp_path / "c", cache, _info(model))
    data = path.read_bytes()
    path.write_bytes(
        {
            "truncate": data[: len(data) // 2],
            "garbage": b"not a safetensors file",
            "empty": b"",
            "header": data[:8] + b"[[" + data[10:],
        }[damage]
    )
    with pytest.raises(PromptCacheError, match="truncated|corrupt|not a safetensors"):
        load(path, _info(model))


def test_kv_settings_recorded(tmp_path):
    model, cache = _filled()
    _, meta = load(save(tmp_path / "c", cache, _info(model)), _info(model))
    assert '"class": "KVarNCache"' in meta["kv_settings"] and '"k_bits": 4' in meta["kv_settings"]
    assert (
        '"sink": 0' in meta["kv_settings"]
        and meta["model_layers"] == "2"
        and meta["model_kv_heads"] == "2"
    )
