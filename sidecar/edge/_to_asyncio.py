"""trio calls into asyncio: one awaited call (``Edge.run``) and one consumed stream (``Edge.open_stream``).

Thread ownership is strict. Attributes commented "trio" are touched only in trio's thread, "loop" only on the edge
loop thread; the sides talk only through :class:`Link`. The single exception is the pump's ``stop`` flag, written by
trio and read by the pump between two items (see :class:`_Pump`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import outcome
import trio

from ._errors import EdgeClosed
from ._inbox import Inbox
from ._link import EXIT_GRACE, MAX_BATCH, aclose_iterator, logger

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from ._link import Link

__all__ = ["AsyncioCall", "BatchStream", "Feed", "FeedStream"]

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


class _TrioConsumer(Inbox[T]):
    """The trio side both streams share: one consumer task parked without allocating (trio's low-level parking, no
    Event per wait), the credit posted to a holding producer, and a close that tells the producer and waits at most
    :data:`EXIT_GRACE` for it to finish. Each stream adds its producer (a pump task iterating an asyncio iterator, or
    a :class:`Feed` fed by loop callbacks) and how to start and stop it."""

    __slots__ = ("_busy", "_done_event", "_producer_finished", "_waiter")

    def __init__(self, link: Link, high_water: int) -> None:
        if high_water < 1:
            raise ValueError(f"high_water must be at least 1, not {high_water}")
        super().__init__(link)  # the inbox: trio's
        self._busy = False
        self._waiter: trio.lowlevel.Task | None = None
        self._producer_finished = False
        self._done_event: trio.Event | None = None  # only while closing waits for the producer

    def __aiter__(self) -> _TrioConsumer[T]:
        return self

    async def __anext__(self) -> list[T]:
        if self._busy:
            raise trio.BusyResourceError("another task is already iterating this stream")
        self._busy = True
        try:
            if self._batches:
                # A faster asyncio side always has a batch ready; without this the consumer would never yield.
                await trio.lowlevel.checkpoint()
            while (batch := self._take()) is None:
                self._waiter = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
        finally:
            self._busy = False
        self._credit_if_wanted()
        return batch

    def _credit_if_wanted(self) -> None:
        """Called after each batch taken (after writing ``taken``): wake a producer holding back for credit."""
        raise NotImplementedError

    def _abort_wait(self, _: object) -> trio.lowlevel.Abort:
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _close(self, cancel: Callable[[], None], what: str) -> None:
        """Post ``cancel`` to the loop unless the producer already finished, then wait for it, shielded and bounded."""
        self._closed = True
        # A producer that already reported its end has nothing left to cancel (the common case: the stream ran out).
        if not self._producer_finished and self._link.to_loop(cancel):
            with trio.CancelScope(shield=True), trio.move_on_after(EXIT_GRACE) as bound:
                while not self._producer_finished:
                    self._done_event = trio.Event()
                    await self._done_event.wait()
            if bound.cancelled_caught:
                logger.warning("edge: %s did not finish within %.1f s of being cancelled", what, EXIT_GRACE)
        self._batches.clear()

    # trio thread (Inbox's hooks)

    def _wake(self) -> None:
        if (task := self._waiter) is not None:
            self._waiter = None
            trio.lowlevel.reschedule(task)

    def _pump_gone(self) -> None:
        self._producer_finished = True
        if self._done_event is not None:
            self._done_event.set()


class BatchStream(_TrioConsumer[T]):
    """What ``Edge.open_stream`` returns: an async context manager, and a trio async iterator of non-empty
    ``list[T]`` batches.

    A batch is everything the asyncio side received since the consumer last took one (the pump posts what it read in
    one loop iteration; posts that arrive before the consumer comes back are merged, up to 1024 items), so handle a
    batch at a time (one yield, one metrics update per batch). After the last batch, an exception from the asyncio
    iterator is raised here, the same object. One consumer task at a time (:class:`trio.BusyResourceError`
    otherwise).

    Entering it starts the pump; leaving it stops the pump between two items, cancels it and ``aclose()``-s the
    iterator (for grpclib: RST_STREAM), then waits at most 1 s for that.
    """

    __slots__ = ("_pump",)

    def __init__(
        self, link: Link, fn: Callable[..., AsyncIterator[T]], args: tuple[object, ...], high_water: int
    ) -> None:
        super().__init__(link, high_water)
        self._pump: Final = _Pump(link, self, fn, args, high_water)

    async def __aenter__(self) -> BatchStream[T]:
        await trio.lowlevel.checkpoint()
        if not self._link.to_loop(self._pump.start):
            raise EdgeClosed("the edge loop is closed")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._aclose()

    async def _aclose(self) -> None:
        # Stop first and tidy up afterwards: the pump may be running flat out, and every item it reads meanwhile is
        # latency (freeing a large backlog here takes milliseconds, with the GIL held).
        self._pump.stop = True
        await self._close(self._pump.cancel, "an asyncio stream")

    def _credit_if_wanted(self) -> None:
        if self._pump.wants_credit:  # read after writing `taken`: see _Pump._wait_for_credit
            self._link.to_loop(self._pump.credit)


class _LoopSide:
    """Loop side, shared by :class:`_Pump` and :class:`Feed`: the edge's link and the trio consumer they feed."""

    __slots__ = ("_link", "_sink")

    def __init__(self, link: Link, sink: _TrioConsumer[Any]) -> None:
        self._link: Final = link
        self._sink: Final = sink  # the trio side: only the Inbox's callbacks and `taken` are used


