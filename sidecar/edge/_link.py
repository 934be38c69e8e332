"""The two ends of one edge, and posting callables across them without ever raising on the receiving side.

Every crossing goes through :meth:`Link.to_loop` (``loop.call_soon_threadsafe``) or :meth:`Link.to_trio`
(``TrioToken.run_sync_soon``). Both are FIFO, so "items, then the error, then finished" arrive in the order they were
posted, which is what lets an exception be raised only after every item received before it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final, TypeVarTuple

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


class Link:
    """One edge's loop and trio token, plus the loop-thread flag that tells "shut down" apart from "cancelled"."""

    __slots__ = ("loop", "shutting_down", "token")

    def __init__(self, loop: asyncio.AbstractEventLoop, token: trio.lowlevel.TrioToken) -> None:
        self.loop: Final = loop
        self.token: Final = token
        # Loop thread only: set before the leftover tasks are cancelled, so their cancellation reads as EdgeClosed.
        self.shutting_down = False

    def to_loop(self, fn: Callable[[*Ts], object], *args: *Ts) -> bool:
        """Run ``fn(*args)`` soon on the loop's thread. ``False`` once the loop is closed."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    def to_trio(self, fn: Callable[[*Ts], object], *args: *Ts) -> bool:
        """Run ``fn(*args)`` soon in trio's thread (see :func:`to_trio`). ``False`` once trio has finished."""
        return to_trio(self.token, fn, *args)

    def asyncio_cancelled(self) -> EdgeError:
        """What trio is told when an asyncio task it was waiting on got cancelled by someone else (loop thread only)."""
        if self.shutting_down:
            return EdgeClosed("the edge loop shut down under this call")
        return BridgeCancelled("the asyncio task was cancelled by someone other than its trio caller")


async def aclose_iterator(iterator: AsyncIterator[object]) -> None:
    """``aclose()`` the iterator if it has one (async generators and grpclib streams do; plain iterators may not)."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()
