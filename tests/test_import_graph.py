"""Imports point down: the module import graph of ``packed_encoders`` has no cycle.

The graph is built from the source with ``ast`` (nothing is imported), counting every import statement,
function-level ones included: a lazy import only hides a cycle until the function runs. Not counted: imports under
``if TYPE_CHECKING:`` (annotations only, never executed) and the edge from a module to its own ancestor packages
(Python has imported those before the module runs). Importing a module of another package counts an edge to that
package's ``__init__`` too, since Python runs it first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import packed_encoders

ROOT = Path(packed_encoders.__file__).parent
PACKAGE = "packed_encoders"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
                (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
                or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")):
            for inner in node.body:
                for sub in ast.walk(inner):
                    skipped.add(id(sub))
    return skipped


def _targets(name: str, node: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The package modules one import statement of module ``name`` loads."""
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    found: set[str] = set()
    if isinstance(node, ast.Import):
        bases = [alias.name for alias in node.names]
        names: list[str] = []
    else:
        if node.level:
            base = package.split(".")
            base = base[:len(base) - node.level + 1]
            bases = [".".join(base + ([node.module] if node.module else []))]
        else:
            bases = [node.module or ""]
        names = [alias.name for alias in node.names]
    for base in bases:
        if base != PACKAGE and not base.startswith(PACKAGE + "."):
            continue
        loaded = [base] + [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
        for mod in loaded:
            parts = mod.split(".")
            for i in range(1, len(parts) + 1):  # the packages Python runs on the way (and the module)
                found.add(".".join(parts[:i]))
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, len(name.split(".")))}
    if _is_package(name, modules):
        ancestors.add(name)
    return {t for t in found if t in modules and t not in ancestors and t != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_nodes(tree)
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
                edges |= _targets(name, node, modules)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_checker_sees_a_cycle_and_its_exemptions():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    graph = import_graph()
    assert "packed_encoders.graphs.config" in graph["packed_encoders.graph_check"] or \
        "packed_encoders.graphs.buckets" in graph["packed_encoders.graph_check"]
    # function-level imports count (the Triton kernels are imported lazily by the graph runner)
    assert "packed_encoders.ops.triton.stage" in graph["packed_encoders.graphs.runner"]
    # TYPE_CHECKING imports do not (buckets annotates with GraphConfig; config imports buckets)
    assert "packed_encoders.graphs.config" not in graph["packed_encoders.graphs.buckets"]


def test_no_import_cycle_inside_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_known_layers_point_down():
    graph = import_graph()

    def reaches(src: str, dst: str) -> bool:
        seen, todo = set(), [src]
        while todo:
            node = todo.pop()
            if node == dst:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return False

    for low, high in (("packed_encoders.graphs.route", "packed_encoders.adapters.state"),
                      ("packed_encoders.router", "packed_encoders.call"),
                      ("packed_encoders.validation", "packed_encoders.api"),
                      ("packed_encoders.model.forward", "packed_encoders.graphs.route"),
                      ("packed_encoders.ops", "packed_encoders.attention.dispatch")):
        assert not reaches(low, high), f"{low} imports {high} (directly or not): imports must point down"


def _diagram_units() -> list[str]:
    """The units of ``docs/architecture.md``'s "Layers (imports point down)" diagram, top to bottom: module files
    (``call.py``) and packages (``graphs/``), as the diagram's unindented lines name them."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Layers (imports point down)", 1)[1].split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line and not line[0].isspace()]


def test_the_architecture_diagram_lists_layers_in_import_order():
    units = _diagram_units()
    assert "batch.py" in units and "ops/" in units and "switches.py" in units

    def unit(module: str) -> str | None:
        parts = module.split(".")[1:]
        if not parts:
            return None
        name = parts[0] + ("/" if len(parts) > 1 or (ROOT / parts[0]).is_dir() else ".py")
        return name if name in units else None

    upward = []
    for src, targets in import_graph().items():
        for dst in targets:
            a, b = unit(src), unit(dst)
            if a is not None and b is not None and a != b and units.index(a) > units.index(b):
                upward.append(f"{src} ({a}) imports {dst} ({b})")
    assert not upward, "the diagram lists these imports as pointing up:\n" + "\n".join(sorted(upward))


def test_the_architecture_diagram_lists_every_module():
    units = set(_diagram_units())
    present = {p.name + ("/" if p.is_dir() else "") for p in ROOT.iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert present - units == set(), f"docs/architecture.md's layer diagram leaves out {sorted(present - units)}"
    assert units - present == set(), f"docs/architecture.md's layer diagram names {sorted(units - present)}"
