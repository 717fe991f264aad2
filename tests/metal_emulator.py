"""Where the Metal kernel tests run: a Metal device, or the optional MSL emulator.

The emulator (mslemu) compiles the exact kernel sources as C++ and runs them on
the CPU, so the kernels can be tested without a Mac (docs/testing.md). It is a
development tool, not part of this repository: point KVARN_MSLEMU at its folder
(the one holding the `mslemu` package), or keep it at ../shared/mslemu beside
the repository. Without either, on a machine with no Metal device, the kernel
tests skip with SKIP_REASON.
"""

import os
import sys
from pathlib import Path

import mlx.core as mx

ENV = "KVARN_MSLEMU"
ROOT = Path(__file__).resolve().parents[1]
BESIDE = ROOT.parent / "shared" / "mslemu"
# A real Metal device: the kernels run natively and the emulator is not used.
NATIVE = mx.metal.is_available()
SKIP_REASON = f"no Metal device and no MSL emulator (set {ENV}=/path/to/mslemu)"


def find():
    """The emulator's folder, or None. A KVARN_MSLEMU that names no emulator is an error,
    not a skip: the user asked for the kernel tests."""
    given = os.environ.get(ENV, "").strip()
    if given:
        path = Path(given).expanduser().resolve()
        if not (path / "mslemu" / "__init__.py").is_file():
            raise ValueError(
                f"{ENV}={given}: no MSL emulator there (expected "
                f"{path / 'mslemu' / '__init__.py'}); point {ENV} at the folder that holds the "
                "mslemu package, or unset it"
            )
        return path
    return BESIDE if (BESIDE / "mslemu" / "__init__.py").is_file() else None


def load():
    """The imported mslemu module, or None when there is no emulator."""
    path = find()
    if path is None:
        return None
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    import mslemu

    return mslemu
