"""``Edge.run``: one trio -> asyncio call. Result, exception identity, and cancellation in both directions."""

from __future__ import annotations

import asyncio
import threading
import traceback
from typing import TYPE_CHECKING

import pytest
import trio

from sidecar.edge import BridgeCancelled, EdgeClosed, open_edge

from ._helpers import TIMEOUT, Boom

if TYPE_CHECKING:
    from sidecar.edge import Edge


async def test_run_returns_the_result_computed_on_the_edge_loop(edge: Edge) -> None:
    async def where(value: str) -> tuple[str, str, asyncio.AbstractEventLoop]:
        await asyncio.sleep(0)
        return value, threading.current_thread().name, asyncio.get_running_loop()

    with trio.fail_after(TIMEOUT):
        value, thread_name, loop = await edge.run(where, "x")

    assert value == "x"
    assert thread_name == "edge-under-test"
    assert loop is edge.loop
    assert type(loop).__module__.startswith("uvloop")


async def test_run_accepts_any_awaitable_factory(edge: Edge) -> None:
    def future_of(value: int) -> asyncio.Future[int]:
        future = asyncio.get_running_loop().create_future()  # only valid on the edge thread
        future.get_loop().call_later(0.001, future.set_result, value)
        return future

    with trio.fail_after(TIMEOUT):
        assert await edge.run(future_of, 7) == 7


async def test_run_raises_the_same_exception_object_with_its_traceback(edge: Edge) -> None:
    boom = Boom("from asyncio")

    async def fail_on_the_loop() -> None:
        await asyncio.sleep(0)
        raise boom

    with trio.fail_after(TIMEOUT), pytest.raises(Boom) as raised:
        await edge.run(fail_on_the_loop)

    assert raised.value is boom
    assert "fail_on_the_loop" in [frame.name for frame in traceback.extract_tb(boom.__traceback__)]


async def test_cancelling_the_trio_caller_cancels_the_asyncio_task_and_waits_for_its_cleanup(edge: Edge) -> None:
    token = trio.lowlevel.current_trio_token()
    started = trio.Event()
    seen: list[str] = []

    async def slow() -> None:
        token.run_sync_soon(started.set)
        try:
            # Not a synchronisation: a task that would run long, to be cancelled.
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            await asyncio.sleep(0.05)  # cleanup that needs the loop, like grpclib sending RST_STREAM
            seen.append("cleaned up")
            raise

    async def caller() -> None:
        await edge.run(slow)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            await started.wait()
            nursery.cancel_scope.cancel(reason="test")

    assert seen == ["cancelled", "cleaned up"]


async def test_cancel_waits_at_most_about_a_second_for_an_asyncio_task_that_ignores_it(edge: Edge) -> None:
    token = trio.lowlevel.current_trio_token()
    started = trio.Event()

    async def stubborn() -> None:
        token.run_sync_soon(started.set)
        try:
            # Not a synchronisation: a task that would run long, to be cancelled.
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(2.5)  # ignores the cancel; the loop's shutdown cancels it again at teardown

    with trio.fail_after(TIMEOUT):
        with trio.move_on_after(60) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(edge.run, stubborn)
                await started.wait()
                cancelled_at = trio.current_time()
                scope.cancel()
        waited = trio.current_time() - cancelled_at

    assert 0.9 <= waited < 2.0


async def test_an_asyncio_task_cancelled_by_someone_else_raises_bridge_cancelled(edge: Edge) -> None:
    async def cancel_myself() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        # Not a synchronisation: the point where the task's own cancel lands.
        await asyncio.sleep(1)

    with trio.fail_after(TIMEOUT), pytest.raises(BridgeCancelled):
        await edge.run(cancel_myself)


async def test_a_call_still_running_when_the_edge_closes_raises_edge_closed() -> None:
    token = trio.lowlevel.current_trio_token()
    started = trio.Event()
    raised: list[BaseException] = []

    async def forever() -> None:
        token.run_sync_soon(started.set)
        # Not a synchronisation: a task that would run long, to be cancelled.
        await asyncio.sleep(30)

    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge:

            async def caller() -> None:
                try:
                    await edge.run(forever)
                except EdgeClosed as exc:
                    raised.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller)
                await started.wait()
                await edge.aclose()

    assert len(raised) == 1


async def test_run_after_close_raises_edge_closed() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge:
            pass
        with pytest.raises(EdgeClosed):
            await edge.run(asyncio.sleep, 0)
