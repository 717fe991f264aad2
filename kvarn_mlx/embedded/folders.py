"""The converted MLX folders of the embedded models under $KVARN_MLX_HOME
(default ~/.cache/kvarn_mlx): made once, renamed into place whole, redone when
the GGUF or the converter changes (kvarn_source.json records both). One process
converts a model at a time (a lock file beside it); the others wait and use its
folder."""

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

from . import convert, fetch


def home() -> Path:
    return Path(os.environ.get("KVARN_MLX_HOME", "~/.cache/kvarn_mlx")).expanduser()


def converted_folder(model) -> Path:
    """The converted MLX folder of an EmbeddedModel, converting once."""
    root = home()
    dest = root / model.name
    if _is_current(dest, model):
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{model.name}.lock"):
        if _is_current(dest, model):  # another process converted it meanwhile
            return dest
        _convert(model, root, dest)
    return dest


@contextlib.contextmanager
def _locked(path):
    """Hold an exclusive lock on the file `path` (two processes starting on a new
    machine would otherwise fetch into the same wheel files and replace each
    other's folder under a reader)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert(model, root, dest):
    with tempfile.TemporaryDirectory(prefix=".extract.", dir=root) as work:
        gguf_path = fetch.assemble_gguf(model, root, Path(work))
        # Convert into a temp dir and rename: an interrupted run never leaves
        # a half folder behind under the final name.
        tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}.", dir=root))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            convert.convert(gguf_path, tmp, dtype="float32")
            (tmp / "kvarn_source.json").write_text(
                json.dumps(
                    {
                        "gguf": [c.member for c in model.chunks],
                        "gguf_sha256": model.sha256,
                        "converter_version": convert.CONVERTER_VERSION,
                        "dtype": "float32",
                    },
                    indent=2,
                )
            )
            _move_into_place(tmp, dest, model)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _is_current(dest, model):
    """Whether `dest` holds this model's GGUF converted by this converter."""
    try:
        src = json.loads((dest / "kvarn_source.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        src.get("gguf_sha256") == model.sha256
        and src.get("converter_version") == convert.CONVERTER_VERSION
        and (dest / "config.json").is_file()
        and (dest / "model.safetensors").is_file()
    )


def _move_into_place(tmp, dest, model):
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old.{os.getpid()}")
        os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    except OSError:
        # Another process finished the same conversion first: keep theirs.
        if not _is_current(dest, model):
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
