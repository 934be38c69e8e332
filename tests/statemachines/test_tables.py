"""The tables themselves: Literal types, documentation, terminal invariants, import rules, table validation."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import pytest

import statemachines
from statemachines import REQUEST, WORKER, MachineKind, StateDoc, request, worker

from .helpers import KINDS_UNDER_TEST, AnyKind, shortest_paths, successors

if TYPE_CHECKING:
    from transitions.core import TransitionConfigDict

PACKAGE_DIR = Path(statemachines.__file__).parent


@pytest.mark.parametrize(
    ("kind", "state_literal", "event_literal"),
    [(WORKER, worker.WorkerState, worker.WorkerEvent), (REQUEST, request.RequestState, request.RequestEvent)],
    ids=["worker", "request"],
)
def test_literals_match_the_machine(kind: AnyKind, state_literal: Any, event_literal: Any) -> None:
    assert set(get_args(event_literal)) == set(kind.machine.events) == set(kind.events)
    assert get_args(state_literal) == kind.states
    assert list(kind.machine.states) == list(kind.states)


def test_every_kind_is_listed() -> None:
    assert set(map(id, statemachines.KINDS)) == set(map(id, KINDS_UNDER_TEST))


@pytest.mark.parametrize("kind", KINDS_UNDER_TEST, ids=lambda kind: kind.name)
def test_shared_machine_configuration(kind: AnyKind) -> None:
    machine = kind.machine
    assert machine.has_queue  # queued=True
    assert not machine.auto_transitions
    assert machine.models == []  # model=None, and models are never registered
    assert not machine.ignore_invalid_triggers


@pytest.mark.parametrize("kind", KINDS_UNDER_TEST, ids=lambda kind: kind.name)
def test_every_state_is_documented(kind: AnyKind) -> None:
    assert list(kind.docs) == list(kind.states)
    for state, doc in kind.docs.items():
        assert isinstance(doc, StateDoc)
        assert all((doc.meaning, doc.operator_sees, doc.action)), state
    assert all(why for why in kind.no_ops.values())


@pytest.mark.parametrize("kind", KINDS_UNDER_TEST, ids=lambda kind: kind.name)
def test_every_state_is_reachable_and_every_path_can_end(kind: AnyKind) -> None:
    reachable = shortest_paths(kind)
    assert set(reachable) == set(kind.states)
    for state in kind.states:
        # Breadth-first from `state`: some terminal state must be reachable (no trap cycles).
        seen, frontier = {state}, [state]
        while frontier:
            frontier = [dest for s in frontier for _, dest in successors(kind, s) if dest not in seen]
            seen.update(frontier)
        assert seen & kind.terminal, f"{kind.name}: no terminal state reachable from {state!r}"


@pytest.mark.parametrize("kind", KINDS_UNDER_TEST, ids=lambda kind: kind.name)
def test_terminal_states_have_no_way_out(kind: AnyKind) -> None:
    assert kind.terminal
    assert not [edge for edge in kind.edges if edge[0] in kind.terminal]
    assert not [s for s in kind.states if s not in kind.terminal and not list(successors(kind, s))]


@pytest.mark.parametrize("kind", KINDS_UNDER_TEST, ids=lambda kind: kind.name)
def test_every_non_terminal_state_can_fail(kind: AnyKind) -> None:
    """Any exception while acting on a model fires `fail`, so it must be legal wherever the model can still move."""
    for state in kind.states:
        if state not in kind.terminal:
            assert kind.edges[(state, "fail")] == "failed"


def test_every_live_request_can_be_cancelled() -> None:
    """The request task's `finally` fires `cancel`: a transition before the end, a documented no-op after it."""
    for state in REQUEST.states:
        assert (state, "cancel") in (REQUEST.no_ops if state in REQUEST.terminal else REQUEST.edges)


def test_a_running_worker_can_always_be_drained() -> None:
    for state in WORKER.states:
        if state not in WORKER.terminal:
            assert (state, "drain") in WORKER.edges or (state, "drain") in WORKER.no_ops


def test_no_ops_are_only_for_repeated_shutdown_and_cancel() -> None:
    assert {event for _, event in WORKER.no_ops} == {"drain", "stop"}
    assert {event for _, event in REQUEST.no_ops} == {"cancel"}


# -- table validation: broken tables fail at import time -------------------------------------------------------------

_DOCS = {state: StateDoc("m", "s", "a") for state in ("a", "b", "done")}
_GOOD: list[TransitionConfigDict] = [
    {"trigger": "go", "source": "a", "dest": "b"},
    {"trigger": "end", "source": ["a", "b"], "dest": "done"},
]


def _kind(
    transitions: list[TransitionConfigDict] | None = None,
    *,
    terminal: tuple[str, ...] = ("done",),
    no_ops: dict[tuple[str, str], str] | None = None,
    docs: dict[str, StateDoc] | None = None,
    initial: str = "a",
) -> AnyKind:
    return MachineKind(
        "toy",
        states=("a", "b", "done"),
        transitions=_GOOD if transitions is None else transitions,
        initial=initial,
        terminal=terminal,
        no_ops=no_ops or {},
        docs=_DOCS if docs is None else docs,
        summary="toy",
    )


def test_a_consistent_toy_table_builds() -> None:
    kind = _kind(no_ops={("done", "end"): "repeated end"})
    assert kind.edges == {("a", "go"): "b", ("a", "end"): "done", ("b", "end"): "done"}
    assert kind.events == ("go", "end")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"transitions": [*_GOOD, {"trigger": "go", "source": "a", "dest": "done"}]}, "two destinations"),
        ({"transitions": [*_GOOD, {"trigger": "again", "source": "done", "dest": "a"}]}, "outgoing edge"),
        ({"transitions": [*_GOOD, {"trigger": "x", "source": "a", "dest": "nowhere"}]}, "not a state"),
        ({"transitions": [*_GOOD, {"trigger": "x", "source": "nowhere", "dest": "a"}]}, "not a state"),
        (
            {"transitions": [*_GOOD, {"trigger": "x", "source": "b", "dest": "a", "conditions": "ok"}]},
            "other than trigger/source/dest",
        ),
        ({"no_ops": {("a", "go"): "overlaps"}}, "also a transition"),
        ({"no_ops": {("done", "bogus"): "unknown event"}}, "not an event"),
        ({"docs": {"a": StateDoc("m", "s", "a")}}, "STATE_DOCS"),
        ({"terminal": ("done", "zzz")}, "terminal state 'zzz'"),
        ({"initial": "done"}, "initial state is terminal"),
    ],
)
def test_inconsistent_tables_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _kind(**kwargs)
