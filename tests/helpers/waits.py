"""The one way a test waits for something to happen: :func:`wait_until` polls a condition, bounded.

Tests wait on events, never on time (``tests/conftest.py``): a ``sleep`` that stands for "by now X happened" is
replaced by a wait on X. Where the code under test offers an event (a ``trio.Event``, a machine state observer, a log
line, a port file), wait on that; where X can only be observed from outside (another thread, another process, an HTTP
endpoint, the engine's ``GetLoad``), poll it here.

Works under trio and under asyncio (the mock's tests and the asyncio side of the edge), on the running library's clock:
under ``autojump_clock`` both the polling interval and the timeout are virtual time.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

import sniffio
import trio

T = TypeVar("T")

#: How often a condition is polled by default (seconds).
POLL_INTERVAL = 0.01
#: The default bound (seconds): generous, for a condition inside a test that has a tighter ``fail_after`` of its own.
DEFAULT_TIMEOUT = 60.0


class WaitTimeout(TimeoutError):
    """A condition did not hold within its bound."""


@overload
async def wait_until(
    condition: Callable[[], Awaitable[T]],
    *,
    timeout: float = ...,
    interval: float = ...,
    what: str | None = ...,
    retry_on: tuple[type[BaseException], ...] = ...,
) -> T: ...


@overload
async def wait_until(
    condition: Callable[[], T],
    *,
    timeout: float = ...,
    interval: float = ...,
    what: str | None = ...,
    retry_on: tuple[type[BaseException], ...] = ...,
) -> T: ...


async def wait_until(
    condition: Callable[[], object],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = POLL_INTERVAL,
    what: str | None = None,
    retry_on: tuple[type[BaseException], ...] = (),
) -> object:
    """Poll ``condition`` (a function, sync or async) until it returns something truthy, and return that.

    Checks at once, then every ``interval`` seconds; after ``timeout`` seconds raises :class:`WaitTimeout` naming
    ``what`` (or the condition) and its last value. Exceptions listed in ``retry_on`` count as "not yet" (a server
    that is still starting); any other exception propagates at once.
    """
    library = sniffio.current_async_library()
    clock, sleep = (trio.current_time, trio.sleep) if library == "trio" else (_asyncio_time, asyncio.sleep)
    deadline = clock() + timeout
    last: object = None
    while True:
        try:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
        except retry_on as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if clock() >= deadline:
            name = what or getattr(condition, "__qualname__", repr(condition))
            raise WaitTimeout(f"{name}: not true within {timeout} s (last: {last!r})")
        await sleep(interval)


def _asyncio_time() -> float:
    return asyncio.get_running_loop().time()
