"""Writing a JSON file of ours atomically: a temp file in the same folder,
flushed to disk, then renamed over the target, so a reader never sees half a
file and a crash never leaves one; and never over a file that is not ours."""

import json
import os
import tempfile
from pathlib import Path


def write_json(path, data) -> Path:
    """Write `data` as JSON to `path` atomically, with the umask's usual mode."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_target(path, is_ours, what, error=ValueError, fix="Pass another file name") -> Path:
    """The path, once a `what` (e.g. "profile") can be written there: it is no folder,
    its folder exists and takes new files, and any file already there passes
    is_ours(path). Raises `error` naming the problem and the fix; call it before long work."""
    path = Path(path).expanduser()
    folder = path.parent
    if path.is_dir():
        raise error(f"cannot write the {what} to {path}: it is a folder; pass a file name")
    if not folder.is_dir():
        problem = "is not a folder" if folder.exists() else "does not exist"
        raise error(
            f"cannot write the {what} to {path}: {folder} {problem}; create the folder or pass "
            "another path"
        )
    if path.exists() and not is_ours(path):
        raise error(f"{path} exists and is not a kvarn-mlx {what}; refusing to overwrite it. {fix}")
    try:  # the only check that holds for every user and file system: create a file
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
    except OSError as e:
        raise error(
            f"cannot write the {what} to {path}: {folder} is not writable ({e.strerror}); pass a "
            "path in a writable folder"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return path
