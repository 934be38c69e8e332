from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from .helpers import AnyKind, AnyModel

Transition = tuple["AnyModel", str, str, str]


class Recorder:
    """Observer that records ``(model, event, source, dest)``; the tests' stand-in for a per-request history."""

    def __init__(self) -> None:
        self.calls: list[Transition] = []

    def __call__(self, model: AnyModel, event: str, source: str, dest: str) -> None:
        self.calls.append((model, event, source, dest))

    def of(self, model: AnyModel) -> list[tuple[str, str, str]]:
        return [(event, source, dest) for (m, event, source, dest) in self.calls if m is model]


@pytest.fixture
def observe() -> Iterator[Callable[[AnyKind, Callable[..., Any]], None]]:
    """Attach observers to a kind for one test; they are removed afterwards even if the test fails."""
    added: list[tuple[AnyKind, Callable[..., Any]]] = []

    def add(kind: AnyKind, observer: Callable[..., Any]) -> None:
        kind.observers.append(observer)
        added.append((kind, observer))

    yield add
    for kind, observer in added:
        if observer in kind.observers:
            kind.observers.remove(observer)


@pytest.fixture
def recorder(observe: Callable[[AnyKind, Callable[..., Any]], None]) -> Recorder:
    """A :class:`Recorder` attached to every kind under test."""
    from .helpers import KINDS_UNDER_TEST

    rec = Recorder()
    for kind in KINDS_UNDER_TEST:
        observe(kind, rec)
    return rec
