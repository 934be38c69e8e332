"""The live state feed: lifecycle transitions collected by observers, broadcast to subscribers in JSON batches.

Theory of operation
-------------------

Observers of the machines (``WORKER``, ``REQUEST``) are synchronous callbacks running inside a transition: they must
never await and never take long. :meth:`StateFeed._observe` therefore only appends a tuple to a bounded ``deque``
-- and not even that while nobody is subscribed. A flusher task (:meth:`StateFeed.run`) wakes every ``interval_s``
(50 ms), encodes what accumulated as **one** JSON message, and offers it to every subscriber's bounded queue with
``send_nowait``. A subscriber whose queue is full is a slow consumer: it is dropped (its queue closed, its websocket
closed with 1013 "try again later") instead of making the worker wait or buffer without bound. When more events
arrive between two flushes than the pending buffer holds, the oldest are discarded and counted in ``lost``; every
message carries the full per-state counts, so a client is exact again after any loss.

Messages (one JSON object each)::

    {"type": "snapshot", "seq": 41, "time": ..., "worker": {"state": "serving", "reason": "..."},
     "counts": {"worker": {...}, "request": {...}}, "machines": [...static tables...], "lost": 0}
    {"type": "events", "first_seq": 42, "last_seq": 44, "lost": 0, "worker": {...}, "counts": {...},
     "events": [{"seq": 42, "t": 1767000000.123, "machine": "request", "id": "req-1", "event": "submit",
                 "from": "received", "to": "submitted", "reason": null}, ...]}

``seq`` numbers every transition of every machine in the order they happened; a subscriber gets exactly the events
after its snapshot's ``seq``, in order. ``counts`` are the machines' own (:meth:`MachineKind.counts`): current for
non-terminal states, totals since start for terminal ones.
"""

from __future__ import annotations

import json
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Final

import trio

from statemachines import KINDS

from .page import machine_model

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from statemachines import Lifecycle, MachineKind, WorkerLifecycle

__all__ = ["DEFAULT_INTERVAL_S", "StateFeed", "Subscription"]

DEFAULT_INTERVAL_S: Final = 0.05
DEFAULT_MAX_PENDING: Final = 10_000
DEFAULT_CLIENT_QUEUE: Final = 64

# (seq, unix time, machine, model id, event, source, dest, reason)
_Event = tuple[int, float, str, str, str, str, str, str | None]


