"""A benchmarks/ script imported as a module, for the tests that call its functions
(benchmarks/ is a folder of scripts, not a package)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name):
    """benchmarks/<name>.py, run afresh as the module bench_<name>."""
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
