"""Fixtures for the edge tests: one fresh edge per test."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from sidecar.edge import Edge, open_edge

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


@pytest.fixture
async def edge() -> AsyncIterator[Edge]:
    async with open_edge(name="edge-under-test") as opened:
        yield opened
