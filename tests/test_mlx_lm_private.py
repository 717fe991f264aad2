"""Every private mlx-lm name this project uses is listed at the top of the one
module that uses it (kvarn_mlx/server/hooks.py for the server,
kvarn_mlx/mlx_lm_private.py for the rest), and is still where the installed
mlx-lm has it.

pyproject.toml pins mlx-lm to the minor version these names were checked
against; a new mlx-lm that moves one fails here, naming it, before any server
test fails in a way that hides why. A private name used anywhere else, or used
but not listed, or listed but no longer used, fails too.
"""

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from kvarn_mlx import mlx_lm_private
from kvarn_mlx.server import hooks

ROOT = Path(__file__).resolve().parents[1]
# module file: its list of "module:qualified.name" -> what it is for
LISTS = {
    "kvarn_mlx/server/hooks.py": hooks.MLX_LM_PRIVATE,
    "kvarn_mlx/mlx_lm_private.py": mlx_lm_private.MLX_LM_PRIVATE,
}
PRIVATE = {spec: use for names in LISTS.values() for spec, use in names.items()}
# Names our own code defines that mlx-lm happens to use too (not mlx-lm's).
OWN = {
    ("kvarn_mlx/batch_cache.py", "_idx"): "BatchKVarNCache's own write position",
}
SOURCES = [p for d in ("kvarn_mlx", "apps") for p in sorted((ROOT / d).rglob("*.py"))]


def where(spec):
    """None if the installed mlx-lm has the name `spec` names, else what is missing."""
    module_name, qualname = spec.split(":")
    obj = importlib.import_module(module_name)
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        # an instance attribute: assigned in the class's own code
        if (
            i == len(parts) - 1
            and inspect.isclass(obj)
            and re.search(rf"self\.{part}\s*[:=]", inspect.getsource(obj))
        ):
            return None
        return f"{module_name}.{'.'.join(parts[: i + 1])}"
    return None


@pytest.mark.parametrize("spec", sorted(PRIVATE))
def test_every_private_name_is_where_the_code_expects_it(spec):
    import mlx_lm

    missing = where(spec)
    assert missing is None, (
        f"mlx-lm {mlx_lm.__version__} has no {missing} ({spec}), which kvarn_mlx uses: "
        f"{PRIVATE[spec]}. Adapt that code to this mlx-lm, then move the mlx-lm pin in "
        "pyproject.toml"
    )


def _mlx_lm_modules(tree):
    """The mlx-lm modules a file imports, and the modules their classes come from."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("mlx_lm")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm"):
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    modules = set()
    for name in names:
        try:
            modules.add(importlib.import_module(name))
        except ImportError:
            continue
    for m in list(modules):
        modules |= {
            importlib.import_module(v.__module__)
            for v in vars(m).values()
            if inspect.isclass(v) and v.__module__.startswith("mlx_lm")
        }
    return modules


def _private_names(module):
    text = inspect.getsource(module)
    return (
        set(re.findall(r"self\.(_[a-z]\w*)\s*[:=]", text))
        | set(re.findall(r"(?:def|class) (_\w+)", text))
        | set(re.findall(r"^(_\w+)\s*=", text, re.M))
    )


def test_private_names_are_used_only_where_they_are_listed():
    """Attributes, method overrides and imports in our files whose names are
    private names of the mlx-lm modules the file imports: only in the two
    modules that list them, and each listed name used there."""
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        if rel not in LISTS:
            for pattern in ('sys.modules["mlx_lm', "mlx_server._", "mlx_cache._", "._lrus"):
                assert pattern not in text, (
                    f"{rel} uses {pattern!r}: private mlx-lm names go in server/hooks.py"
                )
        tree = ast.parse(text)
        theirs = set().union(set(), *(_private_names(m) for m in _mlx_lm_modules(tree)))
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        used = {n for n in names & theirs if not n.startswith("__") and (rel, n) not in OWN}
        if rel not in LISTS:
            assert not used, (
                f"{rel} uses mlx-lm's private {sorted(used)}: only server/hooks.py and "
                "mlx_lm_private.py may (and list them)"
            )
            continue
        listed = {spec.split(":")[1].rsplit(".", 1)[-1] for spec in LISTS[rel]}
        assert used <= listed, (
            f"{rel} uses mlx-lm's private {sorted(used - listed)} without listing them"
        )
        assert listed <= used, f"{rel} lists {sorted(listed - used)} but no longer uses them"
