"""Firing events: every legal edge, every illegal pair, no-ops, observers, reasons, counts."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import pytest

from statemachines import (
    REQUEST,
    WORKER,
    IllegalTransition,
    RequestLifecycle,
    StateMachineError,
    WorkerLifecycle,
)

from .helpers import (
    KINDS_UNDER_TEST,
    AnyKind,
    AnyModel,
    edge_cases,
    illegal_cases,
    model_in,
    new_model,
    no_op_cases,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from statemachines import RequestEvent, RequestState, WorkerEvent

    from .conftest import Recorder

    Observe = Callable[[AnyKind, Callable[..., Any]], None]


def _id(case: Any) -> str:
    return str(case.name) if hasattr(case, "name") else str(case)


@pytest.mark.parametrize(("kind", "source", "event", "dest"), edge_cases(), ids=_id)
def test_every_legal_edge(kind: AnyKind, source: str, event: str, dest: str, recorder: Recorder) -> None:
    model = model_in(kind, source)
    recorder.calls.clear()
    before = kind.counts()
    assert model.fire(event, reason=f"because {event}") is True
    assert model.state == dest
    assert model.reason == f"because {event}"
    assert model.is_terminal == (dest in kind.terminal)
    assert recorder.of(model) == [(event, source, dest)]
    after = kind.counts()
    assert after[source] == before[source] - 1
    assert after[dest] == before[dest] + 1


@pytest.mark.parametrize(("kind", "state", "event"), illegal_cases(), ids=_id)
def test_every_illegal_pair_raises_and_changes_nothing(
    kind: AnyKind, state: str, event: str, recorder: Recorder
) -> None:
    model = model_in(kind, state)
    reason_before = model.reason
    recorder.calls.clear()
    before = kind.counts()
    assert not model.may_fire(event)
    with pytest.raises(IllegalTransition) as info:
        model.fire(event, reason="should not stick")
    assert (info.value.kind, info.value.event, info.value.state) == (kind.name, event, state)
    assert str(info.value) == f"{kind.name}: event {event!r} is not allowed in state {state!r}"
    assert model.state == state
    assert model.reason == reason_before
    assert kind.counts() == before
    assert recorder.calls == []
    # The shared machine is left clean for the next model.
    assert kind.machine.models == []


@pytest.mark.parametrize(("kind", "state", "event"), no_op_cases(), ids=_id)
def test_documented_no_ops_change_nothing(kind: AnyKind, state: str, event: str, recorder: Recorder) -> None:
    model = model_in(kind, state)
    reason_before = model.reason
    recorder.calls.clear()
    before = kind.counts()
    assert model.fire(event, reason="late") is False
    assert not model.may_fire(event)
    assert (model.state, model.reason) == (state, reason_before)
    assert kind.counts() == before
    assert recorder.calls == []


@pytest.mark.parametrize("kind", KINDS_UNDER_TEST, ids=_id)
def test_unknown_event_is_illegal(kind: AnyKind) -> None:
    model = new_model(kind)
    with pytest.raises(IllegalTransition, match="'bogus'"):
        model.fire("bogus")
    assert model.state == kind.initial


def test_illegal_transition_is_a_state_machine_error() -> None:
    assert issubclass(IllegalTransition, StateMachineError)
    assert issubclass(StateMachineError, Exception)


def test_request_happy_path_and_history_through_an_observer(recorder: Recorder) -> None:
    req = RequestLifecycle("req-1")
    assert (req.state, req.reason, req.request_id) == ("received", None, "req-1")
    req.fire("submit")
    req.fire("first_token")
    req.fire("finish", reason="stop")
    assert recorder.of(req) == [
        ("submit", "received", "submitted"),
        ("first_token", "submitted", "streaming"),
        ("finish", "streaming", "finished"),
    ]
    assert (req.state, req.reason) == ("finished", "stop")
    assert req.fire("cancel", reason="client went away") is False  # the finished result stands
    assert (req.state, req.reason) == ("finished", "stop")
    assert repr(req) == "<RequestLifecycle req-1 finished>"


def test_worker_survives_the_engine(recorder: Recorder) -> None:
    worker = WorkerLifecycle()
    start: tuple[WorkerEvent, ...] = ("connect", "connected", "discovered", "ready", "registered")
    for event in start:
        worker.fire(event)
    assert (worker.state, worker.reason) == ("serving", None)
    worker.fire("degrade", reason="health NOT_READY")
    assert (worker.state, worker.reason) == ("degraded", "health NOT_READY")
    worker.fire("recover")
    assert (worker.state, worker.reason) == ("registering", None)  # the reason describes the current state
    worker.fire("registered")
    worker.fire("engine_lost", reason="UNAVAILABLE")
    worker.fire("reconnected")
    rediscover: tuple[WorkerEvent, ...] = ("discovered", "ready", "registered")
    for event in rediscover:
        worker.fire(event)
    worker.fire("drain", reason="SIGTERM")
    assert worker.fire("drain", reason="SIGTERM again") is False
    assert (worker.state, worker.reason) == ("draining", "SIGTERM")
    worker.fire("drained")
    assert (worker.state, worker.reason) == ("stopped", None)
    assert [dest for _, _, dest in recorder.of(worker)] == [
        "connecting", "discovering", "waiting_ready", "registering", "serving",
        "degraded", "registering", "serving",
        "reconnecting", "discovering", "waiting_ready", "registering", "serving",
        "draining", "stopped",
    ]  # fmt: skip


@pytest.mark.parametrize("seed", range(200))
def test_random_walks_always_end_in_a_terminal_state(seed: int, recorder: Recorder) -> None:
    """Random legal events from the initial state; after 30 steps the walk is ended by `fail`, always legal."""
    rng = random.Random(seed)
    kind = KINDS_UNDER_TEST[seed % len(KINDS_UNDER_TEST)]
    model = new_model(kind)
    for _ in range(30):
        if model.is_terminal:
            break
        legal = [event for event in kind.events if model.may_fire(event)]
        assert legal
        model.fire(rng.choice(legal))
    if not model.is_terminal:
        model.fire("fail", reason="walk over")
    assert model.state in kind.terminal
    steps = recorder.of(model)
    assert [source for _, source, _ in steps] == [kind.initial, *[dest for _, _, dest in steps[:-1]]]
    assert all(not model.may_fire(event) for event in kind.events)


# -- observers -------------------------------------------------------------------------------------------------------


def test_observers_run_in_order_after_the_state_changed(observe: Observe) -> None:
    seen: list[tuple[str, str, str, str | None, str]] = []

    def first(model: AnyModel, event: str, source: str, dest: str) -> None:
        seen.append(("first", event, model.state, model.reason, dest))

    def second(model: AnyModel, event: str, source: str, dest: str) -> None:
        seen.append(("second", event, model.state, model.reason, dest))

    observe(REQUEST, first)
    observe(REQUEST, second)
    req = RequestLifecycle("r")
    req.fire("submit", reason="opened")
    assert seen == [
        ("first", "submit", "submitted", "opened", "submitted"),
        ("second", "submit", "submitted", "opened", "submitted"),
    ]


def test_observers_of_one_kind_do_not_see_the_other(recorder: Recorder) -> None:
    worker = WorkerLifecycle()
    req = RequestLifecycle("r")
    worker.fire("connect")
    req.fire("reject", reason="bad option")
    assert [type(model) for model, *_ in recorder.calls] == [WorkerLifecycle, RequestLifecycle]


def test_every_observer_runs_even_when_one_raises(observe: Observe, recorder: Recorder) -> None:
    def broken(model: AnyModel, event: str, source: str, dest: str) -> None:
        raise RuntimeError(f"observer bug on {event}")

    observe(REQUEST, broken)
    observe(REQUEST, broken)
    late = len(REQUEST.observers)
    observe(REQUEST, recorder)  # registered after the broken ones
    assert REQUEST.observers[late] is recorder
    req = RequestLifecycle("r")
    with pytest.raises(RuntimeError, match="observer bug on submit") as info:
        req.fire("submit")
    assert any("another observer also raised" in note for note in info.value.__notes__)
    assert req.state == "submitted"  # the change happened; the observer error is reported, not undone
    assert ("submit", "received", "submitted") in recorder.of(req)
    # The shared machine's queue was cleared: the next event on any model works.
    other = RequestLifecycle("other")
    REQUEST.observers.remove(broken)
    REQUEST.observers.remove(broken)
    assert other.fire("submit") is True


def test_an_observer_may_remove_itself(observe: Observe) -> None:
    calls: list[str] = []

    def once(model: AnyModel, event: str, source: str, dest: str) -> None:
        calls.append(event)
        REQUEST.observers.remove(once)

    observe(REQUEST, once)
    req = RequestLifecycle("r")
    req.fire("submit")
    req.fire("first_token")
    assert calls == ["submit"]


def test_an_observer_firing_its_own_model_is_deferred_until_the_change_completes(
    observe: Observe, recorder: Recorder
) -> None:
    during: list[tuple[str, bool]] = []

    def finish_on_stream(model: AnyModel, event: str, source: str, dest: str) -> None:
        if dest == "streaming":
            during.append((model.state, model.fire("finish", reason="nested")))
            during.append((model.state, True))

    observe(REQUEST, finish_on_stream)
    req = RequestLifecycle("r")
    req.fire("submit")
    req.fire("first_token")
    # Inside the observer the nested event was only queued; it ran once the outer transition had finished.
    assert during == [("streaming", True), ("streaming", True)]
    assert (req.state, req.reason) == ("finished", "nested")
    assert recorder.of(req)[-2:] == [("first_token", "submitted", "streaming"), ("finish", "streaming", "finished")]


def test_deferred_events_are_checked_against_the_state_they_run_in(observe: Observe, recorder: Recorder) -> None:
    def two_terminals(model: AnyModel, event: str, source: str, dest: str) -> None:
        if dest == "submitted":
            assert model.fire("finish") is True  # deferred
            assert model.fire("cancel") is True  # deferred; a documented no-op once 'finish' has run
            assert model.fire("first_token") is True  # deferred; illegal once 'finish' has run

    observe(REQUEST, two_terminals)
    req = RequestLifecycle("r")
    with pytest.raises(IllegalTransition) as info:
        req.fire("submit")
    assert (info.value.event, info.value.state) == ("first_token", "finished")
    assert req.state == "finished"
    assert [event for event, _, _ in recorder.of(req)] == ["submit", "finish"]
    REQUEST.observers.remove(two_terminals)
    assert RequestLifecycle("next").fire("submit") is True  # the deferred queue was cleared


def test_an_observer_error_drops_deferred_events(observe: Observe) -> None:
    def defer_then_raise(model: AnyModel, event: str, source: str, dest: str) -> None:
        if dest == "submitted":
            model.fire("first_token")
            raise RuntimeError("observer bug")

    observe(REQUEST, defer_then_raise)
    req = RequestLifecycle("r")
    with pytest.raises(RuntimeError, match="observer bug"):
        req.fire("submit")
    assert req.state == "submitted"
    REQUEST.observers.remove(defer_then_raise)
    assert req.fire("first_token") is True


# -- counts ----------------------------------------------------------------------------------------------------------


def _expected(kind: AnyKind, models: list[AnyModel]) -> dict[str, int]:
    expected = dict.fromkeys(kind.states, 0)
    for model in models:
        expected[model.state] += 1
    return expected


@pytest.mark.parametrize("kind", KINDS_UNDER_TEST, ids=_id)
def test_counts_per_state_across_many_models(kind: AnyKind) -> None:
    rng = random.Random(7)
    before = kind.counts()
    models = [new_model(kind) for _ in range(500)]
    for model in models:
        for _ in range(rng.randrange(8)):
            legal = [event for event in kind.events if model.may_fire(event)]
            if not legal:
                break
            model.fire(rng.choice(legal))
    after = kind.counts()
    delta = {state: after[state] - before[state] for state in kind.states}
    assert delta == _expected(kind, models)
    active_delta = sum(n for state, n in delta.items() if state not in kind.terminal)
    # Dropping the models changes nothing: terminal counts are totals, the rest are gauges of models never ended.
    del models
    assert kind.counts() == after
    assert active_delta >= 0


def test_terminal_counts_are_totals_and_live_counts_are_gauges() -> None:
    before = REQUEST.counts()
    active_before = REQUEST.active()
    reqs = [RequestLifecycle(f"r{i}") for i in range(10)]
    assert REQUEST.active() == active_before + 10
    for req in reqs:
        req.fire("submit")
        req.fire("finish")
    after = REQUEST.counts()
    assert after["finished"] == before["finished"] + 10
    assert after["received"] == before["received"]
    assert after["submitted"] == before["submitted"]
    assert REQUEST.active() == active_before


def test_forget_takes_an_abandoned_model_out_of_the_gauges() -> None:
    before, abandoned = REQUEST.counts(), REQUEST.abandoned
    req = RequestLifecycle("lost")
    req.fire("submit")
    req.forget()
    req.forget()  # idempotent
    assert REQUEST.counts() == before
    assert REQUEST.abandoned == abandoned + 1
    req.fire("first_token")  # still usable, no longer counted
    assert REQUEST.counts() == before

    done = RequestLifecycle("done")
    done.fire("reject")
    with_total = REQUEST.counts()
    done.forget()  # a terminal model stays in its total
    assert REQUEST.counts() == with_total
    assert REQUEST.abandoned == abandoned + 1


def test_typed_observer_signature() -> None:
    """Mypy checks this: an observer typed for requests fits REQUEST.observers."""
    seen: list[tuple[RequestEvent, RequestState]] = []

    def observer(model: RequestLifecycle, event: RequestEvent, source: RequestState, dest: RequestState) -> None:
        seen.append((event, dest))

    REQUEST.observers.append(observer)
    try:
        RequestLifecycle("typed").fire("submit")
    finally:
        REQUEST.observers.remove(observer)
    assert seen == [("submit", "submitted")]
    assert WORKER.observers == []
