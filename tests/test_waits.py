"""``tests.helpers.waits.wait_until``: the one polling helper, under trio (virtual time) and asyncio."""

from __future__ import annotations

import asyncio

import pytest
import trio
import trio.testing

from tests.helpers.waits import WaitTimeout, wait_until


async def test_it_returns_the_first_truthy_value(autojump_clock: trio.testing.MockClock) -> None:
    values: list[object] = [0, None, [], "ready"]
    answers = iter(values)
    start = trio.current_time()
    assert await wait_until(lambda: next(answers), timeout=10, interval=0.5) == "ready"
    assert trio.current_time() - start == pytest.approx(1.5)


async def test_it_awaits_an_async_condition(autojump_clock: trio.testing.MockClock) -> None:
    event = trio.Event()

    async def is_set() -> bool:
        await trio.lowlevel.checkpoint()
        return event.is_set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_set_later, event)
        assert await wait_until(is_set, timeout=10) is True


async def _set_later(event: trio.Event) -> None:
    await trio.sleep(3)
    event.set()


async def test_it_fails_after_its_bound_naming_what_and_the_last_value(autojump_clock: trio.testing.MockClock) -> None:
    start = trio.current_time()
    with pytest.raises(WaitTimeout, match=r"the engine idle: not true within 2 s \(last: 0\)"):
        await wait_until(lambda: 0, timeout=2, what="the engine idle")
    assert trio.current_time() - start == pytest.approx(2, abs=0.02)


async def test_listed_exceptions_mean_not_yet_others_propagate(autojump_clock: trio.testing.MockClock) -> None:
    attempts = 0

    def starting() -> int:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise ConnectionRefusedError
        return attempts

    assert await wait_until(starting, timeout=5, retry_on=(ConnectionRefusedError,)) == 3
    with pytest.raises(ZeroDivisionError):
        await wait_until(lambda: 1 // 0, timeout=5, retry_on=(ConnectionRefusedError,))


def test_it_polls_on_asyncio_too() -> None:
    async def main() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        box: list[int] = []
        loop.call_later(0.05, box.append, 7)
        value = await wait_until(lambda: box[0] if box else 0, timeout=5, interval=0.005)
        with pytest.raises(WaitTimeout):
            await wait_until(lambda: False, timeout=0.05)
        return value, loop.time() - start

    value, elapsed = asyncio.run(main())
    assert value == 7
    assert elapsed < 5
