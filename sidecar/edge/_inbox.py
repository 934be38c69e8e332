"""The consumer side of a bridged stream: batches posted by the other thread's producer, then the end.

Trio's consumers (``BatchStream`` and ``FeedStream``, which share ``_TrioConsumer``: trio reads what the loop posts)
keep their buffer here: :class:`Inbox` holds the batches and their merging, the error or end that follows them, the
count of items taken (the producer's backpressure); the consumer adds how it parks and is woken
(:meth:`Inbox._wake`) and what it does when its producer is gone (:meth:`Inbox._pump_gone`).

Every attribute belongs to the consumer's thread; the pump reaches it only by posting the ``_deliver``/``_fail``/
``_end``/``_finished`` callbacks through :class:`Link`, and reads ``taken`` (one writer, see the pumps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Generic, TypeVar

from ._link import MAX_BATCH

if TYPE_CHECKING:
    from ._link import Link

__all__ = ["Inbox"]

T = TypeVar("T")


class Inbox(Generic[T]):
    """Batches for one consumer, in order, then an error or the end."""

    __slots__ = ("_batches", "_closed", "_ended", "_error", "_link", "taken")

    def __init__(self, link: Link) -> None:
        self._link: Final = link
        # A list, not a deque: posts merge, so it rarely holds more than one batch, and an empty deque is 760 bytes
        # per stream against a list's 56.
        self._batches: Final[list[list[T]]] = []
        self._error: BaseException | None = None
        self._ended = False
        self._closed = False
        # Items handed to the consumer so far. Written by the consumer only, read by the pump (backpressure).
        self.taken = 0

    # consumer thread

    def _take(self) -> list[T] | None:
        """The next batch; ``None`` when the consumer must wait. After the last batch: the pump's error (the same
        object), or :class:`StopAsyncIteration` once ended or closed."""
        if self._batches:
            batch = self._batches.pop(0)
            self.taken += len(batch)
            return batch
        if self._error is not None:
            error, self._error = self._error, None
            self._ended = True
            try:
                raise error
            finally:
                del error  # no reference cycle through the traceback
        if self._ended or self._closed:
            raise StopAsyncIteration
        return None

    def _wake(self) -> None:
        """Wake the consumer if it is parked (each side parks its own way)."""
        raise NotImplementedError

    def _pump_gone(self) -> None:
        """The pump has finished for good (each side may be waiting for that to close)."""
        raise NotImplementedError

    # consumer thread, posted by the pump

    def _deliver(self, batch: list[T]) -> None:
        if not self._closed:
            batches = self._batches
            if batches and len(batches[-1]) + len(batch) <= MAX_BATCH:
                batches[-1].extend(batch)  # the consumer has not come back yet: one batch for it, not two
            else:
                batches.append(batch)
            self._wake()

    def _fail(self, error: BaseException) -> None:
        if not self._closed:
            self._error = error
            self._wake()

    def _end(self) -> None:
        self._ended = True
        self._wake()

    def _finished(self) -> None:
        self._ended = True  # a pump that died without reporting must not leave the consumer parked forever
        self._pump_gone()
        self._wake()
