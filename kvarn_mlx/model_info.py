"""What the planner reads about a model without loading its weights: config.json and
the weight files' sizes, from a local folder, an embedded model or the Hugging Face
Hub, and the model's mlx-lm class built lazily from the config."""

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .byte_models import DTYPES, PlanError


@dataclass
class ModelInfo:
    name: str
    config: dict
    weights_bytes: int | None  # None: count the model's parameters
    weights_source: str
    embedded: str | None = None  # the catalogue key of an embedded model


def _weight_files(names):
    """The .safetensors files mlx-lm loads (model*.safetensors), or all of them."""
    st = [n for n in names if n.endswith(".safetensors")]
    return [n for n in st if Path(n).name.startswith("model")] or st


def read_folder(path, name=None):
    """A local folder with config.json; without .safetensors files the weights'
    bytes are counted from the model's parameters."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise PlanError(
            f"{path} has no config.json; pass a model folder, a Hugging Face repo id, or omit "
            "--model"
        )
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise PlanError(f"{path / 'config.json'} is not valid JSON: {e}") from e
    files = _weight_files([p.name for p in path.iterdir()])
    if not files:
        return ModelInfo(
            name or str(path),
            config,
            None,
            "counted from the model's parameters: no .safetensors files",
        )
    size = sum((path / f).stat().st_size for f in files)
    return ModelInfo(
        name or str(path), config, size, f"{len(files)} .safetensors file(s) in {path}"
    )


def read_hub(repo):
    """config.json and the weight files' sizes of a Hugging Face repo (not the weights);
    falls back to a copy in the local Hugging Face cache when the Hub cannot be reached."""
    from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        config = json.loads(Path(hf_hub_download(repo, "config.json")).read_text())
        info = HfApi().model_info(repo, files_metadata=True)
    except GatedRepoError as e:
        raise PlanError(
            f"{repo} is gated on the Hugging Face Hub: accept its terms on the website and log in "
            "with `hf auth login`"
        ) from e
    except RepositoryNotFoundError as e:
        raise PlanError(
            f"no model {repo} on the Hugging Face Hub and no local folder {repo}"
        ) from e
    except (
        Exception
    ) as e:  # offline mode, DNS, connection and HTTP errors of any hub client version
        cached = try_to_load_from_cache(repo, "config.json")
        if isinstance(cached, str):
            try:
                return read_folder(Path(cached).parent, repo)
            except PlanError:
                pass
        raise PlanError(
            f"could not read {repo}'s config.json and file sizes from the Hugging Face Hub (no "
            f"network?) [{type(e).__name__}: {e}], and no downloaded copy is cached. Pass a local "
            "model folder that has config.json, or omit --model to plan for the embedded default "
            "model (HF_HUB_OFFLINE=1 skips the Hub's retries)"
        ) from e
    sizes = {s.rfilename: s.size for s in info.siblings}
    files = _weight_files(list(sizes))
    if not files or any(sizes[f] is None for f in files):
        raise PlanError(
            f"{repo} lists no .safetensors weights with sizes on the Hugging Face Hub (mlx-lm "
            "loads only .safetensors)"
        )
    return ModelInfo(
        repo, config, sum(sizes[f] for f in files), f"{len(files)} .safetensors file(s) on the Hub"
    )


def read_model(model=None):
    """ModelInfo for None (the embedded default), an embedded model's name
    (embedded:<key>), a local folder or a Hub repo id."""
    if model is None:
        from .embedded.catalogue import DEFAULT
        from .loader import DEFAULT_NAME, default_model_path

        info = read_folder(default_model_path(), DEFAULT_NAME)
        info.embedded = DEFAULT.key
        return info
    if Path(model).expanduser().exists():
        return read_folder(model)
    from . import loader

    try:
        path = loader.embedded_path(model)  # converted once, as generate and the server do
    except loader.ModelLoadError as e:
        raise PlanError(str(e)) from None
    if path is not None:
        from .embedded.catalogue import embedded_model

        info = read_folder(path, path.name)
        info.embedded = embedded_model(model).key
        return info
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", model):
        raise PlanError(
            f"no such model folder: {model}. Pass a folder with config.json, a Hugging Face repo "
            "id (owner/name), or omit --model for the embedded default model"
        )
    return read_hub(model)


def config_dtype(config):
    """The dtype the model computes in (and so its KV cache's), from config.json."""
    for c in (config, config.get("text_config") or {}):
        name = c.get("torch_dtype") or c.get("dtype")
        if isinstance(name, str) and name in DTYPES:
            return name
    return None


def lazy_model(config, dtype):
    """The model's mlx-lm class built from its config in `dtype`. Parameters are lazy
    arrays: their shapes exist, nothing is computed or allocated."""
    from .mlx_lm_private import model_classes

    try:
        model_cls, args_cls = model_classes(config)
        model = model_cls(args_cls.from_dict(config))
    except Exception as e:
        raise PlanError(
            f"mlx-lm cannot build model type {config.get('model_type')!r} from this config.json: "
            f"{e}"
        ) from e
    model.set_dtype(DTYPES[dtype])
    return model


def parameter_bytes(model, config):
    """Bytes of the model's parameters (quantized as config.json's "quantization" says)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    q = config.get("quantization")
    if isinstance(q, dict) and "bits" in q:
        nn.quantize(
            model, group_size=q.get("group_size", 64), bits=q["bits"], mode=q.get("mode", "affine")
        )
    params = tree_flatten(model.parameters())
    if config.get("tie_word_embeddings", True):
        # Some classes keep an lm_head until load() sees no lm_head weights (a tied head).
        params = [(k, x) for k, x in params if "lm_head" not in k.split(".")]
    return sum(x.nbytes for _, x in params)
