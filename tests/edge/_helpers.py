"""Small helpers shared by the edge tests."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import trio

if TYPE_CHECKING:
    from collections.abc import Callable

# The absolute bound on every test body (rule: a hang fails, it never blocks CI).
TIMEOUT: Final = 20.0


class Boom(Exception):
    """An exception that only the test raises, so identity checks cannot be fooled."""


async def wait_until(predicate: Callable[[], bool], *, interval: float = 0.002) -> None:
    """Poll ``predicate`` (state written by the other thread) until it holds; bounded by the caller's ``fail_after``."""
    while not predicate():
        await trio.sleep(interval)
