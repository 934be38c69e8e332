"""``Edge.trio_stream`` and ``Edge.trio_call``: asyncio (Dynamo's handler, on the edge thread) drives trio code.

The asyncio side of each test is a coroutine run with ``edge.run``, so it really executes on the edge loop thread
while the trio side runs in a nursery the test owns, as the worker's request nursery would.
"""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from typing import TYPE_CHECKING

import pytest
import trio

from sidecar.edge import BridgeCancelled, EdgeClosed
from tests.helpers.waits import wait_until

from ._helpers import TIMEOUT, Boom

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from sidecar.edge import AsyncioBatchStream, Edge


async def trio_bursts(count: int, size: int) -> AsyncIterator[int]:
    """``count`` bursts of ``size`` items ready at once, a short trio sleep between bursts."""
    n = 0
    for _ in range(count):
        for _ in range(size):
            yield n
            n += 1
        # Not a synchronisation: the producer's pace between bursts.
        await trio.sleep(0.001)


async def one_then_park(cancelled: list[trio.Cancelled]) -> AsyncIterator[int]:
    """One item, then parked in trio until cancelled; records the ``Cancelled`` it receives."""
    yield 0
    try:
        await trio.sleep_forever()
    except trio.Cancelled as exc:
        cancelled.append(exc)
        raise


async def test_trio_stream_delivers_every_item_in_order_and_bursts_cross_as_batches(edge: Edge) -> None:
    async with trio.open_nursery() as nursery:

        async def consume() -> list[list[int]]:
            batches: list[list[int]] = []
            async with contextlib.aclosing(edge.trio_stream(nursery, trio_bursts, 50, 100)) as stream:
                async for batch in stream:
                    batches.append(batch)
            return batches

        with trio.fail_after(TIMEOUT):
            batches = await edge.run(consume)

    assert [item for batch in batches for item in batch] == list(range(5000))
    assert all(batches)
    assert any(len(batch) > 1 for batch in batches), "a burst must cross as a batch, not item by item"
    assert max(map(len, batches)) <= 1024


