"""The documents point at files that exist, and the README keeps its two set-up commands.

A path in backticks is the reader's way into the code; a stale one sends them nowhere. Paths are written
either from the repository root (`packed_encoders/api.py`, `benchmarks/README.md`) or, inside the package's
own docs, from the package root (`ops/triton/rope.py`); both forms are checked. pytest node ids
(`tests/gpu/test_x.py::test_y`) must name a test function in that file, and relative links and images must
resolve.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").rglob("*.md")])

# Written by commands, never committed: the benchmark token cache and result folders, calibrated policies.
GENERATED = ("benchmarks/.cache", "benchmarks/results")

ROOT_PREFIXES = ("packed_encoders/", "benchmarks/", "docs/", "tests/", ".ci/", ".gpu/")  # .gpu/: scratch, never committed
ROOT_FILES = {"README.md", "LICENSE", "pyproject.toml", "uv.lock", ".gitignore"}
PACKAGE_DIRS = ("adapters/", "attention/", "batch.py", "graphs/", "model/", "ops/", "data/", "api.py",
                "validation.py", "calibrate.py", "demo.py", "errors.py", "switches.py")

SETUP_COMMANDS = [
    "pip install -e . && python -m packed_encoders.demo",
    'pip install -e ".[test]" && python -m pytest -q tests',
]

_TICKED = re.compile(r"`([^`\s]+)`")


def _repo_paths(text: str):
    """Backticked tokens that name a repository file or folder (maybe with a `::test` suffix)."""
    for token in _TICKED.findall(text):
        token = token.rstrip(".,;:)")
        if any(c in token for c in "$~*<>{}[]()=\"'") or "://" in token:
            continue
        path = token.split("::")[0]
        if path in ROOT_FILES or path.startswith(ROOT_PREFIXES) or path.startswith(PACKAGE_DIRS):
            yield token


def _resolve(path: str) -> Path | None:
    for base in (ROOT, ROOT / "packed_encoders"):
        if (base / path).exists():
            return base / path
    return None


def _test_names(file: Path) -> set[str]:
    tree = ast.parse(file.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_backticked_paths_exist(doc):
    missing = []
    for token in _repo_paths(doc.read_text()):
        path, _, test = token.partition("::")
        if path.startswith(GENERATED):
            continue
        found = _resolve(path)
        if found is None:
            missing.append(token)
        elif test and test.split("[")[0] not in _test_names(found):
            missing.append(token)
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_images_exist(doc):
    links = re.findall(r"\]\(([^)#\s]+)", doc.read_text())
    missing = [link for link in links if "://" not in link and not (doc.parent / link).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to files that do not exist: {sorted(set(missing))}"


def test_path_check_catches_a_missing_file():
    tokens = list(_repo_paths("see `packed_encoders/no_such_module.py` and `ops/triton/rope.py`, `$OUT/x`"))
    assert tokens == ["packed_encoders/no_such_module.py", "ops/triton/rope.py"]
    assert _resolve(tokens[0]) is None and _resolve(tokens[1]) is not None


def test_readme_has_exactly_the_two_setup_commands():
    """Each set-up command appears once, and no other `pip install -e ... && ...` one-liner competes with them."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", readme, flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    one_liners = [line for line in lines if " && " in line and line.startswith(("pip install", "uv "))]
    assert one_liners == SETUP_COMMANDS
