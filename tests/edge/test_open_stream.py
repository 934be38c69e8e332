"""``Edge.open_stream``: trio consumes an asyncio async iterator, in batches, with backpressure and prompt cancel.

The producers below stand in for grpclib: ``await queue.get()`` returns at once while messages are queued, exactly
like ``Stream.recv_message`` over a filled HTTP/2 window, so a producer can run for a long time without suspending.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import traceback
from typing import TYPE_CHECKING, Literal

import pytest
import trio

from sidecar.edge._link import Link
from tests.helpers.waits import wait_until

from ._helpers import TIMEOUT, Boom

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from sidecar.edge import Edge

BACKLOG = 10_000


async def bursts(count: int, size: int) -> AsyncIterator[int]:
    """``count`` bursts of ``size`` items that are ready at once, a short real wait between bursts."""
    n = 0
    for _ in range(count):
        for _ in range(size):
            yield n
            n += 1
        # Not a synchronisation: the producer's pace between bursts.
        await asyncio.sleep(0.001)


async def flat_out(produced: list[int]) -> AsyncIterator[int]:
    """Never suspends: the worst case for both loops' fairness."""
    while True:
        produced[0] += 1
        yield produced[0]


async def test_every_item_arrives_in_order_and_bursts_cross_as_batches(edge: Edge) -> None:
    batches: list[list[int]] = []
    with trio.fail_after(TIMEOUT):
        async with edge.open_stream(bursts, 50, 100) as stream:
            async for batch in stream:
                batches.append(batch)

    assert [item for batch in batches for item in batch] == list(range(5000))
    assert all(batches)
    multi = [batch for batch in batches if len(batch) > 1]
    assert multi, "a burst must cross as a batch, not item by item"
    assert sum(map(len, multi)) > 2500
    assert max(map(len, batches)) <= 1024


async def test_a_high_water_of_one_still_delivers_everything(edge: Edge) -> None:
    items: list[int] = []
    with trio.fail_after(TIMEOUT):
        async with edge.open_stream(bursts, 5, 20, high_water=1) as stream:
            async for batch in stream:
                assert len(batch) == 1
                items.extend(batch)
    assert items == list(range(100))


@pytest.mark.parametrize("high_water", [1, 2, 3])
async def test_a_flat_out_producer_at_a_tiny_high_water_never_strands(edge: Edge, high_water: int) -> None:
    """The pump's credit handshake (two one-writer counters and a "wake me" flag) under the most contention: the
    producer hits the mark on every item while trio takes items as fast as it can."""
    produced = [0]
    items: list[int] = []
    with trio.fail_after(TIMEOUT):
        async with edge.open_stream(flat_out, produced, high_water=high_water) as stream:
            async for batch in stream:
                assert len(batch) <= high_water
                items.extend(batch)
                if len(items) >= 3000:
                    break
    assert items[:3000] == list(range(1, 3001))


async def test_a_consumer_that_keeps_up_sends_nothing_back(edge: Edge) -> None:
    """Below the high-water mark the pump never waits, so taking a batch posts nothing to the edge loop."""
    posts: list[str] = []
    to_loop = Link.to_loop

    def counting(link: Link, fn: Callable[..., object], *args: object) -> bool:
        posts.append(getattr(fn, "__name__", "?"))
        return to_loop(link, fn, *args)

    with trio.fail_after(TIMEOUT), pytest.MonkeyPatch.context() as patch:
        patch.setattr(Link, "to_loop", counting)
        async with edge.open_stream(bursts, 20, 5) as stream:
            async for _ in stream:
                pass
    assert stream.taken == 100
    assert "start" in posts, "the count sees the stream's posts"
    assert "credit" not in posts


async def test_an_empty_iterator_ends_without_a_batch(edge: Edge) -> None:
    batches: list[list[int]] = []
    with trio.fail_after(TIMEOUT):
        async with edge.open_stream(bursts, 0, 10) as stream:
            async for batch in stream:
                batches.append(batch)
    assert batches == []


