"""Prompt-cache files: mlx-lm's format, plus the model's identity and the KV
settings in the metadata, written atomically.

    path = cache_path(name)                 # mlx-lm's rule: ".safetensors" added when missing
    check_writable(path)                    # before the model runs
    info = model_identity(model_spec, model, tokenizer)
    save(path, cache, info, {"tokens": ...})
    cache, metadata = load(path, info)      # refuses a file made with another model

Every failure is a PromptCacheError whose message names the problem and the fix.
"""

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from .atomic_json import check_target

FORMAT = "kvarn-mlx-prompt-cache"
FORMAT_VERSION = "1"
SUFFIX = ".safetensors"
# Files that define what the model computes from the same token ids.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)
_SAMPLE = 1 << 20  # bytes read at the start, middle and end of each weights file
_HEADER_MAX = 100 << 20  # larger safetensors headers are treated as corrupt


class PromptCacheError(ValueError):
    pass


def cache_path(name) -> Path:
    """The file a prompt cache named `name` lives in, for writing and reading alike
    (mx.save_safetensors appends ".safetensors" when it is missing)."""
    path = Path(name).expanduser()
    return path if path.name.endswith(SUFFIX) else path.with_name(path.name + SUFFIX)


# -- model identity ------------------------------------------------------------------


def model_identity(model_spec, model, tokenizer=None):
    """Metadata (str -> str) naming the model a cache belongs to.

    model_spec: what was passed to the loader (None = the embedded model, a
    folder, or a Hugging Face repo id). The hash covers config.json, the
    tokenizer files and samples of every weights file, so a fine-tune with the
    same shapes (same config) gets another hash; without a folder it falls back
    to model.args and the tokenizer's vocabulary.
    """
    folder = _model_folder(model_spec)
    h = hashlib.sha256()
    if folder is not None:
        _hash_folder(h, folder)
    else:
        _hash_objects(h, model, tokenizer)
    if model_spec is None:
        from .loader import DEFAULT_NAME

        name = f"embedded {DEFAULT_NAME}"
    else:
        name = str(model_spec)
    args = getattr(model, "args", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or getattr(
        args, "num_attention_heads", None
    )
    return {
        "model": name,
        "model_hash": h.hexdigest()[:32],
        "model_layers": str(len(make_prompt_cache(model))),
        "model_kv_heads": "" if kv_heads is None else str(kv_heads),
    }


def _model_folder(spec):
    if spec is None:
        from .loader import default_model_path

        return default_model_path()
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    try:  # a repo id the loader downloaded: read the same snapshot, offline
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(spec), local_files_only=True))
    except Exception:
        return None


def _hash_folder(h, folder):
    for name in ("config.json", *_TOKENIZER_FILES):
        p = folder / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    for p in sorted(folder.glob("*.safetensors")):
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with open(p, "rb") as f:
            for at in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                f.seek(at)
                h.update(f.read(_SAMPLE))


def _hash_objects(h, model, tokenizer):
    args = getattr(model, "args", None)
    fields = vars(args) if args is not None and hasattr(args, "__dict__") else {}
    h.update(json.dumps(fields, sort_keys=True, default=str).encode())
    h.update(type(model).__module__.encode())
    if tokenizer is not None:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        h.update(json.dumps(vocab, sort_keys=True).encode())


def _describe(info):
    heads = f", {info['model_kv_heads']} kv heads" if info.get("model_kv_heads") else ""
    return f"{info.get('model', '?')} ({info.get('model_layers', '?')} layers{heads})"


# -- files ---------------------------------------------------------------------------


