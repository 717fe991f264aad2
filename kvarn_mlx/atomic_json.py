"""Writing a JSON file atomically: a temp file in the same folder, flushed to
disk, then renamed over the target, so a reader never sees half a file and a
crash never leaves one."""

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
