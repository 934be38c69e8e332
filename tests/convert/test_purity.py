"""``sidecar.convert`` is pure: no I/O libraries, no event loops, no Dynamo (architecture.md, rooms table)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sidecar.convert

FORBIDDEN = {"trio", "asyncio", "grpclib", "dynamo", "uvloop", "socket", "subprocess", "threading", "os"}
SOURCES = sorted(Path(sidecar.convert.__file__).parent.glob("*.py"))


@pytest.mark.parametrize("source", SOURCES, ids=[source.name for source in SOURCES])
def test_no_forbidden_imports(source: Path) -> None:
    tree = ast.parse(source.read_text(), filename=str(source))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    assert imported & FORBIDDEN == set()


def test_sources_found() -> None:
    assert {source.name for source in SOURCES} >= {
        "structjson.py",
        "enums.py",
        "capabilities.py",
        "request.py",
        "response.py",
    }
