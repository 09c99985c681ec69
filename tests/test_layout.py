"""The package's shape: imports that only point down the layers docs/architecture.md
states, no import cycle, every module on that page, modules a reader can hold, `model/`
standalone.

Every import counts, the ones inside functions too: an import made late to break a cycle
is still a cycle for the reader, who must know both modules to understand either.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ciuic_train"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
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


def stated_layers(text: str) -> list[tuple[str, list[str]]]:
    """The "Layers" table of docs/architecture.md, top layer first: (name, entries), an
    entry a folder (`train/`) or a file (`model/config.py`) under ciuic_train/."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`"):
            layers.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    return layers


def layer_of(name: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """The index (0 = top) of the most specific entry that names module `name`."""
    path = name.replace(".", "/")
    best, depth = None, -1
    for index, (_, entries) in enumerate(layers):
        for entry in entries:
            names_it = (path + ".py" == "ciuic_train/" + entry or path == "ciuic_train/" + entry.removesuffix(".py")
                        or (entry.endswith("/") and (path + "/").startswith("ciuic_train/" + entry)))
            if names_it and len(entry) > depth:
                best, depth = index, len(entry)
    return best


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, list[str]]]) -> list[str]:
    found = []
    for name, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if layer_of(dep, layers) < layer_of(name, layers):
                found.append(f"{name} ({layers[layer_of(name, layers)][0]}) imports {dep} "
                             f"({layers[layer_of(dep, layers)][0]})")
    return found


def test_the_layer_rule_catches_an_import_running_up():
    layers = [("top", ["cli/"]), ("middle", ["train/"]), ("bottom", ["model/", "errors.py"]), ("base", ["model/config.py"])]
    assert layer_of("ciuic_train.model.config", layers) == 3  # the most specific entry wins
    assert layer_of("ciuic_train.model.moe", layers) == 2
    assert layer_of("ciuic_train.cli", layers) == 0  # a package's __init__
    assert upward_imports({"ciuic_train.train.trainer": {"ciuic_train.errors"}}, layers) == []
    assert upward_imports({"ciuic_train.model.config": {"ciuic_train.model.moe"}}, layers) == [
        "ciuic_train.model.config (base) imports ciuic_train.model.moe (bottom)"]


def test_every_module_has_a_stated_layer():
    layers = stated_layers(ARCHITECTURE.read_text())
    assert [name for name, _ in layers][:1] == ["commands"] and len(layers) > 5, layers
    unplaced = [name for name in modules() if name != "ciuic_train" and layer_of(name, layers) is None]
    assert not unplaced, f"modules in no layer of docs/architecture.md: {unplaced}"


def test_every_import_points_down_the_layers():
    found = upward_imports(import_graph(), stated_layers(ARCHITECTURE.read_text()))
    assert not found, "imports that run back up the layers (docs/architecture.md):\n" + "\n".join(found)


def documented_modules(text: str) -> set[str]:
    """The modules the "Modules" section's tables name: `x.py` rows under a "`pkg/`:" line
    (or "Top level:"), as paths under ciuic_train/."""
    section = text.split("## Modules", 1)[1].split("\n## ", 1)[0]
    found, package = set(), None
    for line in section.splitlines():
        if line.startswith("Top level:"):
            package = ""
        elif heading := re.match(r"^`([a-z_/]+/)`:", line):
            package = heading.group(1)
        elif package is not None and (row := re.match(r"^\| `([a-z_]+\.py)` \|", line)):
            found.add(package + row.group(1))
    return found


def test_architecture_names_every_module_and_none_that_is_gone():
    in_code = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if path.name != "__init__.py"}
    in_docs = documented_modules(ARCHITECTURE.read_text())
    assert in_code - in_docs == set(), f"modules docs/architecture.md does not name: {sorted(in_code - in_docs)}"
    assert in_docs - in_code == set(), f"docs/architecture.md names modules that are gone: {sorted(in_docs - in_code)}"


def test_every_package_is_installed():
    """pyproject.toml lists the packages one by one: a new subpackage left out of it imports
    from the source tree and fails in an installed copy."""
    listed = set(re.findall(r'"(ciuic_train(?:\.[a-z_]+)*)"', (PACKAGE.parent / "pyproject.toml").read_text()))
    packages = {module_name(path) for path in PACKAGE.rglob("__init__.py")}
    assert packages - listed == set(), sorted(packages - listed)


def test_only_the_layout_step_reads_dist_pp():
    """One layout step: the whole model or a pipeline is chosen in step/layout.py; the
    trainer and the step's other modules take the layout it built."""
    readers = []
    for path in [*(PACKAGE / "train").glob("*.py"), *(PACKAGE / "step").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "pp" and \
                    isinstance(node.value, ast.Attribute) and node.value.attr == "dist":
                readers.append(str(path.relative_to(PACKAGE)))
    assert sorted(set(readers)) == ["step/layout.py"], readers


def calls_in(path: Path, function: str) -> list[str]:
    """The names function `function` of `path` calls: `f(...)` as "f", `x.f(...)` as "x.f"."""
    body = next(node for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.FunctionDef) and node.name == function)
    found = []
    for node in ast.walk(body):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                found.append(func.id)
            elif isinstance(func, ast.Attribute):
                owner = func.value.id if isinstance(func.value, ast.Name) else \
                    func.value.attr if isinstance(func.value, ast.Attribute) else "?"
                found.append(f"{owner}.{func.attr}")
    return found


@pytest.mark.parametrize("module, function", [("train/trainer.py", "train_step"),
                                              ("plan/simulate_step.py", "measure_step"),
                                              ("plan/simulate_pipeline.py", "measure_pipeline_step")])
def test_the_trainer_and_the_simulator_run_one_step(module, function):
    """One step: the trainer, --simulate's whole-model rank and its pipeline rank call
    step/training_step.py; none of them steps the optimizer, clips or goes backward by
    itself, so a change to the step cannot miss the simulator."""
    called = calls_in(PACKAGE / module, function)
    assert "training_step" in called
    by_hand = {"optimizer.step", "self.optimizer.step", "clip_grad_norm_", "loss.backward", "passes.train"}
    assert not by_hand & set(called), called
