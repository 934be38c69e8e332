"""pytest fixtures over :mod:`tests.helpers.processes`. Import the ones you use into a ``conftest.py``::

    from tests.helpers.fixtures import dynamo_env, frontend, model_dir  # noqa: F401

``frontend`` defaults to ``--migration-limit 0``; parametrize it indirectly for another limit::

    @pytest.mark.parametrize("frontend", [3], indirect=True)
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from .processes import DynamoEnv, Frontend, start_frontend
from .processes import dynamo_env as _dynamo_env
from .tiny_model import committed_model_dir, write_tiny_model

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator


@pytest.fixture(scope="session")
def model_dir() -> Iterator[Path]:
    """A tokenizer-only model directory: ``sidecar/testing/mock/model/`` once it exists, else a throw-away one."""
    committed = committed_model_dir()
    if committed is not None:
        yield committed
        return
    with tempfile.TemporaryDirectory(prefix="tiny-model-") as tmp:
        yield write_tiny_model(Path(tmp) / "tiny")


@pytest.fixture
def dynamo_env() -> Iterator[DynamoEnv]:
    """A fresh loopback-only Dynamo environment (file discovery under a temp dir, removed afterwards)."""
    with _dynamo_env() as denv:
        yield denv


@pytest.fixture
async def frontend(request: pytest.FixtureRequest, dynamo_env: DynamoEnv) -> AsyncIterator[Frontend]:
    """The real ``python -m dynamo.frontend`` on a free loopback port (``--migration-limit`` from the param, else 0)."""
    limit = int(getattr(request, "param", 0))
    async with start_frontend(dynamo_env, migration_limit=limit) as fe:
        yield fe
