"""Table-driven helpers shared by the state machine tests."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from statemachines import (
    KV_SUBSCRIPTION,
    LORA,
    REQUEST,
    WORKER,
    KvSubscriptionLifecycle,
    Lifecycle,
    LoraLifecycle,
    MachineKind,
    RequestLifecycle,
    WorkerLifecycle,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

AnyKind = MachineKind[Any, Any, Any]
AnyModel = Lifecycle[Any, Any]

FACTORIES: dict[str, Callable[[], AnyModel]] = {
    "worker": WorkerLifecycle,
    "request": lambda: RequestLifecycle("req-test"),
    "kv_subscription": lambda: KvSubscriptionLifecycle(0),
    "lora": lambda: LoraLifecycle("adapter-test"),
}
KINDS_UNDER_TEST: tuple[AnyKind, ...] = (WORKER, REQUEST, KV_SUBSCRIPTION, LORA)


def new_model(kind: AnyKind) -> AnyModel:
    return FACTORIES[kind.name]()


def successors(kind: AnyKind, state: str) -> Iterator[tuple[str, str]]:
    """``(event, dest)`` for every edge out of ``state``, in table order."""
    for (source, event), dest in kind.edges.items():
        if source == state:
            yield event, dest


def shortest_paths(kind: AnyKind) -> dict[str, list[str]]:
    """Breadth-first: for every reachable state, the shortest event sequence from the initial state."""
    paths: dict[str, list[str]] = {kind.initial: []}
    queue = deque([kind.initial])
    while queue:
        state = queue.popleft()
        for event, dest in successors(kind, state):
            if dest not in paths:
                paths[dest] = [*paths[state], event]
                queue.append(dest)
    return paths


def model_in(kind: AnyKind, state: str) -> AnyModel:
    """A fresh model driven to ``state`` through legal events only (never by assigning ``state``)."""
    model = new_model(kind)
    for event in shortest_paths(kind)[state]:
        assert model.fire(event) is True
    assert model.state == state
    return model


def edge_cases() -> list[tuple[AnyKind, str, str, str]]:
    return [(kind, source, event, dest) for kind in KINDS_UNDER_TEST for (source, event), dest in kind.edges.items()]


def illegal_cases() -> list[tuple[AnyKind, str, str]]:
    return [
        (kind, state, event)
        for kind in KINDS_UNDER_TEST
        for state in kind.states
        for event in kind.events
        if (state, event) not in kind.edges and (state, event) not in kind.no_ops
    ]


def no_op_cases() -> list[tuple[AnyKind, str, str]]:
    return [(kind, state, event) for kind in KINDS_UNDER_TEST for (state, event) in kind.no_ops]
