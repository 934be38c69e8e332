"""asyncio calls into trio: one consumed stream (``Edge.trio_stream``) and one awaited call (``Edge.trio_call``).

The mirror image of ``_to_asyncio``: the trio task runs in a nursery the caller owns (the worker's request nursery),
the asyncio side only waits. Attributes commented "trio" are touched only in trio's thread, "loop" only on the edge
loop thread.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Final, Generic, Protocol, TypeVar

import outcome
import trio

from ._errors import BridgeCancelled, EdgeClosed
from ._inbox import Inbox
from ._link import EXIT_GRACE, MAX_BATCH, aclose_iterator

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from ._link import Link

__all__ = ["AsyncioBatchStream", "LoopSink", "TrioFeed", "start_trio_call", "start_trio_feed", "start_trio_stream"]

T = TypeVar("T")


def _closed_nursery(name: str, exc: RuntimeError) -> EdgeClosed:
    error = EdgeClosed(f"cannot start {name} in trio: {exc}")
    error.__cause__ = exc
    return error


class AsyncioBatchStream(Inbox[T]):
    """What ``Edge.trio_stream`` returns: an asyncio async iterator of non-empty ``list[T]`` batches from a trio task
    (what arrived since the consumer last took a batch, merged, at most 1024 items).

    Use it on the edge loop thread only, and close it (``async with contextlib.aclosing(...)``): ``aclose()``, or
    cancellation of the asyncio task waiting in ``__anext__``, cancels the trio task's scope with a reason. After the
    last batch, an exception from the trio side is raised here, the same object; a trio task cancelled from outside
    (a drain deadline, say) surfaces as :class:`BridgeCancelled`, a closed nursery or finished trio run as
    :class:`EdgeClosed`.
    """

    __slots__ = ("_pump", "_stop_sent", "_trio_done", "_trio_finished", "_waiter")

    def __init__(self, link: Link) -> None:
        super().__init__(link)  # the inbox: the loop's
        self._pump: _TrioPump[T] | None = None  # set once, right after construction
        self._stop_sent = False
        self._waiter: asyncio.Future[None] | None = None
        self._trio_finished = False
        self._trio_done: asyncio.Future[None] | None = None  # only while aclose() waits for the trio task

    def __aiter__(self) -> AsyncioBatchStream[T]:
        return self

    async def __anext__(self) -> list[T]:
        while (batch := self._take()) is None:
            waiter = self._waiter = self._link.loop.create_future()
            try:
                await waiter
            except asyncio.CancelledError:
                # Dynamo cancels the handler when the client goes away: the trio task goes with it.
                self._stop("the asyncio consumer was cancelled")
                raise
            finally:
                self._waiter = None
        if self._pump is not None and self._pump.wants_credit:  # read after writing `taken` (see _TrioPump)
            self._link.to_trio(self._pump.credit)
        return batch

    async def aclose(self) -> None:
        """Cancel the trio task if it still runs and wait (at most 1 s) for it to finish. Idempotent."""
        if not self._closed:
            self._closed = True
            self._batches.clear()
            self._stop("the asyncio consumer closed the stream")
        if not self._trio_finished:
            self._trio_done = self._link.loop.create_future()
            await asyncio.wait({self._trio_done}, timeout=EXIT_GRACE)

    def _stop(self, reason: str) -> None:
        if not self._stop_sent and not self._trio_finished and self._pump is not None:
            self._stop_sent = True
            self._link.to_trio(self._pump.cancel, reason)

    # loop thread (Inbox's hooks)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _pump_gone(self) -> None:
        self._trio_finished = True
        if self._trio_done is not None and not self._trio_done.done():
            self._trio_done.set_result(None)


class LoopSink(Protocol[T]):
    """Where a trio pump's batches go on the loop without an asyncio task in between (``Edge.trio_feed``).

    Every method is called on the loop thread, in order: ``_deliver`` per batch, then ``_fail`` (the trio exception,
    the same object) or ``_end`` unless the consumer stopped the pump, and ``_finished`` last, always. ``taken`` --
    written by the loop, read by trio -- counts the items the sink has accepted: the pump runs at most ``high_water``
    items ahead of it.
    """

    taken: int

    def _deliver(self, batch: list[T]) -> None: ...

    def _fail(self, error: BaseException) -> None: ...

    def _end(self) -> None: ...

    def _finished(self) -> None: ...


class TrioFeed(Generic[T]):
    """The loop side's handle on a trio pump feeding a :class:`LoopSink` (``Edge.trio_feed``); loop thread only."""

    __slots__ = ("_link", "_pump", "_stop_sent")

    def __init__(self, link: Link, pump: _TrioPump[T]) -> None:
        self._link: Final = link
        self._pump: Final = pump
        self._stop_sent = False

    def cancel(self, reason: str) -> None:
        """Cancel the trio task (its scope, with ``reason``); idempotent. The sink still hears ``_finished``."""
        if not self._stop_sent:
            self._stop_sent = True
            self._link.to_trio(self._pump.cancel, reason)

    def credit(self) -> None:
        """The sink's ``taken`` grew: wake the pump if it waits for room (a pump that does not costs no post)."""
        if self._pump.wants_credit:
            self._link.to_trio(self._pump.credit)


