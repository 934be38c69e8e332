"""asyncio calls into trio: one awaited call (``Edge.trio_call``).

The mirror image of ``_to_asyncio``'s ``AsyncioCall``: the trio task runs in a nursery the caller owns, the asyncio
side only waits. Attributes commented "trio" are touched only in trio's thread, "loop" only on the edge loop thread.
(A request's stream no longer crosses here batch by batch: its data path stays on the loop, ``sidecar.datapath``.)
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Final, Generic, TypeVar

import outcome
import trio

from ._errors import BridgeCancelled, EdgeClosed

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._link import Link

__all__ = ["start_trio_call"]

T = TypeVar("T")


def _closed_nursery(name: str, exc: RuntimeError) -> EdgeClosed:
    error = EdgeClosed(f"cannot start {name} in trio: {exc}")
    error.__cause__ = exc
    return error


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
