"""python -m kvarn_mlx.server's --model: embedded names resolve to their
folder as in generate, and a model that cannot be loaded stops the server with
its error instead of a server answering 503 for ever."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvarn_mlx import loader
from kvarn_mlx.server import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def folders(monkeypatch):
    monkeypatch.setattr(loader, "converted_folder", lambda m: Path("/models") / m.key)
    return lambda key: str(Path("/models") / key)


def test_embedded_names_become_folders(folders, tmp_path):
    key = loader.DEFAULT.key
    assert cli.resolve_model(["--port", "1"]) == ["--port", "1", "--model", folders(key)]
    assert cli.resolve_model(["--model", f"embedded:{key}", "--port", "1"]) == [
        "--model",
        folders(key),
        "--port",
        "1",
    ]
    assert cli.resolve_model([f"--model={key}"]) == ["--model", folders(key)]
    for spec in (
        str(tmp_path),
        "mlx-community/Qwen3-4B-4bit",
    ):  # a folder, a hub id: mlx-lm's to load
        assert cli.resolve_model(["--model", spec]) == ["--model", spec]


def test_unknown_embedded_name_is_an_error(folders):
    with pytest.raises(SystemExit, match="no embedded model 'nope'"):
        cli.resolve_model(["--model", "embedded:nope"])


def test_a_model_that_cannot_load_stops_the_server(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(
        [sys.executable, "-m", "kvarn_mlx.server", "--model", str(missing), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 1
    assert "generation thread stopped" in proc.stderr and str(missing) in proc.stderr


@pytest.mark.parametrize("flags", [["--kv-tail-tokens", "100"], ["--kv-tail-tokens", "-64"]])
def test_bad_tail_stops_before_loading(flags, capsys):
    # KVarNConfig's own check, named by the flag, before any model is loaded.
    with pytest.raises(SystemExit):
        cli.main(["--kv-preset", "k4v2_g64", *flags])
    err = capsys.readouterr().err
    assert "--kv-tail-tokens: tail_tokens=" in err and "multiple of the tile size" in err


def test_chat_cli_bad_tail_stops_before_loading():
    from apps.chat.__main__ import main

    with pytest.raises(SystemExit, match="--kv-tail-tokens: tail_tokens=130 must be 0 or a"):
        main(["--cli", "--kv-tail-tokens", "130"])
