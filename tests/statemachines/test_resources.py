"""Models are never registered with the shared machine: nothing leaks, and they are cheap."""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import weakref
from typing import TYPE_CHECKING

import pytest

from statemachines import REQUEST, WORKER, IllegalTransition, RequestLifecycle, WorkerLifecycle

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .conftest import Recorder


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """Refcounting only: a model that needs the cyclic collector to be freed is a leak for this test."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.mark.usefixtures("no_cyclic_gc")
def test_dropped_models_are_freed_by_refcount() -> None:
    refs: list[weakref.ref[RequestLifecycle]] = []
    for i in range(1000):
        req = RequestLifecycle(f"r{i}")
        req.fire("submit")
        if i % 3 == 0:
            req.fire("cancel")
            req.fire("cancel")  # no-op
        elif i % 3 == 1:
            req.fire("first_token")
            req.fire("finish")
        refs.append(weakref.ref(req))
    del req
    assert sum(ref() is not None for ref in refs) == 0
    assert REQUEST.machine.models == []


@pytest.mark.usefixtures("no_cyclic_gc")
def test_models_are_freed_with_observers_and_after_errors(recorder: Recorder) -> None:
    worker = WorkerLifecycle()
    worker.fire("connect")
    with contextlib.suppress(IllegalTransition):
        worker.fire("registered")
    worker.fire("fail", reason="test")
    ref = weakref.ref(worker)
    recorder.calls.clear()  # the recorder holds models on purpose; production observers do not
    del worker
    assert ref() is None
    assert WORKER.machine.models == []


def test_models_are_small() -> None:
    # state + reason + _counted + __weakref__ + request_id, no __dict__.
    assert not hasattr(RequestLifecycle("r"), "__dict__")
    assert sys.getsizeof(RequestLifecycle("r")) <= 96
    assert sys.getsizeof(WorkerLifecycle()) <= 96


def test_creating_10k_models_is_cheap() -> None:
    start = time.perf_counter()
    models = [RequestLifecycle(f"r{i}") for i in range(10_000)]
    elapsed = time.perf_counter() - start
    # ~5 ms on a slow VM; the bound only catches an accidental per-model Machine or add_model (~3-5 s).
    assert elapsed < 0.5, f"creating 10k models took {elapsed:.3f} s"
    for model in models:
        model.forget()


def test_transitions_cost_tens_of_microseconds() -> None:
    models = [RequestLifecycle(f"r{i}") for i in range(1000)]
    start = time.perf_counter()
    for model in models:
        model.fire("submit")
        model.fire("first_token")
        model.fire("finish")
    per_transition = (time.perf_counter() - start) / 3000
    # ~27 µs measured; a generous bound that still catches a per-transition O(models) cost.
    assert per_transition < 500e-6, f"{per_transition * 1e6:.0f} µs per transition"
