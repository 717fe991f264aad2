"""Dispatch choices measured on this machine by `python -m kvarn_mlx.bench`.

The dispatch decides a few things from constants: from how many query tokens a
step attends through the dequantized buffer (prefill.MIN_QUERIES), how many CPU
streams the packed ops path splits its tiles over and from how many tiles
(dispatch.CPU_STREAMS, attention.MIN_STREAM_TILES), and how many threadgroups
the Metal attention kernel aims for (kernels._ATT_TARGET_GROUPS). Importing
kvarn_mlx calls apply(): the tuning file, if there is one, replaces those
constants. No file, the constants as shipped. A file made on another chip or
with another MLX version, or one that does not parse, is ignored with one log
line: the choices it holds were measured for something else.

The file: $KVARN_MLX_TUNING, else $KVARN_MLX_HOME/tuning.json (default
~/.cache/kvarn_mlx); KVARN_MLX_TUNING="" reads none.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path

import mlx.core as mx

from . import attention, dispatch, kernels, prefill
from .atomic_json import check_target, write_json
from .embedded.folders import home

log = logging.getLogger("kvarn_mlx.tuning")

KIND = "kvarn_mlx tuning"
FORMAT = 1
ENV = "KVARN_MLX_TUNING"

# choice -> the device type it applies to (None: the file's) and its valid range.
CHOICES = {
    "min_queries": (None, 1, 1 << 20),
    "cpu_streams": ("cpu", 1, 256),
    "min_stream_tiles": ("cpu", 1, 1 << 20),
    "target_groups": ("gpu", 1, 1 << 20),
}


class TuningError(ValueError):
    pass


def current(device=None) -> dict:
    """The value of every choice the dispatch reads now, for device type `device`."""
    device = device or mx.default_device().type.name
    return {
        "min_queries": prefill.MIN_QUERIES.get(device, prefill.MIN_QUERIES["gpu"]),
        "cpu_streams": dispatch.CPU_STREAMS,
        "min_stream_tiles": attention.MIN_STREAM_TILES,
        "target_groups": kernels._ATT_TARGET_GROUPS,
    }


DEFAULTS = {d: current(d) for d in ("cpu", "gpu")}  # as shipped, before any file


def set_choices(device, choices) -> None:
    """Make the dispatch use `choices` (checked names and values) on device type `device`."""
    for name, value in choices.items():
        if name == "min_queries":
            prefill.MIN_QUERIES[device] = value
        elif name == "cpu_streams":
            dispatch.CPU_STREAMS = value
        elif name == "min_stream_tiles":
            attention.MIN_STREAM_TILES = value
        elif name == "target_groups":
            kernels._ATT_TARGET_GROUPS = value


def machine() -> dict:
    """What a tuning file was measured on: a file applies only where these match
    (the device type aside: choices apply to the device type they were measured on)."""
    try:
        info = mx.device_info()  # a Mac: the GPU's name, e.g. "Apple M2"; Linux: the CPU's
        chip = info.get("device_name") or info.get("architecture") or ""
    except Exception:  # builds without device_info
        chip = ""
    return {
        "mlx": mx.__version__,
        "chip": chip or platform.processor() or platform.machine(),
        "system": f"{platform.system()} {platform.machine()}",
        "cores": os.cpu_count(),
    }


def default_path() -> Path | None:
    if ENV in os.environ:
        p = os.environ[ENV]
        return Path(p).expanduser() if p else None
    return home() / "tuning.json"


def read(path) -> dict:
    """The checked contents of a tuning file; TuningError naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TuningError(f"cannot read it ({e})") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise TuningError("it is not a kvarn-mlx tuning file")
    if data.get("format") != FORMAT:
        raise TuningError(f"format {data.get('format')!r}, this kvarn-mlx reads {FORMAT}")
    here = machine()
    for key in ("mlx", "chip"):
        if data.get(key) != here[key]:
            raise TuningError(
                f"it was measured with {key} {data.get(key)!r}, this is {here[key]!r}"
            )
    device, choices = data.get("device"), data.get("choices")
    if device not in ("cpu", "gpu"):
        raise TuningError(f"device {device!r} is not 'cpu' or 'gpu'")
    if not isinstance(choices, dict):
        raise TuningError("'choices' is not an object")
    for name, value in choices.items():
        if name not in CHOICES:
            raise TuningError(f"unknown choice {name!r}")
        only, lo, hi = CHOICES[name]
        if only is not None and only != device:
            raise TuningError(f"choice {name!r} is for the {only}, the file is for the {device}")
        if type(value) is not int or not lo <= value <= hi:
            raise TuningError(f"choice {name}={value!r} is not an integer in [{lo}, {hi}]")
    return data


def apply(path=None) -> dict | None:
    """Read the tuning file (default_path() when path is None) and make the
    dispatch use its choices; returns them, or None (no file, or one ignored)."""
    path = default_path() if path is None else Path(path)
    if path is None or not path.exists():
        return None
    try:
        data = read(path)
    except TuningError as e:
        log.warning(
            f"kvarn_mlx: ignoring the tuning file {path}: {e}; using the defaults (run `python -m "
            "kvarn_mlx.bench` to measure this machine)"
        )
        return None
    set_choices(data["device"], data["choices"])
    return data["choices"]


def is_tuning_file(path) -> bool:
    try:
        return json.loads(Path(path).read_text()).get("kind") == KIND
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def check_writable(path) -> Path:
    """The path, once a tuning file can be written there (checked before measuring)."""
    return check_target(
        path, is_tuning_file, "tuning file", TuningError, "Pass another file name with --out"
    )


def write(path, device, choices, figures) -> Path:
    """Write a tuning file atomically (a temp file in the same folder, then a
    rename), never over a file that is not one."""
    path = check_writable(path)
    data = {
        "kind": KIND,
        "format": FORMAT,
        **machine(),
        "device": device,
        "choices": choices,
        "figures": figures,
    }
    return write_json(path, data)
