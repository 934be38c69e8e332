"""``Edge.open_feed``: a loop-side producer pushing into trio without a task: order, the error after the items,
backpressure by ``hold``, leaving early, and the loop going away under an open feed."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

from sidecar.edge import Edge, EdgeClosed, Feed, open_edge
from tests.helpers.waits import wait_until

if TYPE_CHECKING:
    pass

TIMEOUT = 10


def pusher(items: list[list[int]], error: BaseException | None = None, delay: float = 0.0) -> Any:
    """A start function pushing ``items`` (one push per list, ``delay`` apart), then ending or failing."""

    def start(feed: Feed[int]) -> None:
        loop = asyncio.get_running_loop()

        def step(i: int) -> None:
            if i < len(items):
                feed.push(list(items[i]))
                loop.call_later(delay, step, i + 1)
            elif error is not None:
                feed.fail(error)
            else:
                feed.end()

        step(0)

    return start


async def test_items_arrive_in_order_then_the_end(edge: Edge) -> None:
    with trio.fail_after(TIMEOUT):
        async with edge.open_feed(pusher([[1, 2], [3], [4, 5, 6]], delay=0.01)) as batches:
            got = [item async for batch in batches for item in batch]
    assert got == [1, 2, 3, 4, 5, 6]


async def drain(edge: Edge, start: Any, got: list[int]) -> None:
    async with edge.open_feed(start) as batches:
        async for batch in batches:
            got.extend(batch)


async def test_the_error_is_raised_after_every_item_before_it(edge: Edge) -> None:
    boom = ValueError("boom")
    got: list[int] = []
    with trio.fail_after(TIMEOUT), pytest.raises(ValueError, match="boom") as caught:
        await drain(edge, pusher([[1], [2, 3]], error=boom), got)
    assert caught.value is boom
    assert got == [1, 2, 3]


async def test_a_producer_holding_back_resumes_when_trio_takes_items(edge: Edge) -> None:
    state: dict[str, Any] = {"pushed": 0, "room_calls": 0}

    def start(feed: Feed[int]) -> None:
        def more() -> None:
            state["room_calls"] += 1
            while state["pushed"] < 100:
                state["pushed"] += 1
                if not feed.push([state["pushed"]]):
                    feed.hold(more)
                    return
            feed.end()

        more()

    with trio.fail_after(TIMEOUT):
        async with edge.open_feed(start, high_water=8) as batches:
            await wait_until(lambda: state["pushed"] >= 8)
            await trio.sleep(0.05)  # not a synchronisation: a negative check, time for a wrong push to show
            assert state["pushed"] == 8, "the producer ran past high_water items not taken"
            got = [item async for batch in batches for item in batch]
    assert got == list(range(1, 101))
    assert state["room_calls"] > 1


async def test_leaving_early_cancels_the_producer_on_the_loop(edge: Edge) -> None:
    cancelled = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def start(feed: Feed[int]) -> None:
        feed.push([1])
        feed.on_cancel = lambda: token.run_sync_soon(cancelled.set)

    with trio.fail_after(TIMEOUT):
        async with edge.open_feed(start) as batches:
            assert await batches.__anext__() == [1]
        # on_cancel ran (on the loop) before leaving returned: its post is already queued in trio.
        with trio.fail_after(1):
            await cancelled.wait()


async def test_a_start_function_that_raises_fails_the_feed(edge: Edge) -> None:
    def start(feed: Feed[int]) -> None:
        raise RuntimeError("could not start")

    got: list[int] = []
    with trio.fail_after(TIMEOUT), pytest.raises(RuntimeError, match="could not start"):
        await drain(edge, start, got)
    assert got == []


async def test_an_open_feed_fails_edge_closed_when_the_loop_shuts_down() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge(name="feed-shutdown") as own:

            def start(feed: Feed[int]) -> None:
                feed.push([7])  # and then nothing: a producer whose loop goes away

            stream = own.open_feed(start)
            await stream.__aenter__()
            assert await stream.__anext__() == [7]
            await own.aclose()
            with pytest.raises(EdgeClosed):
                await stream.__anext__()
            await stream.__aexit__(None, None, None)
