"""Leaner per-stream state for grpclib: what each HTTP/2 stream allocates, at ~0.7 KiB a piece, without the waste.

Every grpclib stream (``grpclib.protocol.Stream``) creates three ``asyncio.Event`` and a ``Buffer`` holding an
``asyncio.Queue`` (three deques and one more Event) and a ``deque``: eight ``collections.deque`` objects, and an empty
deque is 760 bytes. With 1,000 requests in flight that is ~6 MB for empty containers, a fifth of the sidecar's own
memory per request (``bench/inflight_memory.py``). :func:`install` points the names ``grpclib.protocol`` uses at the
three classes below, which behave the same for the way grpclib uses them and hold lists (56 bytes empty):

* :class:`LeanEvent` is ``asyncio.Event`` with a list of waiters (``wait`` appends and removes its own future,
  ``set`` wakes them all: a list does both);
* :class:`LeanQueue` is the part of ``asyncio.Queue`` that ``Buffer`` uses (``put_nowait``, ``get``, ``get_nowait``,
  ``empty``, ``qsize``), unbounded, for the stream's one reader;
* :class:`LeanDeque` is a list with ``popleft``, for ``Buffer``'s few acknowledged chunks.

Installed once, when ``sidecar.engine`` is imported (this process's only grpclib user is the engine client);
``tests/engine/test_grpclib_lean.py`` checks that grpclib still uses exactly these names.
"""

from __future__ import annotations

import asyncio
from typing import Final, Generic, TypeVar

import grpclib.protocol

__all__ = ["LeanDeque", "LeanEvent", "LeanQueue", "install"]

_T = TypeVar("_T")

# A consumed prefix of a LeanQueue's list is dropped once it is this long and at least half of the list.
_COMPACT_AFTER: Final = 64


class LeanEvent(asyncio.Event):
    """``asyncio.Event`` whose waiters are a list instead of a deque (same methods, same behaviour)."""

    def __init__(self) -> None:
        # asyncio.Event.__init__ only sets these two (and, before 3.12, rejects a `loop` argument nobody passes).
        self._waiters: list[asyncio.Future[bool]] = []  # type: ignore[assignment]
        self._value = False


class LeanQueue(Generic[_T]):
    """The subset of ``asyncio.Queue`` that grpclib's ``Buffer`` uses, unbounded, for a single reader.

    Items live in a list read from ``_head`` on; the consumed prefix is dropped in bulk, so taking an item is O(1)
    amortised even when a fast stream queues thousands of frames.
    """

    __slots__ = ("_getter", "_head", "_items")

    def __init__(self) -> None:
        self._items: list[_T] = []
        self._head = 0
        self._getter: asyncio.Future[None] | None = None

    def qsize(self) -> int:
        return len(self._items) - self._head

    def empty(self) -> bool:
        return self._head == len(self._items)

    def put_nowait(self, item: _T) -> None:
        self._items.append(item)
        getter = self._getter
        if getter is not None and not getter.done():
            getter.set_result(None)

    def get_nowait(self) -> _T:
        items, head = self._items, self._head
        if head == len(items):
            raise asyncio.QueueEmpty
        item = items[head]
        head += 1
        if head == len(items):
            items.clear()
            head = 0
        elif head >= _COMPACT_AFTER and 2 * head >= len(items):
            del items[:head]
            head = 0
        self._head = head
        return item

    async def get(self) -> _T:
        while self._head == len(self._items):
            getter = self._getter = asyncio.get_running_loop().create_future()
            try:
                await getter
            finally:
                self._getter = None
        return self.get_nowait()


class LeanDeque(list[_T]):
    """A list with ``popleft``: ``Buffer`` keeps only the few chunks of the message being read in it."""

    __slots__ = ()

    def popleft(self) -> _T:
        return self.pop(0)


def install() -> None:
    """Make grpclib's streams use the lean classes (idempotent). Streams created before keep what they have."""
    for name, lean in _NAMES.items():
        setattr(grpclib.protocol, name, lean)


#: The names ``grpclib.protocol`` imported from asyncio and collections, and what they become.
_NAMES: Final[dict[str, type]] = {"Event": LeanEvent, "Queue": LeanQueue, "deque": LeanDeque}
