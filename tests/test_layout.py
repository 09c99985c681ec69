"""The package's shape: no import cycle, modules a reader can hold, `model/` standalone.

Every import counts, the ones inside functions too: an import made late to break a cycle
is still a cycle for the reader, who must know both modules to understand either.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ciuic_train"
MAX_MODULE_LINES = 500
MAX_MODEL_FILE_LINES = 350


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The package's modules that `path` imports, anywhere in it. `from A import b` counts
    as importing A.b when that is a module, else A."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    found.add(f"{base}.{alias.name}")
                elif base in known:
                    found.add(base)
    return found - {module_name(path)}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported_modules(path, set(known)) for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path `a -> b -> ... -> a`, or None (depth-first, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "ciuic_train.train.trainer" in graph["ciuic_train.cli.job"]  # imported inside a function


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_model_package_imports_only_itself():
    """scripts/bench_peer.py --baseline REV copies model/ out of git and runs it alone."""
    graph = import_graph()
    outside = {
        (name, dep)
        for name, deps in graph.items() if name.startswith("ciuic_train.model")
        for dep in deps if not dep.startswith("ciuic_train.model")
    }
    assert not outside, outside


@pytest.mark.parametrize("name", sorted(modules()))
def test_module_size(name: str):
    path = modules()[name]
    lines = len(path.read_text().splitlines())
    limit = MAX_MODEL_FILE_LINES if name.startswith("ciuic_train.model") else MAX_MODULE_LINES
    assert lines <= limit, f"{path.relative_to(PACKAGE.parent)}: {lines} lines, at most {limit}"
