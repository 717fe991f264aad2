"""The wheel built from the repository: one top-level package (kvarn_mlx, with
the chat app as kvarn_mlx.chat and the Metal sources as kvarn_mlx.metal), the
console scripts, and (slow) an install into a fresh venv whose commands run
from another folder."""

import functools
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "kvarn-server": "kvarn_mlx.server:main",
    "kvarn-generate": "kvarn_mlx.generate:main",
    "kvarn-chat": "kvarn_mlx.chat.__main__:main",
}


def _tracked_copy(dest):
    """The repository's tracked files (a build writes into its source folder)."""
    if shutil.which("git") and (ROOT / ".git").exists():
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        for rel in filter(None, out.decode().split("\0")):
            if (ROOT / rel).is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, dest / rel)
    else:
        shutil.copytree(
            ROOT,
            dest,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"),
        )
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = _tracked_copy(tmp / "src")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (path,) = (tmp / "dist").glob("kvarn_mlx-*.whl")
    return path


def test_the_wheel_holds_only_kvarn_mlx(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"kvarn_mlx"}, sorted(top)
    for f in (
        "kvarn_mlx/chat/__main__.py",
        "kvarn_mlx/chat/static/index.html",
        "kvarn_mlx/metal/quantize_tiles.metal",
        "kvarn_mlx/server/hooks.py",
        "kvarn_mlx/server/__main__.py",
    ):
        assert f in names, f
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    for script, target in SCRIPTS.items():
        assert f"{script} = {target}" in text, text


@pytest.mark.slow
def test_the_wheel_installs_and_its_commands_run_from_any_folder(wheel, tmp_path):
    """A fresh venv (dependencies from the registry or pip's cache): the commands
    run from a folder that holds no checkout, and only kvarn_mlx is installed
    besides the dependencies."""
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }  # nothing of the checkout
    run = functools.partial(
        subprocess.run, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=1200
    )
    run([sys.executable, "-m", "venv", str(venv)], check=True)
    bin_dir = venv / ("Scripts" if sys.platform == "win32" else "bin")
    run([str(bin_dir / "python"), "-m", "pip", "install", "-q", str(wheel)], check=True)
    for script, flag in (
        ("kvarn-server", "--kv-preset"),
        ("kvarn-generate", "--kv-preset"),
        ("kvarn-chat", "--save-dir"),
    ):
        r = run([str(bin_dir / script), "--help"])
        assert r.returncode == 0 and flag in r.stdout, (script, r.stdout[-2000:], r.stderr[-2000:])
    record = run(
        [
            str(bin_dir / "python"),
            "-c",
            "import importlib.metadata as m; "
            "print(m.distribution('kvarn-mlx').read_text('RECORD'))",
        ],
        check=True,
    ).stdout
    top = {line.split("/")[0] for line in record.splitlines() if line and not line.startswith("..")}
    assert {t for t in top if not t.endswith(".dist-info")} == {"kvarn_mlx"}, sorted(top)
    r = run([str(bin_dir / "python"), "-c", "import apps"])
    assert r.returncode != 0  # no generic top-level package installed
