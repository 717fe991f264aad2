"""kvarn_mlx's modules import each other in one direction only: every import
statement (including those inside functions) read with `ast`, no cycle."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def module_name(path, root=ROOT):
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root=ROOT):
    return {module_name(p, root): p for p in (root / "kvarn_mlx").rglob("*.py")}


def imports(name, path, known):
    """The kvarn_mlx modules `name` imports, from every import statement in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            # `from . import x` and `from .pkg import mod` name modules; `from .m import f` names m.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for t in targets:
            while (
                t and t not in known
            ):  # `import kvarn_mlx.x.y` depends on the deepest known module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph():
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def find_cycle(g):
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == "open":
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = "done"
        return None

    for n in sorted(g):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_walker_sees_imports_inside_functions_and_relative_forms(tmp_path):
    pkg = tmp_path / "kvarn_mlx"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n    return g\n")
    (pkg / "b.py").write_text("import kvarn_mlx.sub.c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom . import d\n")
    (pkg / "sub" / "d.py").write_text("")
    known = modules(tmp_path)
    g = {n: imports(n, p, known) for n, p in known.items()}
    assert g["kvarn_mlx.a"] == {"kvarn_mlx.b"}
    assert g["kvarn_mlx.b"] == {"kvarn_mlx.sub.c"}
    assert g["kvarn_mlx.sub.c"] == {"kvarn_mlx.a", "kvarn_mlx.sub.d"}
    assert find_cycle(g) == ["kvarn_mlx.a", "kvarn_mlx.b", "kvarn_mlx.sub.c", "kvarn_mlx.a"]


def test_no_import_cycle_in_kvarn_mlx():
    g = graph()
    assert {
        "kvarn_mlx.cache",
        "kvarn_mlx.attention",
        "kvarn_mlx.kernels",
        "kvarn_mlx.integration",
    } <= set(g)
    assert find_cycle(g) is None, " -> ".join(find_cycle(g))


def test_core_layers_point_down():
    g = graph()
    assert "kvarn_mlx.attention" not in g["kvarn_mlx.cache"]
    assert "kvarn_mlx.cache" not in g["kvarn_mlx.attention"]
    for low in (
        "kvarn_mlx.config",
        "kvarn_mlx.quant",
        "kvarn_mlx.tiles",
        "kvarn_mlx.kernels",
        "kvarn_mlx.dispatch",
        "kvarn_mlx.rotation",
        "kvarn_mlx.cache",
        "kvarn_mlx.attention",
    ):
        assert "kvarn_mlx.integration" not in g[low] and "kvarn_mlx" not in g[low], low


def test_the_package_never_imports_the_apps():
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )
            )
            assert not any(m == "apps" or m.startswith("apps.") for m in mods), (
                f"{name} imports {mods}"
            )


def test_every_subpackage_ships_in_the_wheel():
    # pyproject.toml lists the packages by name: a new folder left out of it
    # imports from a checkout but is missing from an installed wheel.
    import re

    line = re.search(r"^packages = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    listed = set(re.findall(r'"([\w.]+)"', line.group(1)))
    folders = {module_name(p.parent) for p in (ROOT / "kvarn_mlx").rglob("__init__.py")}
    assert folders <= listed, sorted(folders - listed)
