"""The HTTP/2 layer as a room: what it may import, that nothing else touches the libraries' internals, and that no
import of the project changes a library.

Imports are checked in fresh interpreters (``sys.modules`` of this test process already holds everything).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import sidecar
import sidecar.http2

SIDECAR = Path(sidecar.__file__).parent
LAYER = Path(sidecar.http2.__file__).parent
#: What the layer may import besides the standard library (and itself).
LAYER_MAY_IMPORT = frozenset({"grpclib", "h2", "hyperframe", "hpack", "multidict"})
#: Modules only the layer may import: grpclib's undocumented protocol module, h2's internals, hyperframe.
INTERNAL_MODULES = ("grpclib.protocol", "h2.stream", "h2.frame_buffer", "h2.windows", "hyperframe")


def _run(code: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False, cwd=SIDECAR.parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


_LIBRARIES_AS_DEFINED = """
import asyncio, collections, json, sys
import grpclib.protocol, hyperframe.frame
before = (hyperframe.frame.Frame.__repr__, grpclib.protocol.Event, grpclib.protocol.Queue, grpclib.protocol.deque)
{imports}
after = (hyperframe.frame.Frame.__repr__, grpclib.protocol.Event, grpclib.protocol.Queue, grpclib.protocol.deque)
print(json.dumps({{
    "unchanged": before == after,
    "as_defined": after[1:] == (asyncio.Event, asyncio.Queue, collections.deque)
        and after[0].__module__ == "hyperframe.frame",
    "modules": sorted(name for name in sys.modules if name.split(".")[0] in ("trio", "uvloop", "sidecar")),
}}))
"""


def _imported(imports: str) -> dict[str, object]:
    return _run(_LIBRARIES_AS_DEFINED.format(imports=imports))


def _files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def _top_level_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_layer_imports_only_its_libraries_and_the_standard_library() -> None:
    for path in _files(LAYER):
        outside = _top_level_imports(path) - LAYER_MAY_IMPORT - set(sys.stdlib_module_names) - {"__future__"}
        assert not outside, f"{path.relative_to(SIDECAR.parent)} imports {sorted(outside)}"


def test_the_layer_loads_without_trio_uvloop_or_the_rest_of_the_sidecar() -> None:
    result = _imported("import sidecar.http2")
    assert result["modules"] == [
        "sidecar",
        "sidecar.http2",
        *sorted(f"sidecar.http2.{name}" for name in ("_client", "_config", "_server", "_tunings")),
    ]
    assert result["unchanged"]


@pytest.mark.parametrize(
    "module", ["sidecar.engine", "sidecar.conformance", "sidecar.testing.mock.server", "sidecar.worker", "sidecar.cli"]
)
def test_importing_a_module_of_the_project_changes_no_library(module: str) -> None:
    result = _imported(f"import {module}")
    assert result["unchanged"], f"importing {module} patched grpclib or hyperframe"
    assert result["as_defined"]


def test_the_conformance_kit_loads_without_trio_and_sees_the_wire_unpatched() -> None:
    result = _imported("import sidecar.conformance._cli")
    modules = result["modules"]
    assert isinstance(modules, list)
    for room in ("trio", "uvloop", "sidecar.edge", "sidecar.engine"):
        assert not [m for m in modules if m == room or m.startswith(room + ".")], f"the kit loaded {room}"
    assert result["unchanged"]
    assert result["as_defined"]


def _internal_attribute_names() -> set[str]:
    """The underscored last parts of the internals the layer's docstring lists (``_frame_dispatch_table``, ...)."""
    from tests.http2.test_canaries import _listed

    names = {name.rsplit(".", 1)[1] for name in _listed()}
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_no_module_outside_the_layer_touches_library_internals() -> None:
    internal = _internal_attribute_names()
    problems: list[str] = []
    for path in _files(SIDECAR):
        if LAYER in path.parents:
            continue
        where = path.relative_to(SIDECAR.parent)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for module in modules:
                    if any(module == m or module.startswith(m + ".") for m in INTERNAL_MODULES):
                        problems.append(f"{where}:{node.lineno} imports {module}")
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LAYER_MAY_IMPORT:
                    problems += [f"{where}:{node.lineno} imports {a.name}" for a in node.names if a.name[0] == "_"]
            elif isinstance(node, ast.Attribute) and node.attr in internal:
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    problems.append(f"{where}:{node.lineno} touches .{node.attr}")
            elif isinstance(node, ast.keyword) and node.arg in internal:
                problems.append(f"{where} passes {node.arg}=")
    assert problems == []


def test_the_detector_sees_a_touch() -> None:
    assert "_frame_dispatch_table" in _internal_attribute_names()
    assert "_H2_TO_GRPC_STATUS_MAP" in _internal_attribute_names()
