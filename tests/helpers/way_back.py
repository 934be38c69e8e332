"""How soon a worker serves again once its engine is back, seen from outside: the engine's port and the frontend.

Shared by ``tests/faults/test_way_back.py`` (the bound) and ``bench/way_back.py`` (the figures, beside Dynamo's own
sidecar).
"""

from __future__ import annotations

import re
from typing import Final

import httpx
import trio

from .stack import MODEL

#: The worker's own figure, logged when it serves again after a lost engine (``sidecar.enginewatch``).
OWN_FIGURE: Final = re.compile(r"engine back: serving again (\d+) ms after it accepted a connection")


async def accepts(port: int) -> bool:
    """Does the engine's port on loopback accept a connection now?"""
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return False
    await stream.aclose()
    return True


async def first_accept(port: int, *, every_s: float = 0.002) -> float:
    """The time (trio clock) the engine's port first accepts a connection, probed every ``every_s``."""
    while True:
        if await accepts(port):
            return trio.current_time()
        await trio.sleep(every_s)  # polling another process's port: no event can announce it


async def serves(http: httpx.AsyncClient, url: str) -> bool:
    """The frontend lists the model and answers a one-token completion with 200."""
    try:
        models = [m["id"] for m in (await http.get(f"{url}/v1/models")).json().get("data", [])]
        if MODEL not in models:
            return False
        body = {"model": MODEL, "prompt": "back?", "max_tokens": 1}
        return (await http.post(f"{url}/v1/completions", json=body)).status_code == 200
    except (httpx.HTTPError, ValueError):
        return False


async def serving_after(
    http: httpx.AsyncClient, url: str, since: float, *, poll_s: float, bound_s: float
) -> float | None:
    """Seconds from ``since`` until the frontend serves (polled every ``poll_s``); None if not within ``bound_s``."""
    deadline = since + bound_s
    while trio.current_time() < deadline:
        if await serves(http, url):
            return trio.current_time() - since
        await trio.sleep(poll_s)  # the client's view is polled, as a client would see it
    return None
