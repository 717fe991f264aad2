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
    for spec in (None, f"embedded:{key}", key):  # None: no --model, the embedded default
        assert cli.resolve_model(spec) == folders(key)
    for spec in (str(tmp_path), "mlx-community/Qwen3-4B-4bit"):  # a folder, a hub id: mlx-lm's
        assert cli.resolve_model(spec) == spec


def test_mlx_lm_gets_the_folder_and_v1_models_the_name_as_given(folders, monkeypatch):
    key = loader.DEFAULT.key
    seen = []
    monkeypatch.setattr(cli, "install", lambda ours, handler: seen.append(ours.model))
    monkeypatch.setattr(cli.mlx_server, "main", lambda: seen.append(sys.argv[1:]))
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main replaces it
    for argv, given in (
        (["--port", "1"], None),
        ([f"--model={key}", "--port", "1"], key),
        (["--model", f"embedded:{key}", "--port", "1"], f"embedded:{key}"),
    ):
        seen.clear()
        cli.main(argv)
        model, mlx_argv = seen
        assert model == given and mlx_argv.count("--model") == 1, (argv, seen)
        i = mlx_argv.index("--model")
        assert mlx_argv[i + 1] == folders(key) and mlx_argv[:2] == ["--port", "1"], mlx_argv


def test_unknown_embedded_name_is_an_error(folders):
    with pytest.raises(SystemExit, match="no embedded model 'nope'"):
        cli.resolve_model("embedded:nope")


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