class _TrioPump(Generic[T]):
    """The trio half of an :class:`AsyncioBatchStream`: iterates ``fn()`` in trio and posts batches to the loop.

    Same rules as the asyncio pump, reversed: the first item of a batch schedules a flush through the trio token
    (it runs only once this task yields), a full batch is flushed at once followed by a checkpoint, and at
    ``high_water`` items posted but not taken (``_posted - sink.taken``) the task waits for the asyncio consumer to
    take some; only a waiting pump asks to be woken (``wants_credit``).
    """

    __slots__ = ("_args", "_batch", "_credit", "_fn", "_high_water", "_link", "_max_batch", "_name", "_posted",
                 "_scope", "_sink", "wants_credit")  # fmt: skip

    def __init__(
        self,
        link: Link,
        sink: LoopSink[T],
        fn: Callable[..., AsyncIterator[T]],
        args: tuple[object, ...],
        high_water: int,
        name: str,
    ) -> None:
        self._link: Final = link
        self._sink: Final = sink
        # fn and its arguments rather than a closure over them: one object less per stream.
        self._fn: Final = fn
        self._args: Final = args
        self._high_water: Final = high_water
        self._max_batch: Final = min(high_water, MAX_BATCH)
        self._name: Final = name
        # trio
        self._scope: trio.CancelScope | None = None
        self._credit: trio.Event | None = None
        self._batch: list[T] = []
        self._posted = 0  # items posted to the loop so far
        # Written by this pump, read on the loop: the pump waits for the consumer to take items.
        self.wants_credit = False

    def spawn(self, nursery: trio.Nursery) -> None:
        """trio callback: start the task in ``nursery``, or tell the consumer why not."""
        # Created here so that a cancel posted right after this callback always finds it (the queue is FIFO); a
        # scope cancelled before it is entered is born cancelled.
        self._scope = trio.CancelScope()
        try:
            nursery.start_soon(self._run, name=self._name)
        except RuntimeError as exc:  # "Nursery is closed to new arrivals"
            self._link.to_loop(self._sink._fail, _closed_nursery(self._name, exc))
            self._link.to_loop(self._sink._finished)

    def cancel(self, reason: str) -> None:
        """trio callback: the asyncio consumer left."""
        if self._scope is not None:
            self._scope.cancel(reason=reason)

    def credit(self) -> None:
        """trio callback: the consumer took items while the pump was waiting for room."""
        if self._credit is not None:
            self._credit.set()

    def _flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self._posted += len(batch)
            if not self._link.to_loop(self._sink._deliver, batch) and self._scope is not None:
                self._scope.cancel(reason="the edge loop is closed")

    async def _run(self) -> None:
        assert self._scope is not None
        try:
            with self._scope:
                await self._pump()
            if not self._scope.cancelled_caught:  # caught = the consumer asked us to stop, it needs no answer
                self._flush()
                self._link.to_loop(self._sink._end)
        except trio.Cancelled as exc:
            self._flush()
            self._link.to_loop(self._sink._fail, BridgeCancelled(f"the trio task was cancelled: {exc}"))
            raise
        except Exception as exc:
            self._flush()
            self._link.to_loop(self._sink._fail, exc)
        except BaseException as exc:
            self._link.to_loop(self._sink._fail, EdgeClosed(f"the trio task died: {exc!r}"))
            raise
        finally:
            self._link.to_loop(self._sink._finished)

    async def _wait_for_credit(self) -> None:
        self._credit = credit = trio.Event()
        self.wants_credit = True
        try:
            # A second look after raising the flag (see _Pump._wait_for_credit in _to_asyncio).
            if self._posted - self._sink.taken >= self._high_water:
                await credit.wait()
        finally:
            self.wants_credit = False
            self._credit = None

    async def _pump(self) -> None:
        iterator = self._fn(*self._args)
        try:
            while True:
                pending = len(self._batch)
                if pending >= self._max_batch or self._posted - self._sink.taken + pending >= self._high_water:
                    self._flush()
                    await trio.lowlevel.checkpoint()
                    while self._posted - self._sink.taken >= self._high_water:
                        await self._wait_for_credit()
                    continue
                try:
                    item = await iterator.__anext__()
                except StopAsyncIteration:
                    return
                if not self._batch:
                    self._link.to_trio(self._flush)
                self._batch.append(item)
        finally:
            await aclose_iterator(iterator)


