"""The rooms of ``docs/architecture.md`` import each other without cycles.

Every import counts, those under ``TYPE_CHECKING`` included: a cycle there still means two rooms know each other
(the configuration once lived in the CLI, so ``cli → worker → startup → cli`` closed a loop). An import of a package
counts as an import of its ``__init__``; a package's ``__init__`` re-exporting its own private modules is the one
allowed way back, so edges from a private submodule to its own package are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sidecar
import statemachines

ROOTS = (Path(sidecar.__file__).parent, Path(statemachines.__file__).parent)
TOP = {"sidecar", "statemachines"}


def _module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for root in ROOTS:
        for path in root.rglob("*.py"):
            if "testing" in path.relative_to(root).parts:
                continue  # openengine-mock runs in its own process; production code never imports it
            found[_module_name(path, root)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module or ""
                targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            for target in targets:
                if target.split(".")[0] not in TOP:
                    continue
                resolved = _resolve(target, modules)
                if resolved is None or resolved == name:
                    continue
                if name.rpartition(".")[2].startswith("_") and name.startswith(resolved + "."):
                    continue  # a private module importing its own package: the package re-exports it
                graph[name].add(resolved)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_modules_found() -> None:
    graph = _graph()
    assert {"sidecar.cli", "sidecar.config", "sidecar.worker", "statemachines.worker"} <= graph.keys()
    assert "sidecar.config" in graph["sidecar.worker"]


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_cycle_detector_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_configuration_is_read_not_the_cli() -> None:
    graph = _graph()
    importers = sorted(name for name, targets in graph.items() if "sidecar.cli" in targets)
    # ops.guide renders the operator guide's flag tables from the parser itself.
    assert importers == ["sidecar.__main__", "sidecar.ops.guide"]
