from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from statemachines import WorkerLifecycle
from tests.helpers.fixtures import dynamo_env, frontend, model_dir

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["dynamo_env", "frontend", "model_dir", "worker_model"]


@pytest.fixture
def worker_model() -> Iterator[WorkerLifecycle]:
    """A worker lifecycle model, taken out of the machine's counts afterwards."""
    model = WorkerLifecycle()
    yield model
    model.forget()
