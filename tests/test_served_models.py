"""kvarn_mlx.server.served_models: the names a server answers to and its model
list, with and without a Hugging Face cache folder (one made here, in the
layout huggingface_hub reads)."""

import pytest
from huggingface_hub import constants

from kvarn_mlx import loader
from kvarn_mlx.guard import Refused
from kvarn_mlx.server import served_models as sm

REV = "0123456789abcdef0123456789abcdef01234567"


def hub_repo(cache, repo_id, files):
    """A model repo in the cache's layout: blobs, a snapshot of links to them, refs/main."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(REV)
    snapshot = root / "snapshots" / REV
    snapshot.mkdir(parents=True)
    for i, name in enumerate(files):
        blob = root / "blobs" / f"{i:040x}"
        blob.parent.mkdir(exist_ok=True)
        blob.write_text("{}")
        (snapshot / name).symlink_to(blob)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_no_cache_folder_lists_the_served_model_only(hub):
    assert not hub.exists()
    listed = sm.model_list("smollm2-135m-instruct", 1000)
    assert listed == {
        "object": "list",
        "data": [
            {"id": "smollm2-135m-instruct", "object": "model", "created": 1000, "owned_by": "local"}
        ],
    }
    with pytest.raises(Refused) as e:
        sm.find_model("mlx-community/none", "smollm2-135m-instruct", 1000)
    assert e.value.status == 404 and e.value.code == "model_not_found"


def test_the_cache_models_are_listed_and_loadable(hub):
    hub_repo(
        hub,
        "mlx-community/Tiny-4bit",
        ["config.json", "tokenizer_config.json", "model.safetensors"],
    )
    hub_repo(
        hub, "someone/not-mlx", ["config.json", "pytorch_model.bin"]
    )  # no safetensors, no tokenizer
    ids = [m["id"] for m in sm.model_list("served", 1000)["data"]]
    assert ids == ["served", "mlx-community/Tiny-4bit"]
    assert sm.find_model("mlx-community/Tiny-4bit", "served", 1000)["owned_by"] == "mlx-community"
    assert (
        sm.model_for("mlx-community/Tiny-4bit", "served", {"served", "default_model"})
        == "mlx-community/Tiny-4bit"
    )
    with pytest.raises(Refused):
        sm.model_for("mlx-community/Other", "served", {"served", "default_model"})


def test_names_of_the_served_model(hub, tmp_path):
    m = loader.DEFAULT
    names = sm.names(None, "/models/x")
    assert {m.key, m.name, "embedded:" + m.key, "default_model", "/models/x"} <= names
    assert sm.served_id(None) == sm.served_id(m.name) == m.key
    folder = tmp_path / "model"
    (folder).mkdir()
    (folder / "config.json").write_text("{}")
    assert sm.served_id(str(folder)) == str(folder)
    assert sm.model_for(None, str(folder), sm.names(str(folder))) == "default_model"
    assert (
        sm.model_for(str(folder.resolve()), str(folder), sm.names(str(folder))) == "default_model"
    )
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    assert sm.model_for(str(other), str(folder), sm.names(str(folder))) == str(
        other
    )  # a folder: loadable
    with pytest.raises(Refused, match="serves"):
        sm.model_for("default", str(folder), sm.names(str(folder)))
