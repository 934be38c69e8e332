"""``open_edge`` / ``Edge.aclose``: the thread starts, stops, cancels what is left and never leaks."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

import pytest
import trio

from sidecar.edge import EdgeClosed, open_edge
from sidecar.edge._link import to_trio
from tests.helpers.waits import wait_until

from ._helpers import TIMEOUT

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


def edge_threads(name: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == name]


async def test_open_edge_runs_a_uvloop_loop_on_its_own_thread_and_joins_it_on_exit() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge(name="edge-lifecycle") as edge:
            assert len(edge_threads("edge-lifecycle")) == 1
            assert edge.loop.is_running()
            assert type(edge.loop).__module__.startswith("uvloop")
        assert edge_threads("edge-lifecycle") == []
        assert "closed" in repr(edge)
        with pytest.raises(EdgeClosed):
            _ = edge.loop


async def test_aclose_is_idempotent_and_concurrent_calls_agree() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge(name="edge-twice") as edge:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(edge.aclose)
                nursery.start_soon(edge.aclose)
            assert edge_threads("edge-twice") == []
            await edge.aclose()
        await edge.aclose()
    assert edge_threads("edge-twice") == []


async def test_aclose_finishes_even_when_the_caller_is_already_cancelled() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge(name="edge-cancelled") as edge:
            with trio.CancelScope() as scope:
                scope.cancel()
                await edge.aclose()  # shielded inside
    assert edge_threads("edge-cancelled") == []


async def test_exiting_with_asyncio_tasks_still_running_cancels_them() -> None:
    seen: list[str] = []

    async def background() -> None:
        try:
            # Not a synchronisation: a task that would run long, to be cancelled.
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def spawn() -> None:
        asyncio.get_running_loop().create_task(background())
        await asyncio.sleep(0)

    with trio.fail_after(TIMEOUT):
        async with open_edge(name="edge-leftovers") as edge:
            await edge.run(spawn)
    assert seen == ["cancelled"]
    assert edge_threads("edge-leftovers") == []


async def test_a_stream_still_open_when_the_edge_closes_raises_edge_closed() -> None:
    token = trio.lowlevel.current_trio_token()
    started = trio.Event()

    async def slow() -> AsyncIterator[int]:
        token.run_sync_soon(started.set)
        # Not a synchronisation: a task that would run long, to be cancelled.
        await asyncio.sleep(30)
        yield 1

    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, edge.open_stream(slow) as stream:
            await started.wait()
            await edge.aclose()
            with pytest.raises(EdgeClosed):
                await anext(stream)


async def test_nothing_can_be_started_on_a_closed_edge() -> None:
    async def nothing() -> AsyncIterator[int]:
        return
        yield

    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge:
            pass
    with pytest.raises(EdgeClosed):
        async with edge.open_stream(nothing):
            pass
    with pytest.raises(EdgeClosed):
        await edge.run(asyncio.sleep, 0)


async def test_a_callback_that_raises_in_trio_is_logged_instead_of_crashing_the_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> None:
        raise ZeroDivisionError

    with caplog.at_level(logging.ERROR, logger="sidecar.edge"):
        assert to_trio(trio.lowlevel.current_trio_token(), broken)
        await wait_until(
            lambda: any(record.exc_info and record.exc_info[0] is ZeroDivisionError for record in caplog.records),
            timeout=5,
            what="the callback's error logged",
        )


def test_posting_into_a_finished_trio_run_reports_false_instead_of_raising() -> None:
    async def grab_token() -> trio.lowlevel.TrioToken:
        return trio.lowlevel.current_trio_token()

    token = trio.run(grab_token)
    assert to_trio(token, print) is False


def test_both_trio_streams_share_one_consumer() -> None:
    """Issue 15 item 9: trio's two streams (an asyncio iterator's, a feed's) are one buffer and one way to wait with
    two producers."""
    from sidecar.edge._inbox import Inbox
    from sidecar.edge._to_asyncio import BatchStream, FeedStream, _TrioConsumer

    assert issubclass(_TrioConsumer, Inbox)
    # The shared part lives in the base only: the consumer keeps no copy of it.
    for name in ("_take", "_deliver", "_fail", "_end", "_finished"):
        assert name not in vars(_TrioConsumer), name
    for name in ("_wake", "_pump_gone"):
        assert name in vars(_TrioConsumer), name
    for stream in (BatchStream, FeedStream):
        assert issubclass(stream, _TrioConsumer)
        for name in ("__anext__", "_abort_wait", "_wake", "_pump_gone", "_close"):
            assert name not in vars(stream), (stream.__name__, name)
        # What differs is the producer: how to start it, stop it and give it credit.
        for name in ("__aenter__", "__aexit__", "_credit_if_wanted"):
            assert name in vars(stream), (stream.__name__, name)