async def test_the_pump_pauses_at_high_water_until_trio_takes_a_batch(edge: Edge) -> None:
    produced = [0]
    with trio.fail_after(TIMEOUT):
        async with edge.open_stream(flat_out, produced, high_water=64) as stream:
            await wait_until(lambda: produced[0] >= 64)
            # Not a synchronisation: a negative check, time for the producer to run past the mark if it would.
            await trio.sleep(0.1)
            assert produced[0] == 64, "the producer ran past the high-water mark"

            batch = await anext(stream)
            await wait_until(lambda: produced[0] >= 64 + len(batch))
            # Not a synchronisation: a negative check, time for the producer to run past the mark if it would.
            await trio.sleep(0.1)
            assert produced[0] == 64 + len(batch)


async def test_an_exception_is_raised_after_every_item_received_before_it(edge: Edge) -> None:
    boom = Boom("after 500")

    async def fail_after_items(n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i
            if i % 7 == 0:
                await asyncio.sleep(0)
        raise boom

    items: list[int] = []

    async def consume() -> None:
        async with edge.open_stream(fail_after_items, 500) as stream:
            async for batch in stream:
                items.extend(batch)

    with trio.fail_after(TIMEOUT), pytest.raises(Boom) as raised:
        await consume()

    assert raised.value is boom
    assert items == list(range(500))
    assert "fail_after_items" in [frame.name for frame in traceback.extract_tb(boom.__traceback__)]


async def test_an_exception_from_the_iterator_factory_crosses_too(edge: Edge) -> None:
    boom = Boom("no stream for you")

    def refuse() -> AsyncIterator[int]:
        raise boom

    async def consume() -> None:
        async with edge.open_stream(refuse) as stream:
            async for _ in stream:
                pass

    with trio.fail_after(TIMEOUT), pytest.raises(Boom) as raised:
        await consume()
    assert raised.value is boom


async def test_two_tasks_cannot_iterate_one_stream(edge: Edge) -> None:
    async def silent() -> AsyncIterator[int]:
        # Not a synchronisation: a producer that never ends by itself.
        await asyncio.sleep(30)
        yield 0

    with trio.fail_after(TIMEOUT):
        async with edge.open_stream(silent) as stream, trio.open_nursery() as nursery:
            nursery.start_soon(anext, stream)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await anext(stream)
            nursery.cancel_scope.cancel()


async def test_high_water_below_one_is_refused(edge: Edge) -> None:
    with pytest.raises(ValueError, match="high_water"):
        async with edge.open_stream(bursts, 1, 1, high_water=0):
            pass


ExitHow = Literal["break", "raise", "cancel", "exhausted"]


@pytest.mark.parametrize("how", ["break", "raise", "cancel", "exhausted"])
async def test_leaving_the_block_closes_the_asyncio_iterator_before_the_exit_returns(edge: Edge, how: ExitHow) -> None:
    events: list[str] = []

    async def tracked(limit: int) -> AsyncIterator[int]:
        try:
            for i in range(limit):
                yield i
                if i % 10 == 0:
                    await asyncio.sleep(0)
        finally:
            events.append("finally")

    limit = 100 if how == "exhausted" else 1_000_000
    with trio.fail_after(TIMEOUT):
        with trio.CancelScope() as scope:
            try:
                async with edge.open_stream(tracked, limit) as stream:
                    async for _ in stream:
                        if how == "break":
                            break
                        if how == "raise":
                            raise Boom("leaving")
                        if how == "cancel":
                            scope.cancel(reason="test")
            except Boom:
                pass
        assert events == ["finally"]


async def _cancel_latency(edge: Edge, mode: str) -> float:
    """Seconds from a trio-side cancel to the asyncio generator's ``finally``, with a large backlog pending."""
    finally_at: list[float] = []
    produced = [0]
    consumed = [0]

    async def backlogged() -> AsyncIterator[int]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(BACKLOG):
            queue.put_nowait(i)
        try:
            while True:
                item = await queue.get()  # returns at once while queued, like grpclib's recv_message
                produced[0] += 1
                yield item
        finally:
            finally_at.append(time.perf_counter())

    async def endless() -> AsyncIterator[int]:
        try:
            while True:
                produced[0] += 1
                yield produced[0]
        finally:
            finally_at.append(time.perf_counter())

    async def consume() -> None:
        if mode == "paused at high water":  # pump parked on credit, ~9,000 items still queued on the asyncio side
            async with edge.open_stream(backlogged, high_water=1024):
                await trio.sleep_forever()
        elif mode == "backlog in trio":  # all 10,000 delivered, none taken; pump parked in queue.get()
            async with edge.open_stream(backlogged, high_water=2 * BACKLOG):
                await trio.sleep_forever()
        else:  # the pump streaming flat out while trio consumes, up to 10,000 items behind
            async with edge.open_stream(endless, high_water=BACKLOG) as stream:
                async for batch in stream:
                    consumed[0] += len(batch)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        if mode == "paused at high water":
            await wait_until(lambda: produced[0] >= 1024)
        elif mode == "backlog in trio":
            await wait_until(lambda: produced[0] >= BACKLOG)
        else:
            await wait_until(lambda: consumed[0] >= BACKLOG)
        # Not a synchronisation: the mode runs a moment before the cancel whose latency is measured.
        await trio.sleep(0.02)
        cancelled_at = time.perf_counter()
        nursery.cancel_scope.cancel(reason="measuring cancel latency")
    assert len(finally_at) == 1
    return finally_at[0] - cancelled_at


@pytest.mark.parametrize("mode", ["paused at high water", "backlog in trio", "flat out"])
async def test_leaving_cancels_the_asyncio_side_within_10_ms_even_with_10000_items_backlogged(
    edge: Edge, mode: str
) -> None:
    with trio.fail_after(TIMEOUT):
        latencies = [await _cancel_latency(edge, mode) for _ in range(7)]
    median = statistics.median(latencies)
    print(f"cancel latency ({mode}): median {median * 1e3:.2f} ms, all {[round(x * 1e3, 2) for x in latencies]} ms")
    assert median < 0.010, latencies


async def test_trio_keeps_ticking_while_a_flat_out_asyncio_producer_streams(edge: Edge) -> None:
    lateness: list[float] = []
    produced = [0]
    items = 0
    stop = trio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            before = trio.current_time()
            # Not a synchronisation: the ticker's period (its lateness is what is measured).
            await trio.sleep(0.005)
            lateness.append(trio.current_time() - before - 0.005)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            deadline = trio.current_time() + 1.0
            async with edge.open_stream(flat_out, produced) as stream:
                async for batch in stream:
                    items += len(batch)
                    if trio.current_time() >= deadline:
                        break
            stop.set()

    print(f"trio ticker: {len(lateness)} ticks, lateness max {max(lateness) * 1e3:.1f} ms, "
          f"p50 {statistics.median(lateness) * 1e3:.1f} ms; {items} items streamed")  # fmt: skip
    assert items > 10_000
    assert len(lateness) > 50
    assert statistics.median(lateness) < 0.010
    assert max(lateness) < 0.100


async def test_the_pump_does_not_starve_other_asyncio_work(edge: Edge) -> None:
    produced = [0]
    lateness: list[float] = []

    async def asyncio_ticker(duration: float) -> None:
        end = time.perf_counter() + duration  # not loop.time(): uvloop's clock has millisecond resolution
        while time.perf_counter() < end:
            before = time.perf_counter()
            # Not a synchronisation: the other asyncio work's period (its lateness is what is measured).
            await asyncio.sleep(0.005)
            lateness.append(time.perf_counter() - before - 0.005)

    async def tick() -> None:
        await edge.run(asyncio_ticker, 1.0)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            async with edge.open_stream(flat_out, produced) as stream:
                async for _ in stream:
                    if len(lateness) > 100:
                        break
            nursery.cancel_scope.cancel()

    print(f"asyncio ticker: {len(lateness)} ticks, lateness max {max(lateness) * 1e3:.1f} ms; {produced[0]} produced")
    assert produced[0] > 10_000
    assert max(lateness) < 0.100
