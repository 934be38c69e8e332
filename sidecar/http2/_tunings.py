"""Process tunings of grpclib and hyperframe: applied only by an explicit call (:func:`apply_tunings`), never at
import; the worker calls it at start-up, benches and tests toggle it to measure it.

* **Cheap frame repr.** h2 formats every frame it receives for a trace log that is a no-op unless a logger is set up
  -- eagerly: ``H2Connection._receive_frame`` calls ``logger.trace("Received frame: %s", repr(frame))``, and
  hyperframe's repr re-serialises the frame body and hex-dumps it. :func:`cheap_frame_repr` names the frame type and
  stream only (docs/performance.md, "HTTP/2 layer tunings").
* **Lean grpclib streams.** Every grpclib stream (``grpclib.protocol.Stream``) creates three ``asyncio.Event`` and a
  ``Buffer`` holding an ``asyncio.Queue`` (three deques and one more Event) and a ``deque``: eight
  ``collections.deque`` objects, and an empty deque is 760 bytes. The names ``grpclib.protocol`` builds them from
  are pointed at the three classes below, which behave the same for the way grpclib uses them and hold lists
  (56 bytes empty):

  * :class:`LeanEvent` is ``asyncio.Event`` with a list of waiters (``wait`` appends and removes its own future,
    ``set`` wakes them all: a list does both);
  * :class:`LeanQueue` is the part of ``asyncio.Queue`` that ``Buffer`` uses (``put_nowait``, ``get``,
    ``get_nowait``, ``empty``, ``qsize``), unbounded, for the stream's one reader;
  * :class:`LeanDeque` is a list with ``popleft``, for ``Buffer``'s few acknowledged chunks.

Both are process-wide (a class attribute, module globals): whoever calls :func:`apply_tunings` owns the process.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final, Generic, TypeVar

import grpclib.protocol
import hyperframe.frame

__all__ = [
    "HYPERFRAME_REPR",
    "LeanDeque",
    "LeanEvent",
    "LeanQueue",
    "apply_tunings",
    "cheap_frame_repr",
    "tunings_in_effect",
    "undo_tunings",
]

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


def cheap_frame_repr(frame: hyperframe.frame.Frame) -> str:
    """``DataFrame(stream_id=3)``: what a frame is, without re-serialising and hex-dumping its body."""
    return f"{type(frame).__name__}(stream_id={frame.stream_id})"


#: hyperframe's own ``Frame.__repr__``, as the library defines it (restored by :func:`undo_tunings`).
HYPERFRAME_REPR: Final = hyperframe.frame.Frame.__repr__
#: The names ``grpclib.protocol`` imported from asyncio and collections, and what the lean tuning makes them.
_LEAN_NAMES: Final[dict[str, type]] = {"Event": LeanEvent, "Queue": LeanQueue, "deque": LeanDeque}
_GRPCLIB_NAMES: Final[dict[str, Any]] = {name: getattr(grpclib.protocol, name) for name in _LEAN_NAMES}


def apply_tunings(*, frame_repr: bool = True, lean_streams: bool = True) -> None:
    """Apply the chosen tunings to this process (idempotent); the others are left as they are.

    Streams created before keep what they have.
    """
    if frame_repr:
        hyperframe.frame.Frame.__repr__ = cheap_frame_repr  # type: ignore[method-assign]
    if lean_streams:
        for name, lean in _LEAN_NAMES.items():
            setattr(grpclib.protocol, name, lean)


def undo_tunings() -> None:
    """Put hyperframe and grpclib back as the libraries define them."""
    hyperframe.frame.Frame.__repr__ = HYPERFRAME_REPR  # type: ignore[method-assign]
    for name, original in _GRPCLIB_NAMES.items():
        setattr(grpclib.protocol, name, original)


def tunings_in_effect() -> dict[str, bool]:
    """Which tunings this process runs with, by the names of :func:`apply_tunings`' arguments."""
    return {
        "frame_repr": hyperframe.frame.Frame.__repr__ is cheap_frame_repr,
        "lean_streams": all(getattr(grpclib.protocol, name) is lean for name, lean in _LEAN_NAMES.items()),
    }
