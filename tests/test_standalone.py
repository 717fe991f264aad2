"""The repository stands on its own: nothing in it refers to files outside it,
except the optional MSL emulator's lookup and the page that explains it."""

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./shared|KVARN_SPEC|DESIGN\.md")
ALLOWED = {
    "tests/metal_emulator.py": "the emulator lookup",
    "docs/testing.md": "explains the emulator lookup",
    "tests/test_standalone.py": "this test's own pattern",
}
# Absolute paths a test may name: an optional speed-up, used only when present.
ALLOWED_ABSOLUTE = {"/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"}
ABSOLUTE = re.compile(r"^/(usr|etc|opt|home|work|var|srv|mnt|Users|Library|Volumes)/")


def tracked_files():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    return [p for p in out.decode().split("\0") if p]


def test_no_reference_outside_the_repository():
    files = tracked_files()
    assert (
        "tests/metal_emulator.py" in files and "README.md" in files
    )  # the scan sees the real tree
    hits = []
    for path in files:
        try:
            text = (ROOT / path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary files (images) and files deleted in the work tree
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line) and path not in ALLOWED:
                hits.append(f"{path}:{n}: {line.strip()}")
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)
    for path in ALLOWED:  # an exception with nothing left to excuse goes
        assert OUTSIDE.search((ROOT / path).read_text()), f"{path} no longer needs to be in ALLOWED"


def test_tests_read_no_absolute_paths():
    """No test depends on a file outside the repository, its packages and temp dirs
    (e.g. /usr/share/... is missing on macOS)."""
    hits = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and ABSOLUTE.match(node.value)
                and node.value not in ALLOWED_ABSOLUTE
            ):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not hits, "tests naming paths outside the repository:\n" + "\n".join(hits)
