"""Which model names a server answers to, and its /v1/models list.

The server serves one model: the embedded default (listed by its key,
smollm2-135m-instruct) or --model's. A request naming it (by that id, by any
name --model accepts for it, or mlx-lm's "default_model"), or naming none, is
served by it. Another name is passed on to mlx-lm (which loads it in place of
the served one) only when it can be loaded here without a download: a model
folder, or a repo in the Hugging Face cache. Anything else is a 404.

mlx-lm's own list scans the Hugging Face cache and raises when that folder
does not exist; this one lists the served model first, then the cache's
models when the folder exists, and logs one line instead of failing.
"""

import logging
import os
import re
from pathlib import Path

from .. import loader
from ..guard import Refused

DEFAULT_MODEL = "default_model"  # mlx-lm's name for --model
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _embedded(spec):
    """The embedded model --model `spec` names (None: the default), or None."""
    if spec is None:
        return loader.DEFAULT
    try:
        return loader.embedded_model(spec)
    except loader.ModelLoadError:
        return None


def served_id(spec):
    """The id /v1/models lists for --model `spec` (None: the embedded default)."""
    m = _embedded(spec)
    return m.key if m is not None else str(spec)


def names(spec, path=None):
    """Every name a request may give the served model: its id, "default_model",
    --model as given and, for an embedded model, its key, name and "embedded:key";
    path: the folder mlx-lm loads it from."""
    out = {DEFAULT_MODEL, served_id(spec)}
    if (m := _embedded(spec)) is not None:
        out |= {m.key, m.name, loader.EMBEDDED_PREFIX + m.key}
    for p in (spec, path):
        if p is not None:
            out.add(str(p))
            if Path(p).expanduser().exists():
                out.add(str(Path(p).expanduser().resolve()))
    return out


def model_for(requested, served, served_names):
    """The name to hand mlx-lm for the request's "model": "default_model" for the
    served model (listed as `served`; any of served_names, or none named), the
    name itself when loadable() finds it, else Refused (404, model_not_found)."""
    if requested is None or requested in served_names:
        return DEFAULT_MODEL
    if loadable(requested):
        return requested
    raise Refused(
        f"the model {requested!r} does not exist here: this server serves {served!r} (leave "
        '"model" out to use it; GET /v1/models lists the models it can load)',
        code="model_not_found",
        status=404,
        param="model",
    )


def loadable(name):
    """True if `name` is a model folder (with a config.json) or a Hugging Face
    repo whose config.json is in the local cache: mlx-lm loads it without a download."""
    if not isinstance(name, str) or not name:
        return False
    if (Path(name).expanduser() / "config.json").is_file():
        return True
    if not _REPO_ID.match(name):
        return False
    try:
        from huggingface_hub import constants, try_to_load_from_cache

        return isinstance(
            try_to_load_from_cache(name, "config.json", cache_dir=constants.HF_HUB_CACHE), str
        )
    except Exception:  # noqa: BLE001 (a cache it cannot read holds nothing loadable)
        return False


def cached_models():
    """(repo id, last modified) of the mlx-lm models in the Hugging Face cache:
    repos with a config.json, a tokenizer_config.json and safetensors weights.
    None listed when the cache folder does not exist or cannot be read."""
    from huggingface_hub import constants, scan_cache_dir

    cache = (
        constants.HF_HUB_CACHE
    )  # $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub
    if not os.path.isdir(cache):
        return []
    try:
        repos = scan_cache_dir(cache).repos
    except Exception as e:  # noqa: BLE001 (one log line, not a failed list)
        logging.warning(f"/v1/models: cannot read the Hugging Face cache {cache}: {e}")
        return []
    out = []
    for repo in repos:
        files = {f.file_name for rev in repo.revisions for f in rev.files}
        if (
            repo.repo_type == "model"
            and {"config.json", "tokenizer_config.json"} <= files
            and any(f.endswith(".safetensors") for f in files)
        ):
            out.append((repo.repo_id, int(repo.last_modified)))
    return sorted(out)


def model_object(model_id, created):
    """One entry of /v1/models, in OpenAI's format."""
    owner = model_id.split("/")[0] if _REPO_ID.match(model_id) else "local"
    return {"id": model_id, "object": "model", "created": int(created), "owned_by": owner}


def model_list(served, created):
    """/v1/models: the served model's id first (created: when the server
    started), then the Hugging Face cache's models."""
    data = [model_object(served, created)]
    data += [model_object(repo, when) for repo, when in cached_models() if repo != served]
    return {"object": "list", "data": data}


def find_model(model_id, served, created):
    """/v1/models/{id}: its entry, or Refused (404) for a model this server
    cannot serve."""
    for m in model_list(served, created)["data"]:
        if m["id"] == model_id:
            return m
    if loadable(model_id):
        return model_object(model_id, created)
    raise Refused(
        f"the model {model_id!r} does not exist here: this server serves {served!r}",
        code="model_not_found",
        status=404,
        param="model",
    )
