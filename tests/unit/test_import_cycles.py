"""No import cycle among gradaccum's modules.

A cycle makes the import order decide what a module sees, and hides which module is the lower one.
The graph is read from the source (ast): every import, at module level (including those under
``if TYPE_CHECKING:`` and in ``try`` blocks) and inside functions and methods. An import deferred
into a function keeps ``--help`` and ``import gradaccum`` light, but it is still a dependency: a
circle through it is a circle. Importing ``pkg.mod`` is an edge to ``pkg.mod``; a parent package's
``__init__`` is not counted, since gradaccum's packages import their names lazily.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gradaccum

SRC = Path(gradaccum.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in the module: at module level and inside functions and classes."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_gradaccums_imports() -> None:
    graph = _graph()
    assert len(graph) > 80
    # a plain import, a TYPE_CHECKING one and a relative-free from-import of a module are all seen
    assert "gradaccum.errors" in graph["gradaccum.plan"]
    assert "gradaccum.train.records" in graph["gradaccum.cli.cmd_train"]
    assert "gradaccum.workloads.base" in graph["gradaccum.check.workload"]
    # an import inside a function is an edge too (cmd_scan imports the scanner where it runs)
    assert "gradaccum.hazards.scanner" in graph["gradaccum.cli.cmd_scan"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_gradaccum_modules() -> None:
    cycles = _cycles(_graph())
    assert not cycles, (
        f"import cycles: {cycles}. Move what both modules need into the lower one (the one that "
        "does not need the other), as Workload moved to gradaccum.workloads.base and GuardFinding "
        "to gradaccum.errors"
    )