class _Pump(_LoopSide, Generic[T]):
    """The asyncio half of a :class:`BatchStream`: iterates ``fn()`` on the edge loop and posts batches to trio.

    Batching: the first item of a batch schedules a flush with ``loop.call_soon``, which runs only once the pump
    suspends, so everything received without suspending (grpclib returns queued messages synchronously) travels
    as one batch. A full batch is flushed at once and followed by ``asyncio.sleep(0)``, so the pump suspends at
    least once per batch either way.

    Backpressure: items posted but not yet taken by the trio consumer (``_posted - sink.taken``, two counters with one
    writer each) may not reach ``high_water``; there the pump waits until the consumer takes some. Only a waiting pump
    asks to be woken (``wants_credit``), so a consumer that keeps up sends nothing back across the threads.
    """

    __slots__ = ("_args", "_batch", "_closing", "_credit", "_fn", "_high_water", "_max_batch", "_posted", "_task",
                 "stop", "wants_credit")  # fmt: skip

    def __init__(
        self,
        link: Link,
        sink: BatchStream[T],
        fn: Callable[..., AsyncIterator[T]],
        args: tuple[object, ...],
        high_water: int,
    ) -> None:
        super().__init__(link, sink)
        # fn and its arguments rather than a closure over them: one object less per stream.
        self._fn: Final = fn
        self._args: Final = args
        self._high_water: Final = high_water
        self._max_batch: Final = min(high_water, MAX_BATCH)
        # Written by trio, read between items: task.cancel() only lands when the pump suspends, and a producer that
        # never suspends would otherwise run through its whole backlog before noticing that trio has left.
        self.stop = False
        # loop
        self._task: asyncio.Task[None] | None = None
        self._credit: asyncio.Future[None] | None = None  # only while waiting (no Event per stream)
        self._batch: list[T] = []
        self._posted = 0  # items posted to trio so far
        self._closing = False
        # Written by the pump, read by trio: the pump waits for the consumer to take items.
        self.wants_credit = False

    def start(self) -> None:
        """Loop callback: start pumping, unless trio already left."""
        if self.stop:
            self._link.to_trio(self._sink._finished)
            return
        self._task = self._link.loop.create_task(self._run(), name="sidecar.edge pump")
        self._task.add_done_callback(self._finished)

    def cancel(self) -> None:
        """Loop callback: trio left the stream."""
        # Once the pump is closing the iterator itself, a cancel would only cut that cleanup short.
        if self._task is not None and not self._closing:
            self._task.cancel(msg="the trio consumer left the stream")

    def credit(self) -> None:
        """Loop callback: trio took items while the pump was waiting for room."""
        if (credit := self._credit) is not None and not credit.done():
            credit.set_result(None)

    def _flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self._posted += len(batch)
            if not self._link.to_trio(self._sink._deliver, batch):
                self.stop = True

    async def _run(self) -> None:
        loop = self._link.loop
        iterator = self._fn(*self._args)
        try:
            while not self.stop:
                pending = len(self._batch)
                if pending >= self._max_batch or self._posted - self._sink.taken + pending >= self._high_water:
                    self._flush()
                    await asyncio.sleep(0)
                    while self._posted - self._sink.taken >= self._high_water and not self.stop:
                        await self._wait_for_credit(loop)
                    continue
                try:
                    item = await iterator.__anext__()
                except StopAsyncIteration:
                    return
                if not self._batch:
                    loop.call_soon(self._flush)
                self._batch.append(item)
        finally:
            self._closing = True
            # An async generator's finally (grpclib: Stream.__aexit__ -> RST_STREAM) runs only when it is closed.
            await aclose_iterator(iterator)

    async def _wait_for_credit(self, loop: asyncio.AbstractEventLoop) -> None:
        self._credit = credit = loop.create_future()
        self.wants_credit = True
        try:
            # A second look after raising the flag: a consumer that took items before it saw the flag shows up in
            # `taken` now; one that takes items after this look sees the flag and posts `credit` (under the GIL one
            # of the two always sees the other's write).
            if self._posted - self._sink.taken >= self._high_water and not self.stop:
                await credit
        finally:
            self.wants_credit = False
            self._credit = None

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


