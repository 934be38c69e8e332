"""Push egress: a request's chunks go to Dynamo's ``ResponseSender`` from the loop while that cannot block, then
from threads of their own.

Dynamo 1.6.1 drives a handler whose signature names ``response_sender`` in *push* mode: it advances the handler's
async iterator once per request and takes every chunk from ``response_sender.send(chunk)``, which encodes the chunk
under the caller's GIL and puts it on the request's bounded channel (128 frames) to the frontend. On the *pull* path
(any other handler) Dynamo calls ``__anext__`` once per chunk from its tokio threads: two GIL acquisitions off the loop
and a loop wakeup per chunk, about 30 µs of CPU per chunk more on the reference machine (docs/architecture.md).

``send`` blocks while the request's channel is full, that is while its frontend does not read (a stopped or
partitioned frontend; a client that stops reading does not: the frontend buffers for it). On the loop that would stop
every stream of the worker, for as long as TCP takes to give up. So the loop sends a request's chunks itself only
while the request has sent less than TCP alone holds (:data:`DIRECT_BYTES`: short answers, most of a paced stream's
chunks never leave the loop), and past that the sends run here: one thread normally (it wakes once per batch of chunks
the loop hands over, not once per chunk), and a send that stays blocked parks its thread while another takes the other
requests' chunks (:attr:`Egress.stall_s`, up to :attr:`Egress.max_threads`). A request whose send is blocked keeps its
chunks pending in its outbox, where they merge and count against the outbox's bound, so the engine's flow control
holds that stream back -- as on the pull path.

Ordering: a request's chunks are sent by one thread at a time, in the order the loop delivered them (a request is
queued once until its thread has taken everything pending: :meth:`Pushable.push_pending`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Final, Protocol

if TYPE_CHECKING:
    import asyncio

__all__ = ["DIRECT_BYTES", "Egress", "Pushable", "ResponseSender", "wire_bytes"]

logger: Final = logging.getLogger("sidecar.dynamo")

#: What a request may send from the loop itself, in :func:`wire_bytes`: below what TCP alone holds for a frontend
#: that reads nothing (Linux's defaults: 16 KiB of send buffer here, about half of a 128 KiB receive buffer there) --
#: so the loop's sends can never find the request's channel full, however stalled its frontend. Past it (long
#: answers), the egress threads send.
DIRECT_BYTES: Final = 48 * 1024
#: A send blocked this long is taken for a frontend that does not read: another thread takes the queue.
STALL_S: Final = 0.05
#: Parked threads are bounded: past this many, requests wait for a blocked send to end (their outboxes fill and
#: hold their engine streams back).
MAX_THREADS: Final = 64


def wire_bytes(chunks: list[dict[str, Any]]) -> int:
    """An upper bound of what ``chunks`` take on Dynamo's response stream (msgpack, with its framing)."""
    total = 0
    for chunk in chunks:
        total += 64 + 9 * len(chunk.get("token_ids") or ())
        if len(chunk) > 2:  # beyond token_ids and index: logprobs, the final chunk's usage, text, a handoff
            total += 1024 + 48 * len(chunk.get("log_probs") or ())
            top = chunk.get("top_logprobs")
            if top:
                total += 64 * sum(len(candidates or ()) for candidates in top)
    return total


class ResponseSender(Protocol):
    """Dynamo 1.6.1's ``dynamo._core.ResponseSender`` (the ``response_sender`` a push-mode handler gets), as used
    here: ``send`` encodes one chunk under the caller's GIL and enqueues it (blocking, GIL released, while the
    request's channel is full; ``RuntimeError`` once the consumer is gone or after ``close``); ``close`` ends the
    stream, idempotent."""

    def send(self, chunk: object, /) -> None: ...

    def close(self) -> None: ...


class Pushable(Protocol):
    """What the egress threads call on a request (its outbox)."""

    def push_pending(self, egress: Egress) -> None:
        """Send what is pending, and the end once it is due; returns when nothing is pending (egress thread)."""


class Egress:
    """The egress threads of one worker: requests with chunks to send are queued (:meth:`schedule`, loop thread) and
    taken one at a time by a free thread."""

    __slots__ = ("_busy", "_check_armed", "_closed", "_idle", "_loop", "_queue", "_threads", "direct_bytes", "lock",
                 "max_threads", "stall_s")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        stall_s: float = STALL_S,
        max_threads: int = MAX_THREADS,
        direct_bytes: int = DIRECT_BYTES,
    ) -> None:
        self._loop: Final = loop
        self.direct_bytes: Final = direct_bytes
        self.stall_s: Final = stall_s
        self.max_threads: Final = max_threads
        #: Guards every request's pending chunks and queued flag, shared by the loop and the egress threads.
        self.lock: Final = threading.Lock()
        self._queue: queue.SimpleQueue[Pushable | None] = queue.SimpleQueue()
        self._threads = 0
        self._idle = 0
        #: thread ident -> when its current send began (monotonic), while it sends.
        self._busy: dict[int, float] = {}
        self._check_armed = False
        self._closed = False

    @property
    def threads(self) -> int:
        return self._threads

    def schedule(self, item: Pushable) -> None:
        """Queue ``item`` (loop thread; the caller marked it queued under :attr:`lock`)."""
        self._queue.put(item)
        if self._idle == 0:
            self._maybe_grow()

    def sending(self, since: float | None) -> None:
        """The calling egress thread starts (``since``) or ends (None) a batch of sends."""
        if since is None:
            self._busy.pop(threading.get_ident(), None)
        else:
            self._busy[threading.get_ident()] = since

    def close(self) -> None:
        """Let every thread end once it is free (the edge is closing); idempotent."""
        if not self._closed:
            self._closed = True
            for _ in range(self._threads):
                self._queue.put(None)

    # ---------------------------------------------------------------------------------------------- internals

    def _maybe_grow(self) -> None:
        if self._closed or self._threads >= self.max_threads:
            return
        if self._threads == 0:
            self._start()
            return
        oldest = min(self._busy.values(), default=None)
        blocked_s = 0.0 if oldest is None else time.monotonic() - oldest
        if blocked_s >= self.stall_s and len(self._busy) >= self._threads:
            logger.warning(
                "a send to Dynamo has been blocked for %.2f s (its frontend is not reading): egress threads %d -> %d",
                blocked_s,
                self._threads,
                self._threads + 1,
            )
            self._start()
        elif not self._check_armed:
            # Nothing else may come to look again: look once the oldest send would count as blocked (a thread
            # between two requests takes the queue before then).
            self._check_armed = True
            self._loop.call_later(self.stall_s - blocked_s + 0.001, self._check)

    def _check(self) -> None:
        self._check_armed = False
        if self._idle == 0 and not self._queue.empty():
            self._maybe_grow()

    def _start(self) -> None:
        self._threads += 1
        threading.Thread(target=self._run, name=f"dynamo-egress-{self._threads}", daemon=True).start()

    def _run(self) -> None:
        get = self._queue.get
        lock = self.lock
        while True:
            with lock:
                self._idle += 1
            item = get()
            with lock:
                self._idle -= 1
            if item is None:
                return
            try:
                item.push_pending(self)
            except Exception:
                logger.exception("pushing a request's chunks to Dynamo failed")
            finally:
                self.sending(None)
