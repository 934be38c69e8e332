"""``Link``: posts cross in order, a burst into trio wakes it once, and nothing strands however posts race."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from typing import TYPE_CHECKING, Any

import pytest
import trio

from sidecar.edge import Edge
from sidecar.edge._link import Link
from tests.helpers.waits import wait_until

from ._helpers import TIMEOUT

if TYPE_CHECKING:
    from collections.abc import Callable


class CountingToken:
    """A trio token that counts the wakeups posted through it."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self.token = token
        self.posts = 0

    def run_sync_soon(self, fn: Callable[..., object], *args: object) -> None:
        self.posts += 1
        self.token.run_sync_soon(fn, *args)


class CountingLoop:
    """Forwards to a real loop, counting ``call_soon_threadsafe``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.posts = 0

    def call_soon_threadsafe(self, fn: Callable[..., object], *args: object) -> Any:
        self.posts += 1
        return self.loop.call_soon_threadsafe(fn, *args)

    def is_closed(self) -> bool:
        return self.loop.is_closed()


def counting_link(edge: Edge) -> tuple[Link, CountingToken, CountingLoop]:
    token = CountingToken(trio.lowlevel.current_trio_token())
    loop = CountingLoop(edge.loop)
    return Link(loop, token), token, loop  # type: ignore[arg-type]


async def test_a_burst_from_the_loop_runs_in_order_with_one_wakeup_per_burst(edge: Edge) -> None:
    link, token, _ = counting_link(edge)
    seen: list[int] = []

    def burst() -> None:  # on the loop thread, without yielding: trio cannot drain in between
        for i in range(1000):
            assert link.to_trio(seen.append, i)

    with trio.fail_after(TIMEOUT):
        await edge.run(_as_coroutine(burst))
        await wait_until(lambda: len(seen) == 1000)
    assert seen == list(range(1000))
    # One per burst, plus one each time trio drained while the loop thread was still posting (GIL switches).
    assert token.posts <= 20


async def test_posts_from_trio_run_on_the_loop_in_order(edge: Edge) -> None:
    link, _, loop = counting_link(edge)
    seen: list[int] = []
    threads: set[int] = set()

    def record(i: int) -> None:
        threads.add(threading.get_ident())
        seen.append(i)

    with trio.fail_after(TIMEOUT):
        for i in range(1000):
            assert link.to_loop(record, i)
        await wait_until(lambda: len(seen) == 1000)
    assert seen == list(range(1000))
    assert threads == {edge._thread_id}
    assert loop.posts == 1000  # one call_soon_threadsafe each: uvloop coalesces the wakeups itself


async def test_racing_posters_strand_nothing_and_keep_their_own_order(edge: Edge) -> None:
    """Two foreign threads and trio itself post at random moments while trio drains: every callable runs once, and
    each poster's callables run in the order it posted them."""
    link, token, _ = counting_link(edge)
    seen: list[tuple[str, int]] = []
    per_poster = 3000

    def poster(name: str, seed: int) -> None:
        rng = random.Random(seed)
        for i in range(per_poster):
            assert link.to_trio(seen.append, (name, i))
            if rng.random() < 0.05:
                threading.Event().wait(rng.random() / 10_000)

    with trio.fail_after(TIMEOUT):
        threads = [threading.Thread(target=poster, args=(name, n)) for n, name in enumerate(("a", "b"))]
        for thread in threads:
            thread.start()
        rng = random.Random(2)
        for i in range(per_poster):
            assert link.to_trio(seen.append, ("trio", i))
            if rng.random() < 0.1:
                await trio.lowlevel.checkpoint()
        await wait_until(lambda: len(seen) == 3 * per_poster)
        for thread in threads:
            thread.join()
        await trio.sleep(0.05)  # not a synchronisation: a negative check, time for a stray delivery to show
    assert len(seen) == 3 * per_poster
    for name in ("a", "b", "trio"):
        assert [i for who, i in seen if who == name] == list(range(per_poster))
    assert token.posts < len(seen)


async def test_a_raising_callable_is_logged_and_the_rest_of_its_burst_still_runs(
    edge: Edge, caplog: pytest.LogCaptureFixture
) -> None:
    link, _, _ = counting_link(edge)
    seen: list[str] = []

    def broken() -> None:
        raise RuntimeError("callback bug")

    def burst() -> None:
        link.to_trio(seen.append, "before")
        link.to_trio(broken)
        link.to_trio(seen.append, "after")

    with caplog.at_level(logging.ERROR, logger="sidecar.edge"), trio.fail_after(TIMEOUT):
        await edge.run(_as_coroutine(burst))
        await wait_until(lambda: len(seen) == 2)
        link.to_loop(seen.append, "loop-before")
        link.to_loop(broken)
        link.to_loop(seen.append, "loop-after")
        await wait_until(lambda: len(seen) == 4)
    assert seen == ["before", "after", "loop-before", "loop-after"]
    assert any("raised inside trio" in r.getMessage() for r in caplog.records)


def test_posting_into_a_finished_trio_run_is_refused_and_runs_nothing() -> None:
    async def grab() -> trio.lowlevel.TrioToken:
        return trio.lowlevel.current_trio_token()

    token = trio.run(grab)
    link = Link(asyncio.new_event_loop(), token)
    ran: list[int] = []
    try:
        assert link.to_trio(ran.append, 1) is False
        assert link.to_trio(ran.append, 2) is False
    finally:
        link.loop.close()
    assert ran == []
    assert not link._trio_jobs


def test_posting_onto_a_closed_loop_is_refused() -> None:
    async def grab() -> trio.lowlevel.TrioToken:
        return trio.lowlevel.current_trio_token()

    loop = asyncio.new_event_loop()
    loop.close()
    link = Link(loop, trio.run(grab))
    assert link.to_loop(print, 1) is False


def _as_coroutine(fn: Callable[[], None]) -> Callable[[], Any]:
    async def run() -> None:
        fn()

    return run