class FeedStream(_TrioConsumer[T]):
    """What ``Edge.open_feed`` returns: like :class:`BatchStream`, but fed by callbacks on the loop instead of by a
    pump task iterating an asyncio iterator.

    For a producer that already runs as loop callbacks (a protocol's ``data_received``): it hands its items to
    :meth:`Feed.push` as they arrive, so nothing on the loop wakes per item or per batch -- no task, no future. The
    rules are :class:`BatchStream`'s: batches in order, then the error (the same object) or the end; one consumer
    task; leaving the block tells the producer (:attr:`Feed.on_cancel`, on the loop) and waits at most 1 s for it to
    finish.
    """

    __slots__ = ("_feed",)

    def __init__(self, link: Link, start: Callable[..., None], args: tuple[object, ...], high_water: int) -> None:
        super().__init__(link, high_water)
        self._feed: Final = Feed(link, self, start, args, high_water)

    async def __aenter__(self) -> FeedStream[T]:
        await trio.lowlevel.checkpoint()
        if not self._link.to_loop(self._feed._start):
            raise EdgeClosed("the edge loop is closed")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._feed.stopped = True
        await self._close(self._feed._cancel, "a feed")

    def _credit_if_wanted(self) -> None:
        if self._feed.wants_credit:  # read after writing `taken`: see Feed.hold
            self._link.to_loop(self._feed._credit)


