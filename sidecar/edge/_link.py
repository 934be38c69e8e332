"""The two ends of one edge, and posting callables across them without ever raising on the receiving side.

Every crossing goes through :meth:`Link.to_loop` (``loop.call_soon_threadsafe``) or :meth:`Link.to_trio`. Both are
FIFO, so "items, then the error, then finished" arrive in the order they were posted, which is what lets an exception
be raised only after every item received before it.

Posts into trio are batched: :meth:`Link.to_trio` appends ``(fn, args)`` to a queue, and only the first post of a
burst calls ``TrioToken.run_sync_soon`` (of one drain). Each ``run_sync_soon`` takes a lock and writes trio's wakeup
socket; under load every batch of every request used to cost ~3 of them (deliver, ack, the trio pump's own flush).
The drain clears the "posted" flag *before* it takes the queued callables, so a post that sees the flag set is always
followed by a drain that takes it (nothing strands), and it runs at most the callables queued when it started (a
burst that keeps coming cannot starve trio; the later posts have posted a drain of their own). Posts onto the loop
stay one ``call_soon_threadsafe`` each: uvloop already coalesces those wakeups (``bench/hotpath.py``).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Final, TypeVarTuple

import trio

from ._errors import BridgeCancelled, EdgeClosed, EdgeError

if TYPE_CHECKING:
    import asyncio
    from collections.abc import AsyncIterator, Callable

__all__ = ["EXIT_GRACE", "MAX_BATCH", "Link", "aclose_iterator", "logger", "to_trio"]

Ts = TypeVarTuple("Ts")

logger: Final = logging.getLogger("sidecar.edge")

# How long a closing side waits for the other side to finish its cleanup. Closing a grpclib stream sends RST_STREAM
# without waiting for the peer, so only misbehaving code ever reaches this bound.
EXIT_GRACE: Final = 1.0
# A producer that never suspends (grpclib's recv_message while data is queued) must still let its event loop run:
# a batch never grows past this, whatever the high-water mark.
MAX_BATCH: Final = 1024


def _guarded(fn: Callable[[*Ts], object], *args: *Ts) -> None:
    try:
        fn(*args)
    except BaseException:
        # Anything escaping a run_sync_soon callback becomes a TrioInternalError that takes the whole run down; a
        # lost wake-up (bounded by the waiters' own timeouts) is the lesser evil.
        logger.exception("edge: callback %r raised inside trio", fn)


def to_trio(token: trio.lowlevel.TrioToken, fn: Callable[[*Ts], object], *args: *Ts) -> bool:
    """Run ``fn(*args)`` soon in trio's thread, guarded so it cannot raise there. ``False`` once trio has finished."""
    try:
        token.run_sync_soon(_guarded, fn, *args)
    except trio.RunFinishedError:
        return False
    return True


_Job = tuple["Callable[..., object]", tuple[object, ...]]


class Link:
    """One edge's loop and trio token, plus the loop-thread flag that tells "shut down" apart from "cancelled".

    Posting is safe from any thread (the trio pump posts its own flushes from trio's thread). The trio queue is a deque
    (``append``/``popleft`` are atomic) and its flag a plain attribute: a race between two posters can at worst post
    one drain too many, which finds the queue empty.
    """

    __slots__ = ("_trio_finished", "_trio_jobs", "_trio_posted", "feeds", "loop", "shutting_down", "token")

    def __init__(self, loop: asyncio.AbstractEventLoop, token: trio.lowlevel.TrioToken) -> None:
        self.loop: Final = loop
        self.token: Final = token
        # Loop thread only: set before the leftover tasks are cancelled, so their cancellation reads as EdgeClosed.
        self.shutting_down = False
        self._trio_jobs: Final[deque[_Job]] = deque()
        # Loop thread only: feeds (``Edge.open_feed``) started and not finished; failed if the loop shuts down.
        self.feeds: Final[set[Any]] = set()
        self._trio_posted = False
        self._trio_finished = False

    def to_loop(self, fn: Callable[[*Ts], object], *args: *Ts) -> bool:
        """Run ``fn(*args)`` soon on the loop's thread. ``False`` once the loop is closed."""
        # One call_soon_threadsafe per callable: uvloop's is C code and already coalesces the wakeups (libuv's
        # uv_async_send writes its eventfd only when no wakeup is pending), so a queue of our own here costs more
        # than it saves (bench/hotpath.py: +20 % CPU per callable).
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    def to_trio(self, fn: Callable[[*Ts], object], *args: *Ts) -> bool:
        """Run ``fn(*args)`` soon in trio's thread, guarded so it cannot raise there. ``False`` once trio has ended."""
        if self._trio_finished:
            return False
        job: _Job = (fn, args)
        self._trio_jobs.append(job)
        if self._trio_posted:
            return True  # trio runs every callable it accepted, even while it shuts down: the drain will come
        self._trio_posted = True
        try:
            self.token.run_sync_soon(self._drain_trio)
        except trio.RunFinishedError:
            self._trio_finished = True
            return not _withdraw(self._trio_jobs, job)
        return True

    def asyncio_cancelled(self) -> EdgeError:
        """What trio is told when an asyncio task it was waiting on got cancelled by someone else (loop thread only)."""
        if self.shutting_down:
            return EdgeClosed("the edge loop shut down under this call")
        return BridgeCancelled("the asyncio task was cancelled by someone other than its trio caller")

    def _drain_trio(self) -> None:
        # trio thread (a run_sync_soon callback): must not raise, hence _guarded per callable.
        self._trio_posted = False
        jobs = self._trio_jobs
        for _ in range(len(jobs)):
            fn, args = jobs.popleft()
            _guarded(fn, *args)


def _withdraw(jobs: deque[_Job], job: _Job) -> bool:
    """Take ``job`` back out of ``jobs`` after the other side turned out to be gone; False if a drain took it first."""
    try:
        jobs.remove(job)
    except ValueError:
        return False
    return True


async def aclose_iterator(iterator: AsyncIterator[object]) -> None:
    """``aclose()`` the iterator if it has one (async generators and grpclib streams do; plain iterators may not)."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()
