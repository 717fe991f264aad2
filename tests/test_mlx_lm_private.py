"""Every private mlx-lm name this project uses, named in one list, and still
where the installed mlx-lm has it.

pyproject.toml pins mlx-lm to the minor version these names were checked
against; a new mlx-lm that moves one fails here, naming it, before any server
test fails in a way that hides why. A private name used in the code but not
listed (or listed but no longer used) fails too, so the list stays the truth.
"""

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# "module:qualified.name" of each private mlx-lm name, and who uses it for what.
PRIVATE = {
    "mlx_lm.models.cache:_BaseCache": "cache.py, batch_cache.py, eval/runner.py: the base class of mlx-lm's caches",
    "mlx_lm.utils:_get_classes": "plan.py: a model's classes from its config, without loading weights",
    "mlx_lm.server:_run_http_server": "server.run: mlx-lm's HTTP server with our handler and generator",
    "mlx_lm.server:ResponseGenerator._tokenize": "server.ResponseGenerator: --max-kv-bytes caps max_tokens",
    "mlx_lm.server:ResponseGenerator._generation_failed": "server: exit when the generation thread dies",
    "mlx_lm.generate:BatchGenerator._generation_batch": "server.BatchGenerator: live KV figures",
    "mlx_lm.generate:BatchGenerator._prompt_batch": "server.BatchGenerator: live KV figures",
    "mlx_lm.generate:BatchGenerator._unprocessed_sequences": "server.BatchGenerator: live KV figures",
    "mlx_lm.models.cache:LRUPromptCache._trie": "server.PromptCache.entries: the prompt cache's bytes",
    "mlx_lm.models.cache:LRUPromptCache._lru": "server.PromptCache.entries",
    "mlx_lm.models.cache:LRUPromptCache.CacheOrder._lrus": "server.PromptCache.entries",
}
# Names our own code defines that mlx-lm happens to use too (not mlx-lm's).
OWN = {
    ("kvarn_mlx/loader.py", "_download"): "the embedded model's own download helper",
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
        if i == len(parts) - 1 and inspect.isclass(obj) and re.search(
                rf"self\.{part}\s*[:=]", inspect.getsource(obj)):
            return None
        return f"{module_name}.{'.'.join(parts[:i + 1])}"
    return None


@pytest.mark.parametrize("spec", sorted(PRIVATE))
def test_every_private_name_is_where_the_code_expects_it(spec):
    import mlx_lm

    missing = where(spec)
    assert missing is None, (
        f"mlx-lm {mlx_lm.__version__} has no {missing} ({spec}), which kvarn_mlx uses: {PRIVATE[spec]}. "
        "Adapt that code to this mlx-lm, then move the mlx-lm pin in pyproject.toml")


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
        modules |= {importlib.import_module(v.__module__) for v in vars(m).values()
                    if inspect.isclass(v) and v.__module__.startswith("mlx_lm")}
    return modules


def _private_names(module):
    text = inspect.getsource(module)
    return set(re.findall(r"self\.(_[a-z]\w*)\s*[:=]", text)) | set(re.findall(r"(?:def|class) (_\w+)", text)) \
        | set(re.findall(r"^(_\w+)\s*=", text, re.M))


def test_the_list_names_every_private_mlx_lm_name_the_code_uses():
    """Attributes, method overrides and imports in our files whose names are
    private names of the mlx-lm modules the file imports."""
    listed = {spec.split(":")[1].rsplit(".", 1)[-1] for spec in PRIVATE}
    used = set()
    for path in SOURCES:
        text = path.read_text()
        assert 'sys.modules["mlx_lm' not in text or path.name == "server.py", \
            f"{path}: reaches into sys.modules for mlx-lm; list it in {Path(__file__).name}"
        tree = ast.parse(text)
        theirs = set().union(set(), *(_private_names(m) for m in _mlx_lm_modules(tree)))
        if not theirs:
            continue
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        rel = str(path.relative_to(ROOT))
        for name in names & theirs:
            if not name.startswith("__") and (rel, name) not in OWN:
                used.add(name)
                assert name in listed, f"{rel} uses mlx-lm's private {name}: add it to PRIVATE in {__name__}"
    assert listed <= used, f"listed but no longer used: {sorted(listed - used)}"