class Feed(_LoopSide, Generic[T]):
    """The loop side of a :class:`FeedStream`: what its producer calls, on the loop thread only.

    ``start(feed, *args)`` is called on the loop when trio enters the stream; it sets :attr:`on_cancel` and arranges
    for :meth:`push`, then :meth:`end` or :meth:`fail` (the first of the two counts; both are no-ops after it).

    Backpressure: :meth:`push` always hands its items over (a producer bounded by something else -- an HTTP/2
    window -- cannot un-receive them) and returns whether the consumer is below ``high_water`` items not taken.
    A producer that must hold back calls :meth:`hold` with a callback; it runs on the loop once the consumer has
    taken items (only a holding producer is posted to: a consumer that keeps up sends nothing back).
    """

    __slots__ = ("_args", "_done", "_high_water", "_on_room", "_posted", "_start_fn", "on_cancel", "stopped",
                 "wants_credit")  # fmt: skip

    def __init__(
        self, link: Link, sink: FeedStream[T], start: Callable[..., None], args: tuple[object, ...], high_water: int
    ) -> None:
        super().__init__(link, sink)
        self._start_fn: Final = start
        self._args: Final = args
        self._high_water: Final = high_water
        self._posted = 0  # loop: items pushed so far
        self._done = False  # loop: end, fail or the cancel has been handled
        self._on_room: Callable[[], None] | None = None  # loop: the holding producer's callback
        #: Loop: called once if trio leaves before the end (set by the producer; replace it as its state changes).
        self.on_cancel: Callable[[], object] | None = None
        #: Written by trio when it leaves, read by the loop (the producer may look before doing more work).
        self.stopped = False
        #: Written by the loop, read by trio: a producer holds back until the consumer takes items.
        self.wants_credit = False

    @property
    def has_room(self) -> bool:
        """Fewer than ``high_water`` items pushed and not yet taken by trio."""
        return self._posted - self._sink.taken < self._high_water

    @property
    def done(self) -> bool:
        """True once the feed ended, failed or was cancelled: pushes are dropped from then on."""
        return self._done

    def push(self, items: list[T]) -> bool:
        """Hand ``items`` (non-empty; not touched by the producer afterwards) to trio; returns :attr:`has_room`."""
        if self._done:
            return False
        self._posted += len(items)
        if not self._link.to_trio(self._sink._deliver, items):
            self._done = True
            return False
        return self._posted - self._sink.taken < self._high_water

    def hold(self, on_room: Callable[[], None]) -> None:
        """Call ``on_room()`` (on the loop) once the consumer is below ``high_water`` again; at once if it is now."""
        self._on_room = on_room
        self.wants_credit = True
        # A second look after raising the flag: a consumer that took items before it saw the flag shows up in
        # `taken` now; one that takes items after this look sees the flag and posts `_credit`.
        self._credit()

    def end(self) -> None:
        """The stream is complete: trio's iteration ends after every item pushed."""
        if not self._done:
            self._done = True
            self._link.feeds.discard(self)
            self._link.to_trio(self._sink._end)
            self._link.to_trio(self._sink._finished)

    def fail(self, error: BaseException) -> None:
        """The stream failed: ``error`` (the same object) is raised in trio after every item pushed."""
        if not self._done:
            self._done = True
            self._link.feeds.discard(self)
            self._link.to_trio(self._sink._fail, error)
            self._link.to_trio(self._sink._finished)

    def after_round(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop once trio has run what was pushed so far (at its next round; at once if trio
        has finished). A producer that waits for it before pushing again lets what arrives meanwhile merge into one
        batch while trio is busy, and costs nothing while it is idle."""
        if not self._link.to_trio(self._link.to_loop, callback):
            callback()

    def fail_cancelled(self) -> None:
        """The producer's own task was cancelled by someone other than trio (the loop shutting down, most likely)."""
        self.fail(self._link.asyncio_cancelled())

    # loop callbacks posted by trio

    def _start(self) -> None:
        if self.stopped:
            self._done = True
            self._link.to_trio(self._sink._finished)
            return
        self._link.feeds.add(self)
        try:
            self._start_fn(self, *self._args)
        except Exception as exc:
            self.fail(exc)

    def _cancel(self) -> None:
        if self._done:
            return
        self._done = True
        self._link.feeds.discard(self)
        self.wants_credit = False
        on_cancel, self.on_cancel = self.on_cancel, None
        try:
            if on_cancel is not None:
                on_cancel()
        except Exception:
            logger.exception("edge: cancelling a feed's producer failed")
        finally:
            self._link.to_trio(self._sink._finished)

    def _credit(self) -> None:
        on_room = self._on_room
        if on_room is not None and self._posted - self._sink.taken < self._high_water:
            self._on_room = None
            self.wants_credit = False
            if not self._done:
                on_room()