async def test_trio_stream_raises_the_trio_exception_after_the_items_before_it(edge: Edge) -> None:
    boom = Boom("from trio")

    async def fail_after_items(n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i
            if i % 7 == 0:
                await trio.sleep(0)
        raise boom

    async with trio.open_nursery() as nursery:

        async def consume() -> tuple[list[int], BaseException | None]:
            items: list[int] = []
            async with contextlib.aclosing(edge.trio_stream(nursery, fail_after_items, 300)) as stream:
                try:
                    async for batch in stream:
                        items.extend(batch)
                except Boom as exc:
                    return items, exc
            return items, None

        with trio.fail_after(TIMEOUT):
            items, raised = await edge.run(consume)

    assert raised is boom
    assert items == list(range(300))
    assert "fail_after_items" in [frame.name for frame in traceback.extract_tb(boom.__traceback__)]


async def test_the_trio_producer_pauses_at_high_water_until_asyncio_takes_a_batch(edge: Edge) -> None:
    produced = [0]

    async def counting() -> AsyncIterator[int]:
        while True:
            produced[0] += 1
            yield produced[0]

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def start() -> AsyncioBatchStream[int]:
                return edge.trio_stream(nursery, counting, high_water=32)

            stream = await edge.run(start)
            await wait_until(lambda: produced[0] >= 32)
            # Not a synchronisation: a negative check, time for the producer to run past the mark if it would.
            await trio.sleep(0.1)
            assert produced[0] == 32, "the trio producer ran past the high-water mark"

            batch = await edge.run(anext, stream)
            await wait_until(lambda: produced[0] >= 32 + len(batch))
            # Not a synchronisation: a negative check, time for the producer to run past the mark if it would.
            await trio.sleep(0.1)
            assert produced[0] == 32 + len(batch)
            await edge.run(stream.aclose)


@pytest.mark.parametrize("high_water", [1, 2, 3])
async def test_a_flat_out_trio_producer_at_a_tiny_high_water_never_strands(edge: Edge, high_water: int) -> None:
    """The credit handshake reversed: the trio producer hits the mark on every item, asyncio takes flat out."""

    async def counting() -> AsyncIterator[int]:
        n = 0
        while True:
            n += 1
            yield n

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def consume() -> list[int]:
                items: list[int] = []
                async with contextlib.aclosing(edge.trio_stream(nursery, counting, high_water=high_water)) as stream:
                    async for batch in stream:
                        assert len(batch) <= high_water
                        items.extend(batch)
                        if len(items) >= 3000:
                            break
                return items

            items = await edge.run(consume)
    assert items[:3000] == list(range(1, 3001))


async def test_aclose_cancels_the_trio_task_with_a_reason(edge: Edge) -> None:
    cancelled: list[trio.Cancelled] = []
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def consume_one_then_close() -> list[int]:
                stream = edge.trio_stream(nursery, one_then_park, cancelled)
                first = await anext(stream)
                await stream.aclose()  # waits (bounded) for the trio task to finish
                await stream.aclose()  # idempotent
                return first

            assert await edge.run(consume_one_then_close) == [0]
            assert len(cancelled) == 1

    assert "asyncio consumer closed the stream" in str(cancelled[0])


async def test_cancelling_the_asyncio_consumer_cancels_the_trio_task(edge: Edge) -> None:
    # trio cancels edge.run -> the asyncio consumer task is cancelled in __anext__ -> the trio producer is cancelled.
    token = trio.lowlevel.current_trio_token()
    cancelled: list[trio.Cancelled] = []
    got_first = trio.Event()

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as requests:

            async def consume_forever() -> None:
                async with contextlib.aclosing(edge.trio_stream(requests, one_then_park, cancelled)) as stream:
                    async for _ in stream:
                        token.run_sync_soon(got_first.set)

            async def handler() -> None:
                await edge.run(consume_forever)

            async with trio.open_nursery() as handlers:
                handlers.start_soon(handler)
                await got_first.wait()
                handlers.cancel_scope.cancel(reason="client went away")
            await wait_until(lambda: bool(cancelled))

    assert "asyncio consumer was cancelled" in str(cancelled[0])


async def test_an_outer_trio_cancel_reaches_asyncio_as_bridge_cancelled_with_the_reason(edge: Edge) -> None:
    token = trio.lowlevel.current_trio_token()
    cancelled: list[trio.Cancelled] = []
    got_first = trio.Event()
    raised: list[BaseException | None] = []

    async def handler(requests: trio.Nursery) -> None:
        async def consume() -> BaseException | None:
            async with contextlib.aclosing(edge.trio_stream(requests, one_then_park, cancelled)) as stream:
                try:
                    async for _ in stream:
                        token.run_sync_soon(got_first.set)
                except BridgeCancelled as exc:
                    return exc
            return None

        raised.append(await edge.run(consume))

    with trio.fail_after(TIMEOUT):
        # `requests` stands for the worker's request nursery, which a drain deadline cancels.
        async with trio.open_nursery() as handlers, trio.open_nursery() as requests:
            handlers.start_soon(handler, requests)
            await got_first.wait()
            requests.cancel_scope.cancel(reason="drain deadline")

    assert isinstance(raised[0], BridgeCancelled)
    assert "drain deadline" in str(raised[0])
    assert "drain deadline" in str(cancelled[0])


async def test_trio_stream_into_a_closed_nursery_raises_edge_closed(edge: Edge) -> None:
    async with trio.open_nursery() as nursery:
        pass

    async def consume() -> None:
        async with contextlib.aclosing(edge.trio_stream(nursery, trio_bursts, 1, 1)) as stream:
            with pytest.raises(EdgeClosed, match="closed"):
                await anext(stream)

    with trio.fail_after(TIMEOUT):
        await edge.run(consume)


async def test_trio_stream_and_trio_call_refuse_to_run_off_the_edge_thread(edge: Edge) -> None:
    async with trio.open_nursery() as nursery:
        with pytest.raises(RuntimeError, match="edge loop thread"):
            edge.trio_stream(nursery, trio_bursts, 1, 1)
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
