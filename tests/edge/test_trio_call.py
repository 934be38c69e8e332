"""``Edge.trio_call``: asyncio (Dynamo's control endpoints, on the edge thread) awaits trio code.

The asyncio side of each test is a coroutine run with ``edge.run``, so it really executes on the edge loop thread
while the trio side runs in a nursery the test owns, as the worker's request nursery would.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import pytest
import trio

from sidecar.edge import EdgeClosed
from tests.helpers.waits import wait_until

from ._helpers import TIMEOUT, Boom

if TYPE_CHECKING:
    from sidecar.edge import Edge


async def test_trio_call_refuses_to_run_off_the_edge_thread(edge: Edge) -> None:
    async with trio.open_nursery() as nursery:
        with pytest.raises(RuntimeError, match="edge loop thread"):
            await edge.trio_call(nursery, trio.sleep, 0)


async def test_trio_call_returns_the_result_and_raises_the_same_exception(edge: Edge) -> None:
    boom = Boom("from trio")

    async def double(x: int) -> int:
        await trio.sleep(0)
        return 2 * x

    async def fail() -> int:
        await trio.sleep(0)
        raise boom

    async with trio.open_nursery() as nursery:

        async def calls() -> tuple[int, BaseException | None]:
            result = await edge.trio_call(nursery, double, 21)
            try:
                await edge.trio_call(nursery, fail)
            except Boom as exc:
                return result, exc
            return result, None

        with trio.fail_after(TIMEOUT):
            result, raised = await edge.run(calls)

    assert result == 42
    assert raised is boom


async def test_cancelling_the_asyncio_caller_of_trio_call_cancels_the_trio_task(edge: Edge) -> None:
    cancelled: list[trio.Cancelled] = []

    async def parked() -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled as exc:
            cancelled.append(exc)
            raise

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def call_then_give_up() -> None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await edge.trio_call(nursery, parked)

            await edge.run(call_then_give_up)
            await wait_until(lambda: bool(cancelled))

    assert "asyncio caller was cancelled" in str(cancelled[0])


async def test_trio_call_into_a_closed_nursery_raises_edge_closed(edge: Edge) -> None:
    async with trio.open_nursery() as nursery:
        pass

    async def call() -> None:
        with pytest.raises(EdgeClosed):
            await edge.trio_call(nursery, trio.sleep, 0)

    with trio.fail_after(TIMEOUT):
        await edge.run(call)
