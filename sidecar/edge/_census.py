"""How many asyncio tasks live on an edge loop, asked from any thread (the metrics scrape runs on Dynamo's)."""

from __future__ import annotations

import asyncio


def loop_tasks(loop: asyncio.AbstractEventLoop) -> int:
    """Live (not done) tasks on ``loop``. ``asyncio.all_tasks`` copies its weak set with retries, so another thread
    may ask while the loop runs; a closed loop has none left."""
    return len(asyncio.all_tasks(loop))
