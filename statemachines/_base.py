"""The shared machinery every lifecycle kind is built from.

Theory of operation
-------------------

A *kind* (``worker``, ``request``, ...) is one module of tables -- ``STATES``, ``TRANSITIONS``, ``TERMINAL``,
``NO_OPS``, ``STATE_DOCS`` -- turned into one :class:`MachineKind` at import time.  The kind owns exactly one
plain, synchronous :class:`transitions.Machine` built with ``model=None, queued=True, auto_transitions=False``.
Models are small ``__slots__`` objects (subclasses of :class:`Lifecycle`) that are **never** ``add_model``'d: an
event is fired with ``machine.events[name].trigger(model)``, which is exactly what ``add_model`` would have bound,
so there is nothing to register, nothing to unregister and nothing that can leak -- a dropped model is freed by
reference counting alone.

Why the checks live here and not in ``transitions``:

* With ``queued=True`` a trigger always returns ``True``, so its result says nothing.  :meth:`Lifecycle.fire`
  therefore looks the ``(state, event)`` pair up in :attr:`MachineKind.edges` (a dict compiled from the
  table) *before* triggering.  An illegal pair raises :class:`IllegalTransition` and changes nothing; a pair listed
  in the kind's ``NO_OPS`` table is a documented idempotent no-op and returns ``False``.  We never use
  ``ignore_invalid_triggers``: an illegal edge is a bug and must be loud.
* Tables are plain data (no conditions, no callbacks): every ``(state, event)`` has at most one destination, which
  is what makes the dict pre-check exact and lets a compiled fast path be generated later if ever needed.

Observers.  After every state change the machine calls :meth:`MachineKind._after_state_change` (the one
``after_state_change`` callback, ``send_event=True``), which stores the transition's ``reason`` on the model,
updates the per-state counts, then calls every callable in :attr:`MachineKind.observers` as
``observer(model, event, source, dest)``.  Observers are synchronous and must not block: the sidecar uses them to
set a trio ``Event``, bump a metric, log a line, feed the live state view.  Every observer runs even when an earlier
one raises; the first exception is then re-raised out of ``fire()`` (the state change has already happened).
An observer may fire events on *its own* model only.  Such a nested event is deferred until the current
transition has finished (``fire()`` returns ``True`` at once) -- the semantics of ``queued=True``, but kept in
``fire()``'s own per-kind queue so that the deferred event is checked (illegal, no-op) against the state it will
actually run in, and an :class:`IllegalTransition` names the right event.  Firing another model of the same kind
from an observer is forbidden: the queue is shared by the kind, and an exception would silently drop the other
model's deferred event.

Counts.  Each kind keeps a ``Counter`` of models per state: creating a model counts its initial state, every
change moves one count from source to dest.  Non-terminal counts are therefore *current* gauges, terminal counts
are *cumulative totals* since process start (a terminal state has no way out, so its count only grows; it is a
number, not a list, so nothing grows without bound).  A model dropped in a non-terminal state would inflate a gauge
forever; :meth:`Lifecycle.forget` takes it out and counts it in :attr:`MachineKind.abandoned` instead.

This module imports only ``transitions`` and the standard library: no trio, asyncio, grpclib, dynamo or
``sidecar``.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, cast

from transitions import Machine

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Mapping, Sequence

    # TransitionConfigDict exists only in the .pyi stubs; importing it at runtime raises ImportError.
    from transitions.core import EventData, Transition, TransitionConfigDict

__all__ = [
    "IllegalTransition",
    "Lifecycle",
    "MachineKind",
    "StateDoc",
    "StateMachineError",
]

M = TypeVar("M", bound="Lifecycle[Any, Any]")
S = TypeVar("S", bound=str)
E = TypeVar("E", bound=str)


class StateMachineError(Exception):
    """Base class of every error raised by :mod:`statemachines`."""


class IllegalTransition(StateMachineError):
    """``event`` is not allowed in ``state`` for machine ``kind``; the model was left unchanged."""

    def __init__(self, kind: str, event: str, state: str) -> None:
        super().__init__(kind, event, state)
        self.kind = kind
        self.event = event
        self.state = state

    def __str__(self) -> str:
        return f"{self.kind}: event {self.event!r} is not allowed in state {self.state!r}"


@dataclass(frozen=True, slots=True)
class StateDoc:
    """Operator documentation of one state; rendered into ``docs/state-machines.md``."""

    meaning: str
    """What is true about the worker/request while it is in this state."""
    operator_sees: str
    """What an operator observes: logs, metrics, health endpoints, client responses."""
    action: str
    """What an operator should do about it (``"nothing"`` is a valid answer)."""


_TRANSITION_KEYS = frozenset({"trigger", "source", "dest"})


class MachineKind(Generic[M, S, E]):
    """One lifecycle kind: its tables, its single shared ``transitions.Machine``, observers and live counts.

    Built once at import time by the kind's module (``statemachines.worker.WORKER``,
    ``statemachines.request.REQUEST``).  Raises ``ValueError`` at import if the tables are inconsistent.
    """

    def __init__(
        self,
        name: str,
        *,
        states: Sequence[S],
        transitions: Sequence[TransitionConfigDict],
        initial: S,
        terminal: Collection[S],
        no_ops: Mapping[tuple[S, E], str],
        docs: Mapping[S, StateDoc],
        summary: str,
    ) -> None:
        self.name = name
        self.summary = summary
        self.states: tuple[S, ...] = tuple(states)
        self.transitions: tuple[TransitionConfigDict, ...] = tuple(transitions)
        self.initial: S = initial
        self.terminal: frozenset[S] = frozenset(terminal)
        self.no_ops: Mapping[tuple[S, E], str] = dict(no_ops)
        self.docs: Mapping[S, StateDoc] = dict(docs)
        self.edges: Mapping[tuple[S, E], S] = self._compile()
        self.events: tuple[E, ...] = tuple(dict.fromkeys(event for (_, event) in self.edges))
        self.observers: list[Callable[[M, E, S, S], None]] = []
        """Called as ``observer(model, event, source, dest)`` after every state change of every model of this kind."""
        self.abandoned = 0
        """Models taken out of a non-terminal count by :meth:`Lifecycle.forget` (should stay 0: a non-zero value
        means some code path dropped a model without bringing it to a terminal state)."""
        self._counts: Counter[str] = Counter(dict.fromkeys(self.states, 0))
        # Events fired from observers while a transition of this kind runs; see Lifecycle.fire().
        self._firing = False
        self._deferred: deque[tuple[Lifecycle[Any, Any], Any, str | None]] = deque()
        self.machine = Machine(
            model=None,
            states=list(self.states),
            transitions=list(self.transitions),
            initial=initial,
            auto_transitions=False,
            queued=True,
            send_event=True,
            after_state_change=self._after_state_change,
            name=name,
        )

    def __repr__(self) -> str:
        return f"<MachineKind {self.name}: {len(self.states)} states, {len(self.edges)} edges>"

    def _compile(self) -> dict[tuple[S, E], S]:
        """Check the tables and compile ``{(source, event): dest}``; every problem is a ``ValueError`` at import."""
        known = set(self.states)
        problems: list[str] = []
        if len(known) != len(self.states):
            problems.append("duplicate state names")
        if self.initial not in known:
            problems.append(f"initial state {self.initial!r} is not a state")
        if self.initial in self.terminal:
            problems.append("the initial state is terminal")
        problems += [f"terminal state {s!r} is not a state" for s in sorted(self.terminal - known)]
        if set(self.docs) != known:
            problems.append(f"STATE_DOCS keys differ from STATES: {sorted(set(self.docs) ^ known)}")
        edges: dict[tuple[S, E], S] = {}
        for entry in self.transitions:
            extra = set(entry) - _TRANSITION_KEYS
            if extra:
                # Conditions or callbacks would make the dict pre-check in fire() wrong: keep the tables pure data.
                problems.append(f"transition {entry!r} has keys other than trigger/source/dest: {sorted(extra)}")
            event = cast("E", entry["trigger"])
            raw_source = entry["source"]
            sources = [raw_source] if isinstance(raw_source, str | Enum) else list(raw_source)
            dest = cast("S", entry["dest"])
            if dest not in known:
                problems.append(f"{event!r}: destination {dest!r} is not a state")
            for source in (cast("S", s) for s in sources):
                if source not in known:
                    problems.append(f"{event!r}: source {source!r} is not a state")
                if source in self.terminal:
                    problems.append(f"{event!r}: terminal state {source!r} has an outgoing edge")
                if (source, event) in edges:
                    problems.append(f"{event!r} from {source!r} has two destinations")
                edges[(source, event)] = dest
        for state, event in self.no_ops:
            if state not in known:
                problems.append(f"no-op ({state!r}, {event!r}): not a state")
            if (state, event) in edges:
                problems.append(f"no-op ({state!r}, {event!r}) is also a transition")
            if event not in {e for (_, e) in edges}:
                problems.append(f"no-op ({state!r}, {event!r}): not an event of this machine")
        if problems:
            raise ValueError(f"{self.name} state machine tables are inconsistent: " + "; ".join(problems))
        return edges

    # -- live state view -------------------------------------------------------------------------------------------

    def counts(self) -> dict[S, int]:
        """Models per state, in table order: current for non-terminal states, cumulative totals for terminal ones."""
        counts = self._counts
        return {state: counts[state] for state in self.states}

    def active(self) -> int:
        """How many counted models are currently in a non-terminal state."""
        counts = self._counts
        return sum(counts[state] for state in self.states if state not in self.terminal)

    def allows(self, state: S, event: E) -> bool:
        """Whether ``event`` moves a model out of ``state`` (documented no-ops do not count)."""
        return (state, event) in self.edges

    # -- the single after_state_change callback ----------------------------------------------------------------------

    def _after_state_change(self, event_data: EventData) -> None:
        model = cast("M", event_data.model)
        transition = cast("Transition", event_data.transition)  # always set once a transition executes
        source = cast("S", transition.source)
        dest = cast("S", transition.dest)
        model.reason = event_data.kwargs.get("reason")
        if model._counted:
            self._counts[source] -= 1
            self._counts[dest] += 1
        if not self.observers:
            return
        event = cast("E", event_data.event.name)
        first_error: BaseException | None = None
        # Iterate over a copy: an observer may remove itself.
        for observer in tuple(self.observers):
            try:
                observer(model, event, source, dest)
            except Exception as err:  # every observer runs (a skipped one could leave a task waiting forever)
                if first_error is None:
                    first_error = err
                else:
                    first_error.add_note(f"another observer also raised: {err!r}")
        if first_error is not None:
            raise first_error


class Lifecycle(Generic[S, E]):
    """Base of every lifecycle model: a slotted object whose ``state`` the kind's shared machine moves.

    Subclasses set ``_kind`` and may add slots (the sidecar subclasses to attach a trio ``Event`` or a cancel
    scope).  Models are never registered with the machine, so they cost ~80 bytes and are freed by refcount alone.
    """

    __slots__ = ("__weakref__", "_counted", "reason", "state")

    _kind: ClassVar[MachineKind[Any, Any, Any]]

    state: S
    """The current state; changed only by :meth:`fire`."""
    reason: str | None
    """Why the model entered its current state (the ``reason=`` given to :meth:`fire`, else ``None``)."""
    _counted: bool

    def __init__(self) -> None:
        kind = self._kind
        self.state = kind.initial
        self.reason = None
        self._counted = True
        kind._counts[kind.initial] += 1

    def fire(self, event: E, reason: str | None = None) -> bool:
        """Apply ``event``; return ``True`` if the state changed, ``False`` for a documented idempotent no-op.

        ``reason`` is stored in :attr:`reason` and seen by observers (e.g. ``"health NOT_READY"``,
        ``"client disconnected"``).  Raises :class:`IllegalTransition` -- with the model unchanged -- when the
        event is not allowed in the current state.  Called from an observer, the event is deferred until the current
        transition has finished and ``True`` is returned at once; its legality is checked when it runs, and an error
        is raised out of the outer ``fire()``.
        """
        kind = self._kind
        if kind._firing:
            kind._deferred.append((self, event, reason))
            return True
        kind._firing = True
        try:
            changed = self._apply(event, reason)
            while kind._deferred:
                model, deferred_event, deferred_reason = kind._deferred.popleft()
                model._apply(deferred_event, deferred_reason)
        except BaseException:
            kind._deferred.clear()
            raise
        finally:
            kind._firing = False
        return changed

    def _apply(self, event: E, reason: str | None) -> bool:
        kind = self._kind
        state = self.state
        if (state, event) not in kind.edges:
            if (state, event) in kind.no_ops:
                return False
            raise IllegalTransition(kind.name, event, state)
        kind.machine.events[event].trigger(self, reason=reason)
        return True

    def may_fire(self, event: E) -> bool:
        """Whether ``event`` would change the state now (documented no-ops return ``False``)."""
        return (self.state, event) in self._kind.edges

    @property
    def is_terminal(self) -> bool:
        """Whether the model reached a terminal state (it will never change again)."""
        return self.state in self._kind.terminal

    def forget(self) -> None:
        """Stop counting this model; idempotent.

        For a model abandoned in a non-terminal state: its gauge is decremented and
        :attr:`MachineKind.abandoned` incremented.  A terminal model stays in its state's total.
        """
        if not self._counted:
            return
        self._counted = False
        kind = self._kind
        if self.state not in kind.terminal:
            kind._counts[self.state] -= 1
            kind.abandoned += 1

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.state}>"