class Subscription:
    """One subscriber: the snapshot it started from, and a bounded queue of encoded messages."""

    def __init__(self, feed: StateFeed, snapshot: dict[str, Any], queue_size: int) -> None:
        self._feed = feed
        self.snapshot = snapshot
        self.after_seq: int = snapshot["seq"]
        send, receive = trio.open_memory_channel[str](queue_size)
        self._send: trio.MemorySendChannel[str] = send
        self.messages: trio.MemoryReceiveChannel[str] = receive
        self.dropped: str | None = None
        """Why the feed dropped this subscriber (``None`` while subscribed)."""

    def close(self) -> None:
        """Unsubscribe (idempotent); ``messages`` ends after what is queued."""
        self._feed._subscribers.discard(self)
        self._send.close()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StateFeed:
    """Collects transitions of ``kinds`` and broadcasts them; see the module docstring.

    Use: ``feed.install()`` (adds the observers), ``nursery.start(feed.run)``, then ``with feed.subscribe() as sub:
    async for message in sub.messages: ...``; ``feed.uninstall()`` removes the observers.
    """

    def __init__(
        self,
        kinds: Sequence[MachineKind[Any, Any, Any]] = KINDS,
        *,
        worker: WorkerLifecycle | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        max_pending: int = DEFAULT_MAX_PENDING,
        client_queue: int = DEFAULT_CLIENT_QUEUE,
    ) -> None:
        self.kinds = tuple(kinds)
        self.worker = worker
        """The worker model whose state the snapshot reports (else: the non-terminal worker state with a count)."""
        self.interval_s = interval_s
        self.client_queue = client_queue
        self._pending: deque[_Event] = deque(maxlen=max_pending)
        self._seq = 0
        self._lost = 0
        self._lost_total = 0
        self._subscribers: set[Subscription] = set()
        self._observers: list[tuple[MachineKind[Any, Any, Any], Callable[..., None]]] = []
        self._machines = [machine_model(kind) for kind in self.kinds]

    # -- observers (sync, inside transitions) --------------------------------------------------------------------------

    def install(self) -> None:
        """Add one observer per machine kind (idempotent)."""
        if self._observers:
            return
        for kind in self.kinds:
            observer = self._observer_for(kind.name)
            kind.observers.append(observer)
            self._observers.append((kind, observer))

    def uninstall(self) -> None:
        """Remove the observers added by :meth:`install`."""
        for kind, observer in self._observers:
            if observer in kind.observers:
                kind.observers.remove(observer)
        self._observers.clear()

    def _observer_for(self, machine: str) -> Callable[[Lifecycle[Any, Any], str, str, str], None]:
        def observe(model: Lifecycle[Any, Any], event: str, source: str, dest: str) -> None:
            self._seq += 1
            if not self._subscribers:
                return
            if len(self._pending) == self._pending.maxlen:
                self._lost += 1
            ident = getattr(model, "request_id", None) or machine
            self._pending.append((self._seq, time.time(), machine, ident, event, source, dest, model.reason))

        return observe

    # -- state ---------------------------------------------------------------------------------------------------------

    @property
    def seq(self) -> int:
        """Number of transitions observed so far."""
        return self._seq

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def counts(self) -> dict[str, dict[str, int]]:
        return {kind.name: dict(kind.counts()) for kind in self.kinds}

    def worker_state(self) -> dict[str, Any] | None:
        if self.worker is not None:
            return {"state": self.worker.state, "reason": self.worker.reason}
        for kind in self.kinds:
            if kind.name == "worker":
                for state, count in kind.counts().items():
                    if count and state not in kind.terminal:
                        return {"state": state, "reason": None}
        return None

    def snapshot(self) -> dict[str, Any]:
        """The current state of every machine (what a subscriber starts from)."""
        return {
            "type": "snapshot",
            "seq": self._seq,
            "time": time.time(),
            "worker": self.worker_state(),
            "counts": self.counts(),
            "machines": self._machines,
            "lost": self._lost_total,
        }

    # -- subscribers ---------------------------------------------------------------------------------------------------

    def subscribe(self, queue_size: int | None = None) -> Subscription:
        """A new subscriber; its ``snapshot`` is taken now, its queue receives every later batch."""
        sub = Subscription(self, self.snapshot(), queue_size or self.client_queue)
        self._subscribers.add(sub)
        return sub

    def _drop(self, sub: Subscription, why: str) -> None:
        sub.dropped = why
        sub.close()

    # -- the flusher ---------------------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Flush every ``interval_s`` until cancelled."""
        task_status.started()
        while True:
            await trio.sleep(self.interval_s)
            self.flush()

    def flush(self) -> int:
        """Offer what accumulated to every subscriber now; returns the number of events sent."""
        if not self._pending and not self._lost:
            return 0
        events = list(self._pending)
        self._pending.clear()
        lost, self._lost = self._lost, 0
        self._lost_total += lost
        if not self._subscribers:
            return 0
        counts, worker = self.counts(), self.worker_state()
        encoded: dict[int, str] = {}  # by index of the first event a subscriber has not seen
        for sub in list(self._subscribers):
            start = 0
            while start < len(events) and events[start][0] <= sub.after_seq:
                start += 1
            if start == len(events) and not lost:
                continue
            message = encoded.get(start)
            if message is None:
                message = encoded[start] = _encode(events[start:], lost, counts, worker)
            try:
                sub._send.send_nowait(message)
            except trio.WouldBlock:
                self._drop(sub, "slow consumer: its queue of updates is full")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                sub.close()
            else:
                sub.after_seq = events[-1][0] if events else sub.after_seq
        return len(events)


def _encode(
    events: Sequence[_Event], lost: int, counts: dict[str, dict[str, int]], worker: dict[str, Any] | None
) -> str:
    return json.dumps(
        {
            "type": "events",
            "first_seq": events[0][0] if events else None,
            "last_seq": events[-1][0] if events else None,
            "lost": lost,
            "worker": worker,
            "counts": counts,
            "events": [
                {"seq": s, "t": round(t, 6), "machine": m, "id": i, "event": e, "from": a, "to": b, "reason": r}
                for s, t, m, i, e, a, b, r in events
            ],
        },
        separators=(",", ":"),
    )