def read_metadata(path):
    """The metadata dict of a prompt-cache file, from its safetensors header alone.
    Raises PromptCacheError for a file that is not a complete safetensors file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, _HEADER_MAX):
            raise PromptCacheError(
                f"{path} is not a safetensors file (or is truncated); delete it or pass another "
                "file"
            )
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise PromptCacheError(
                f"{path} has a corrupt safetensors header; delete it or pass another file"
            ) from None
    if not isinstance(header, dict):
        raise PromptCacheError(
            f"{path} has a corrupt safetensors header; delete it or pass another file"
        )
    try:
        end = max(
            (int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0
        )
    except (TypeError, KeyError, ValueError, IndexError):
        raise PromptCacheError(
            f"{path} has a corrupt safetensors header; delete it or pass another file"
        ) from None
    if 8 + n + end != size:
        raise PromptCacheError(
            f"{path} is truncated or damaged ({size} bytes, its header describes {8 + n + end}); "
            "delete it and build the cache again"
        )
    meta = header.get("__metadata__") or {}
    # save_prompt_cache flattens [metadata, classes, scalars]; the user's metadata is "0.<key>".
    return {k[2:]: v for k, v in meta.items() if k.startswith("0.")}


def is_prompt_cache(path):
    """True for a complete prompt-cache file written by this module."""
    try:
        return read_metadata(path).get("format") == FORMAT
    except (PromptCacheError, OSError):
        return False


def check_writable(path, overwrite=False):
    """The file `path` names (cache_path), once a cache can be saved there
    (atomic_json.check_target): the folder exists and takes new files, and any file
    already there is a prompt cache of this format (or overwrite=True). Call it before
    the model runs."""
    is_ours = (lambda _: True) if overwrite else is_prompt_cache
    return check_target(cache_path(path), is_ours, "prompt-cache file", PromptCacheError)


def kv_settings(cache):
    """The KV cache kinds and settings of a prompt cache, as JSON (one entry per distinct
    layer kind)."""
    kinds = []
    for c in cache:
        config = getattr(c, "config", None)
        d = {"class": type(c).__name__}
        if config is not None and hasattr(config, "__dataclass_fields__"):
            d.update({k: getattr(config, k) for k in config.__dataclass_fields__})
        if d not in kinds:
            kinds.append(d)
    return json.dumps(kinds)


def save(path, cache, model_info, metadata=None, overwrite=False):
    """Write `cache` to the file `path` names, atomically (a temp file in the same
    folder, then a rename): an interrupted save leaves the old file or none.
    model_info: model_identity(...). metadata: more str -> str entries. Returns the path."""
    path = check_writable(path, overwrite)
    meta = {
        **(metadata or {}),
        **model_info,
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kv_settings": kv_settings(cache),
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + SUFFIX, dir=path.parent)
    os.close(fd)
    try:
        save_prompt_cache(tmp, cache, meta)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a saved cache is an ordinary file
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, (OSError, RuntimeError)):
            raise PromptCacheError(f"could not save the prompt cache to {path}: {e}") from e
        raise
    return path


def check_file(path):
    """The metadata of the prompt-cache file `path` names, once it is known to be a complete
    file of this format (no model needed: call it before loading one)."""
    path = cache_path(path)
    if not path.is_file():
        raise PromptCacheError(f"no prompt-cache file at {path}")
    meta = read_metadata(path)
    if meta.get("format") != FORMAT:
        raise PromptCacheError(
            f"{path} is not a kvarn-mlx prompt-cache file (no {FORMAT} metadata); pass a file "
            "saved by kvarn-mlx, or a new name to save one"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise PromptCacheError(
            f"{path} has prompt-cache format version {meta.get('format_version')!r}; this version "
            f"reads {FORMAT_VERSION}. Build the cache again"
        )
    return meta


def load(path, model_info):
    """(cache, metadata) from the file `path` names, for the model model_info describes.
    Refuses files of another format, damaged files, and caches made with another model."""
    path = cache_path(path)
    meta = check_file(path)
    if meta.get("model_hash") != model_info["model_hash"]:
        raise PromptCacheError(
            f"{path} was saved with model {_describe(meta)}, not with the model loaded now, "
            f"{_describe(model_info)}; pass that model with --model, or another file"
        )
    try:
        cache, meta = load_prompt_cache(str(path), return_metadata=True)
    except Exception as e:  # mlx and the cache classes raise plain RuntimeError/ValueError/KeyError
        raise PromptCacheError(
            f"cannot read the prompt cache {path} ({e}); delete it and build the cache again"
        ) from e
    layers = int(model_info["model_layers"])
    if len(cache) != layers:
        raise PromptCacheError(
            f"{path} holds {len(cache)} cache layers but {model_info['model']} has {layers}; "
            "delete it and build the cache again"
        )
    want = model_info.get("model_kv_heads")
    for c in cache:
        heads = _kv_heads(c)
        if want and heads is not None and heads != int(want):
            raise PromptCacheError(
                f"{path} holds {heads} kv heads per layer but {model_info['model']} has {want}; "
                "delete it and build the cache again"
            )
    return cache, {k: v for k, v in meta.items()}


def _kv_heads(c):
    for name in ("sink_k", "keys"):
        x = getattr(c, name, None)
        if x is not None and getattr(x, "ndim", 0) == 4:
            return x.shape[1]
    return None
