"""trio calls into asyncio: one awaited call (``Edge.run``) and one consumed stream (``Edge.open_stream``).

Thread ownership is strict. Attributes commented "trio" are touched only in trio's thread, "loop" only on the edge
loop thread; the sides talk only through :class:`Link`. The single exception is the pump's ``stop`` flag, written by
trio and read by the pump between two items (see :class:`_Pump`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Final, Generic, TypeVar

import outcome
import trio

from ._errors import EdgeClosed
from ._link import EXIT_GRACE, MAX_BATCH, aclose_iterator, logger

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

    from ._link import Link

__all__ = ["AsyncioCall", "BatchStream", "open_batch_stream"]

T = TypeVar("T")


class AsyncioCall(Generic[T]):
    """One trio -> asyncio call: an asyncio Task on the edge loop whose outcome is handed back to trio."""

    __slots__ = ("_done", "_fn", "_link", "_outcome", "_task")

    def __init__(self, link: Link, fn: Callable[[], Awaitable[T]]) -> None:
        self._link: Final = link
        self._fn: Final = fn
        self._task: asyncio.Task[T] | None = None  # loop
        self._done: Final = trio.Event()  # trio
        self._outcome: outcome.Outcome[T] | None = None  # trio

    async def result(self) -> T:
        """Start the task and return its result, or raise its exception (the same object)."""
        if not self._link.to_loop(self._start):
            raise EdgeClosed("the edge loop is closed")
        try:
            await self._done.wait()
        except BaseException:
            # Take the asyncio task down with us, and give it a bounded moment to run its own cleanup so that it
            # does not outlive the trio scope that owned it.
            if self._link.to_loop(self._cancel):
                with trio.CancelScope(shield=True), trio.move_on_after(EXIT_GRACE):
                    await self._done.wait()
            raise
        assert self._outcome is not None
        return self._outcome.unwrap()

    # loop thread

    def _start(self) -> None:
        self._task = self._link.loop.create_task(self._invoke())
        # A done callback, not a finally: a task cancelled before its first step never runs its body.
        self._task.add_done_callback(self._finished)

    async def _invoke(self) -> T:
        # fn is called here so that whatever it creates (futures, streams) belongs to the edge loop.
        return await self._fn()

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel(msg="the trio caller was cancelled")

    def _finished(self, task: asyncio.Task[T]) -> None:
        result: outcome.Outcome[T]
        if task.cancelled():
            result = outcome.Error(self._link.asyncio_cancelled())
        elif (error := task.exception()) is not None:
            # exception() hands over the object without raising it, so its traceback gains no bridge frames.
            result = outcome.Error(error)
        else:
            result = outcome.Value(task.result())
        self._link.to_trio(self._deliver, result)

    # trio thread

    def _deliver(self, result: outcome.Outcome[T]) -> None:
        self._outcome = result
        self._done.set()


class BatchStream(Generic[T]):
    """What ``Edge.open_stream`` yields: a trio async iterator of non-empty ``list[T]`` batches.

    A batch is everything the asyncio side received in one loop iteration (at most 1024 items), so handle a batch at
    a time (one yield, one metrics update per batch). After the last batch, an exception from the asyncio iterator is
    raised here, the same object. One consumer task at a time (:class:`trio.BusyResourceError` otherwise).
    """

    __slots__ = ("_batches", "_busy", "_closed", "_ended", "_error", "_link", "_pump", "_pump_done", "_wakeup")

    def __init__(self, link: Link, fn: Callable[[], AsyncIterator[T]], high_water: int) -> None:
        self._link: Final = link
        self._pump: Final = _Pump(link, self, fn, high_water)
        # trio
        self._batches: Final[deque[list[T]]] = deque()
        self._error: BaseException | None = None
        self._ended = False
        self._closed = False
        self._busy = False
        self._wakeup: trio.Event | None = None
        self._pump_done: Final = trio.Event()

    def __aiter__(self) -> BatchStream[T]:
        return self

    async def __anext__(self) -> list[T]:
        if self._busy:
            raise trio.BusyResourceError("another task is already iterating this stream")
        self._busy = True
        try:
            if self._batches:
                # A faster asyncio side always has a batch ready; without this the consumer would never yield.
                await trio.lowlevel.checkpoint()
            while not self._batches:
                if self._error is not None:
                    error, self._error = self._error, None
                    self._ended = True
                    try:
                        raise error
                    finally:
                        del error
                if self._ended or self._closed:
                    raise StopAsyncIteration
                self._wakeup = trio.Event()
                await self._wakeup.wait()
            batch = self._batches.popleft()
        finally:
            self._busy = False
        self._link.to_loop(self._pump.ack, len(batch))
        return batch

    async def _aclose(self) -> None:
        # Stop first and tidy up afterwards: the pump may be running flat out, and every item it reads meanwhile is
        # latency (freeing a large backlog here takes milliseconds, with the GIL held).
        self._pump.stop = True
        self._closed = True
        if self._link.to_loop(self._pump.cancel):
            with trio.CancelScope(shield=True), trio.move_on_after(EXIT_GRACE) as bound:
                await self._pump_done.wait()
            if bound.cancelled_caught:
                logger.warning("edge: an asyncio stream did not finish within %.1f s of being cancelled", EXIT_GRACE)
        self._batches.clear()

    # trio thread, posted by the pump

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _deliver(self, batch: list[T]) -> None:
        if not self._closed:
            self._batches.append(batch)
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
        self._pump_done.set()
        self._wake()


class _Pump(Generic[T]):
    """The asyncio half of a :class:`BatchStream`: iterates ``fn()`` on the edge loop and posts batches to trio.

    Batching: the first item of a batch schedules a flush with ``loop.call_soon``, which runs only once the pump
    suspends, so everything received without suspending (grpclib returns queued messages synchronously) travels
    as one batch. A full batch is flushed at once and followed by ``asyncio.sleep(0)``, so the pump suspends at
    least once per batch either way.

    Backpressure: items posted but not yet taken by the trio consumer are "unacked"; at ``high_water`` the pump waits
    for the consumer's acks (``ack``) before reading on.
    """

    __slots__ = ("_batch", "_closing", "_credit", "_fn", "_high_water", "_link", "_max_batch", "_sink", "_task",
                 "_unacked", "stop")  # fmt: skip

    def __init__(self, link: Link, sink: BatchStream[T], fn: Callable[[], AsyncIterator[T]], high_water: int) -> None:
        self._link: Final = link
        self._sink: Final = sink
        self._fn: Final = fn
        self._high_water: Final = high_water
        self._max_batch: Final = min(high_water, MAX_BATCH)
        # Written by trio, read between items: task.cancel() only lands when the pump suspends, and a producer that
        # never suspends would otherwise run through its whole backlog before noticing that trio has left.
        self.stop = False
        # loop
        self._task: asyncio.Task[None] | None = None
        self._credit: asyncio.Event | None = None
        self._batch: list[T] = []
        self._unacked = 0
        self._closing = False

    def start(self) -> None:
        """Loop callback: start pumping, unless trio already left."""
        if self.stop:
            self._link.to_trio(self._sink._finished)
            return
        self._credit = asyncio.Event()
        self._task = self._link.loop.create_task(self._run(), name="sidecar.edge pump")
        self._task.add_done_callback(self._finished)

    def cancel(self) -> None:
        """Loop callback: trio left the stream."""
        # Once the pump is closing the iterator itself, a cancel would only cut that cleanup short.
        if self._task is not None and not self._closing:
            self._task.cancel(msg="the trio consumer left the stream")

    def ack(self, count: int) -> None:
        """Loop callback: trio took ``count`` items."""
        self._unacked -= count
        if self._credit is not None:
            self._credit.set()

    def _flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self._unacked += len(batch)
            if not self._link.to_trio(self._sink._deliver, batch):
                self.stop = True

    async def _run(self) -> None:
        assert self._credit is not None
        credit = self._credit
        iterator = self._fn()
        try:
            while not self.stop:
                if len(self._batch) >= self._max_batch or self._unacked + len(self._batch) >= self._high_water:
                    self._flush()
                    await asyncio.sleep(0)
                    while self._unacked >= self._high_water and not self.stop:
                        credit.clear()
                        await credit.wait()
                    continue
                try:
                    item = await iterator.__anext__()
                except StopAsyncIteration:
                    return
                if not self._batch:
                    self._link.loop.call_soon(self._flush)
                self._batch.append(item)
        finally:
            self._closing = True
            # An async generator's finally (grpclib: Stream.__aexit__ -> RST_STREAM) runs only when it is closed.
            await aclose_iterator(iterator)

    def _finished(self, task: asyncio.Task[None]) -> None:
        # A done callback rather than a finally: a task cancelled before its first step never runs its body.
        if self.stop:
            if not task.cancelled() and (error := task.exception()) is not None:
                logger.debug("edge: asyncio stream failed after the trio side left", exc_info=error)
        else:
            self._flush()
            if task.cancelled():
                self._link.to_trio(self._sink._fail, self._link.asyncio_cancelled())
            elif (error := task.exception()) is not None:
                self._link.to_trio(self._sink._fail, error)
            else:
                self._link.to_trio(self._sink._end)
        self._link.to_trio(self._sink._finished)


@asynccontextmanager
async def open_batch_stream(
    link: Link, fn: Callable[[], AsyncIterator[T]], high_water: int
) -> AsyncGenerator[BatchStream[T], None]:
    """Pump ``fn()`` on the edge loop into a :class:`BatchStream`; leaving the block cancels the pump (bounded wait)."""
    if high_water < 1:
        raise ValueError(f"high_water must be at least 1, not {high_water}")
    stream = BatchStream(link, fn, high_water)
    await trio.lowlevel.checkpoint()
    if not link.to_loop(stream._pump.start):
        raise EdgeClosed("the edge loop is closed")
    try:
        yield stream
    finally:
        await stream._aclose()