def start_trio_stream(
    link: Link,
    nursery: trio.Nursery,
    fn: Callable[..., AsyncIterator[T]],
    args: tuple[object, ...],
    high_water: int,
    name: str,
) -> AsyncioBatchStream[T]:
    """Loop thread: start ``fn(*args)`` as a trio task in ``nursery`` and return the asyncio side of its stream."""
    if high_water < 1:
        raise ValueError(f"high_water must be at least 1, not {high_water}")
    stream: AsyncioBatchStream[T] = AsyncioBatchStream(link)
    stream._pump = pump = _TrioPump(link, stream, fn, args, high_water, name)
    if not link.to_trio(pump.spawn, nursery):
        stream._fail(EdgeClosed(f"cannot start {name}: the trio run has finished"))
        stream._finished()
    return stream


def start_trio_feed(
    link: Link,
    nursery: trio.Nursery,
    sink: LoopSink[T],
    fn: Callable[..., AsyncIterator[T]],
    args: tuple[object, ...],
    high_water: int,
    name: str,
) -> TrioFeed[T]:
    """Loop thread: start ``fn(*args)`` as a trio task in ``nursery`` feeding ``sink``; return the sink's handle."""
    if high_water < 1:
        raise ValueError(f"high_water must be at least 1, not {high_water}")
    pump = _TrioPump(link, sink, fn, args, high_water, name)
    if not link.to_trio(pump.spawn, nursery):
        sink._fail(EdgeClosed(f"cannot start {name}: the trio run has finished"))
        sink._finished()
    return TrioFeed(link, pump)


class _TrioCall(Generic[T]):
    """One asyncio -> trio call: a trio task in the caller's nursery whose outcome resolves an asyncio future."""

    __slots__ = ("_fn", "_future", "_link", "_name", "_scope")

    def __init__(self, link: Link, fn: Callable[[], Awaitable[T]], name: str) -> None:
        self._link: Final = link
        self._fn: Final = fn
        self._name: Final = name
        self._future: Final[asyncio.Future[T]] = link.loop.create_future()  # loop
        self._scope: trio.CancelScope | None = None  # trio

    async def result(self) -> T:
        """Loop thread: wait for the trio task; cancelling the waiting asyncio task cancels the trio task."""
        try:
            return await self._future
        except asyncio.CancelledError:
            if self._future.cancelled():
                self._link.to_trio(self.cancel, "the asyncio caller was cancelled")
            raise

    def spawn(self, nursery: trio.Nursery) -> None:
        """trio callback: start the task in ``nursery``, or resolve the future with the reason it could not start."""
        self._scope = trio.CancelScope()
        try:
            nursery.start_soon(self._run, name=self._name)
        except RuntimeError as exc:
            self._link.to_loop(self._resolve, outcome.Error(_closed_nursery(self._name, exc)))

    def cancel(self, reason: str) -> None:
        """trio callback: the asyncio caller is gone."""
        if self._scope is not None:
            self._scope.cancel(reason=reason)

    async def _run(self) -> None:
        assert self._scope is not None
        result: outcome.Outcome[T] | None = None
        try:
            with self._scope:
                result = outcome.Value(await self._fn())
        except trio.Cancelled as exc:
            self._link.to_loop(self._resolve, outcome.Error(BridgeCancelled(f"the trio task was cancelled: {exc}")))
            raise
        except Exception as exc:
            self._link.to_loop(self._resolve, outcome.Error(exc))
        except BaseException as exc:
            self._link.to_loop(self._resolve, outcome.Error(EdgeClosed(f"the trio task died: {exc!r}")))
            raise
        else:
            if result is not None:  # None = our scope caught the cancel: the caller is gone and waits for nothing
                self._link.to_loop(self._resolve, result)

    def _resolve(self, result: outcome.Outcome[T]) -> None:
        # loop thread; the future is already cancelled when its waiter was
        if self._future.done():
            return
        if isinstance(result, outcome.Value):
            self._future.set_result(result.value)
            return
        assert isinstance(result, outcome.Error)
        try:
            self._future.set_exception(result.error)
        except TypeError:  # asyncio refuses StopIteration in a future
            error = RuntimeError(f"the trio task raised {result.error!r}")
            error.__cause__ = result.error
            self._future.set_exception(error)


def start_trio_call(link: Link, nursery: trio.Nursery, fn: Callable[[], Awaitable[T]], name: str) -> _TrioCall[T]:
    """Loop thread: start ``fn()`` as a trio task in ``nursery``; await ``.result()`` for its outcome."""
    call = _TrioCall(link, fn, name)
    if not link.to_trio(call.spawn, nursery):
        call._resolve(outcome.Error(EdgeClosed(f"cannot start {name}: the trio run has finished")))
    return call
