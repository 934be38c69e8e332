"""The edge thread: one uvloop loop on its own thread, started and joined by trio.

grpclib and Dynamo's bindings are asyncio-only; running them here keeps trio owning the main thread, the signals and
every decision, while their loop never blocks trio's (and vice versa). The crossings themselves live in
``_to_asyncio`` and ``_to_trio``.
"""

from __future__ import annotations

import asyncio
import enum
import threading
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Final, TypeVar, TypeVarTuple

import trio
import uvloop

from ._errors import EdgeClosed, EdgeError
from ._link import Link, logger, to_trio
from ._to_asyncio import AsyncioCall, BatchStream, FeedStream
from ._to_trio import start_trio_call

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

    from ._to_asyncio import Feed

__all__ = ["Edge", "open_edge"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

# Per round of cancelling the loop's leftover tasks, and per asyncgen / executor shutdown step.
_SHUTDOWN_GRACE: Final = 1.0
# Cancelled tasks may spawn cleanup tasks of their own (grpclib does); a second round catches those.
_SHUTDOWN_ROUNDS: Final = 2
# Bounds the whole of aclose(): every shutdown step above, plus slack.
_CLOSE_TIMEOUT: Final = _SHUTDOWN_GRACE * (_SHUTDOWN_ROUNDS + 2) + 1.0


class _State(enum.Enum):
    STARTING = "starting"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


def _name_of(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class Edge:
    """The asyncio edge: one thread running one uvloop loop, and the trio ⇄ asyncio bridge. Get one from
    :func:`open_edge`.

    From trio: :meth:`run` (one call), :meth:`open_stream` and :meth:`open_feed` (consume what the loop produces),
    :meth:`to_loop` (post a callable, without waiting). From the edge loop thread: :meth:`trio_call` (run trio code
    in a given nursery) and :meth:`to_trio` (post a callable into trio).
    """

    def __init__(self, name: str, token: trio.lowlevel.TrioToken) -> None:
        self._name: Final = name
        self._token: Final = token
        self._state = _State.STARTING  # trio
        self._thread: Final = threading.Thread(target=self._main, name=name, daemon=True)
        # Written by the edge thread before it posts `_started`, read by trio after it.
        self._link: Link | None = None
        self._thread_id: int | None = None
        self._start_error: BaseException | None = None
        self._started: Final = trio.Event()
        self._stopped: Final = trio.Event()

    def __repr__(self) -> str:
        return f"<Edge {self._name!r} {self._state.value}>"

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The uvloop loop running on the edge thread (for libraries that want it, e.g. ``DistributedRuntime``)."""
        return self._require_open().loop

    async def run(self, fn: Callable[[*Ts], Awaitable[T]], *args: *Ts) -> T:
        """Run ``fn(*args)`` as an asyncio Task on the edge loop and return its result (trio → asyncio).

        ``fn`` is called on the edge thread. Its exception is raised here as the same object with its traceback.
        Cancelling the calling trio task cancels the asyncio task and waits (at most 1 s) for it to finish before
        ``Cancelled`` propagates. Raises :class:`EdgeClosed` once the edge is closing, and also if the asyncio task
        is cancelled by the loop shutting down; :class:`BridgeCancelled` if anything else cancels it.
        """
        link = self._require_open()
        return await AsyncioCall(link, lambda: fn(*args)).result()

    def to_loop(self, fn: Callable[[*Ts], object], *args: *Ts) -> bool:
        """Run ``fn(*args)`` soon on the edge loop thread, without waiting (from any thread; posts run in order).

        ``False`` once the loop is closed (``fn`` will not run). For fire-and-forget commands such as a request's
        data path (``sidecar.datapath``); :meth:`run` is the call that waits for a result.
        """
        link = self._link
        return link is not None and link.to_loop(fn, *args)

    def to_trio(self, fn: Callable[[*Ts], object], *args: *Ts) -> bool:
        """Run ``fn(*args)`` soon in trio's thread (call it on the edge loop thread; posts run in order, several per
        wakeup of trio). ``fn`` must not block; an exception from it is logged, never raised inside trio. ``False``
        once trio has finished."""
        link = self._link
        return link is not None and link.to_trio(fn, *args)

    def open_stream(self, fn: Callable[[*Ts], AsyncIterator[T]], *args: *Ts, high_water: int = 1024) -> BatchStream[T]:
        """Consume the asyncio async iterator ``fn(*args)`` from trio, as batches (trio → asyncio).

        ``async with edge.open_stream(stub_call, request) as batches: async for batch in batches: ...``

        A pump task on the edge loop iterates ``fn(*args)`` and posts everything it received in one loop iteration as
        one non-empty ``list``; what arrives before the consumer takes it is merged into one batch (at most 1024
        items). It pauses while ``high_water`` items are delivered but not yet taken by the trio consumer. An
        exception from the iterator is raised in trio after every item received before it. Leaving the block
        (normally, by ``break``, an exception or cancellation) stops the pump between two items, cancels it and
        ``aclose()``-s the iterator (for grpclib: RST_STREAM), then waits at most 1 s for that.
        """
        link = self._require_open()
        return BatchStream(link, fn, args, high_water)

    def open_feed(self, start: Callable[[Feed[T], *Ts], None], *args: *Ts, high_water: int = 1024) -> FeedStream[T]:
        """Consume, from trio, items a loop-side producer hands over with callbacks (trio ← asyncio, no pump task).

        ``async with edge.open_feed(start, arg) as batches: async for batch in batches: ...``

        Entering the block calls ``start(feed, *args)`` on the edge loop; the producer then calls ``feed.push(items)``
        from loop callbacks (e.g. a protocol's ``data_received``) and finally ``feed.end()`` or ``feed.fail(error)``;
        batching, the error after the items, backpressure (``feed.push`` returns False at ``high_water`` items not
        taken; ``feed.hold(callback)``) and leaving early (``feed.on_cancel`` runs on the loop; at most 1 s is waited
        for it) are as in :meth:`open_stream`. See :class:`~sidecar.edge._to_asyncio.Feed`.
        """
        link = self._require_open()
        return FeedStream(link, start, args, high_water)

    async def trio_call(self, nursery: trio.Nursery, fn: Callable[[*Ts], Awaitable[T]], *args: *Ts) -> T:
        """Run ``fn(*args)`` as a trio task in ``nursery`` and return its result (asyncio → trio). Await it **on the
        edge loop thread**.

        The trio exception is raised here as the same object. Cancelling the awaiting asyncio task cancels the trio
        task's scope (without waiting for it). Closed nursery or finished trio run: :class:`EdgeClosed`; the trio
        task cancelled from outside: :class:`BridgeCancelled`.
        """
        link = self._require_loop_thread("trio_call")
        return await start_trio_call(link, nursery, lambda: fn(*args), f"trio_call:{_name_of(fn)}").result()

    async def aclose(self) -> None:
        """Stop the loop (cancelling leftover asyncio tasks) and join the thread. Idempotent; shielded and bounded."""
        if self._state is _State.CLOSED:
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT) as bound:
            if self._state is not _State.CLOSING:
                self._state = _State.CLOSING
                await self._started.wait()
                if self._link is not None:
                    self._link.to_loop(self._link.loop.stop)
            await self._stopped.wait()
        if bound.cancelled_caught:
            # Something on the loop ignores cancellation. The thread is a daemon, so it cannot hold up exit.
            logger.warning("edge: thread %r did not stop within %.1f s; abandoning it", self._name, _CLOSE_TIMEOUT)
        else:
            # The thread posted `_stopped` as its last act; what remains is returning from its target.
            self._thread.join(timeout=_SHUTDOWN_GRACE)
        self._state = _State.CLOSED

    async def _start(self) -> None:
        try:
            self._thread.start()
        except BaseException:
            self._state = _State.CLOSED
            raise
        try:
            await self._started.wait()
        except BaseException:
            await self.aclose()
            raise
        if self._start_error is not None or self._stopped.is_set():
            await self.aclose()
            raise EdgeError(f"edge thread {self._name!r} could not start its loop") from self._start_error
        if self._state is _State.STARTING:
            self._state = _State.OPEN

    def _require_open(self) -> Link:
        if self._state is not _State.OPEN or self._link is None:
            raise EdgeClosed(f"edge {self._name!r} is {self._state.value}")
        return self._link

    def _require_loop_thread(self, what: str) -> Link:
        if self._link is None or threading.get_ident() != self._thread_id:
            raise RuntimeError(f"Edge.{what} must be called on the edge loop thread {self._name!r}")
        if self._link.shutting_down:
            raise EdgeClosed(f"edge {self._name!r} is shutting down")
        return self._link

    # edge thread

    def _main(self) -> None:
        try:
            loop = uvloop.new_event_loop()
        except BaseException as exc:
            self._start_error = exc
            to_trio(self._token, self._started.set)
            to_trio(self._token, self._stopped.set)
            return
        link = Link(loop, self._token)
        asyncio.set_event_loop(loop)
        self._thread_id = threading.get_ident()
        self._link = link
        # Reported from inside the loop, so that "started" means "running".
        loop.call_soon(to_trio, self._token, self._started.set)
        try:
            loop.run_forever()
        finally:
            link.shutting_down = True
            try:
                _shut_down(loop)
            except BaseException:
                logger.exception("edge: shutting down loop %r failed", self._name)
            finally:
                # Feeds have no task the shutdown could cancel: their producers (protocol callbacks) are gone now.
                for feed in list(link.feeds):
                    feed.fail(EdgeClosed("the edge loop shut down under this stream"))
                asyncio.set_event_loop(None)
                loop.close()
                to_trio(self._token, self._started.set)  # no-op unless the loop died before it ever ran
                to_trio(self._token, self._stopped.set)


def _shut_down(loop: asyncio.AbstractEventLoop) -> None:
    """Edge thread, after ``run_forever`` returned: what ``asyncio.run`` does on exit, but every step time-bounded."""
    for _ in range(_SHUTDOWN_ROUNDS):
        tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
        if not tasks:
            break
        for task in tasks:
            task.cancel(msg="the edge loop is shutting down")
        loop.run_until_complete(asyncio.wait(tasks, timeout=_SHUTDOWN_GRACE))
    if leftovers := [task for task in asyncio.all_tasks(loop) if not task.done()]:
        logger.warning("edge: %d asyncio task(s) ignored cancellation at shutdown: %r", len(leftovers), leftovers)
    for step in (loop.shutdown_asyncgens, loop.shutdown_default_executor):
        task = loop.create_task(step())
        loop.run_until_complete(asyncio.wait({task}, timeout=_SHUTDOWN_GRACE))
        if not task.done():
            task.cancel()
            logger.warning("edge: %s did not finish within %.1f s", step.__name__, _SHUTDOWN_GRACE)


@asynccontextmanager
async def open_edge(*, name: str = "asyncio-edge") -> AsyncGenerator[Edge, None]:
    """Start the edge thread and its uvloop loop; on exit cancel whatever still runs there and join the thread.

    ``name`` names the thread. Exit is shielded and bounded (a few seconds at worst), so it is safe under cancellation.
    """
    edge = Edge(name, trio.lowlevel.current_trio_token())
    await edge._start()
    try:
        yield edge
    finally:
        await edge.aclose()
