"""The ops port: the live state page and its websocket feed on one loopback-by-default TCP port.

    GET /           the page (``sidecar.ops.page``)
    GET /ws         websocket upgrade: the feed (``sidecar.ops.feed``): a snapshot, then batches of transitions
    GET /snapshot   the snapshot as plain JSON (for curl)

One port, two protocols: each connection's request head is read and parsed here (h11) first; a websocket upgrade
is then handed to trio-websocket's ``wrap_server_stream`` over a stream that replays the bytes already read, anything
else gets a plain HTTP/1.1 response and the connection is closed. Every connection is bounded: 10 s to send its
head, at most 16 KiB of it, and a websocket that stops reading is dropped by the feed (never buffered without bound).
Read-only by design: nothing on this port changes the worker.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from http import HTTPStatus
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

import h11
import trio
from trio_websocket import ConnectionClosed, wrap_server_stream

from .page import render_page

if TYPE_CHECKING:
    from trio_websocket import WebSocketConnection

    from statemachines import WorkerLifecycle

    from .feed import StateFeed

__all__ = ["HEAD_TIMEOUT_S", "MAX_HEAD_BYTES", "read_head", "read_request", "respond", "serve_live_state", "serve_ops"]

log: Final = logging.getLogger("sidecar.ops")

HEAD_TIMEOUT_S: Final = 10.0
MAX_HEAD_BYTES: Final = 16 * 1024
_CLOSE_TIMEOUT_S: Final = 2.0
# 1013 "Try Again Later": the server dropped a subscriber that could not keep up.
_SLOW_CONSUMER_CODE: Final = 1013
_GOING_AWAY: Final = 1001

_CSP: Final = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'"
)


class _Replay(trio.abc.Stream):
    """A stream whose first bytes are ``prefix`` (already read from ``stream``), then ``stream``'s own."""

    def __init__(self, stream: trio.abc.Stream, prefix: bytes) -> None:
        self._stream = stream
        self._prefix = prefix

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._prefix:
            await trio.lowlevel.checkpoint()
            size = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:size], self._prefix[size:]
            return data
        return await self._stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


async def read_head(stream: trio.abc.Stream) -> bytes | None:
    """Everything received up to and including the end of the request head (None: EOF or too long)."""
    data = bytearray()
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD_BYTES:
            return None
        chunk = await stream.receive_some(4096)
        if not chunk:
            return None
        data += chunk
    return bytes(data)


async def read_request(stream: trio.abc.Stream) -> tuple[h11.Connection, h11.Request, bytes] | None:
    """The request head, parsed: (connection, request, raw head).

    None when there is nothing to answer: EOF, a head too long, or one that is not HTTP (answered 400 here).
    """
    head = await read_head(stream)
    if head is None:
        return None
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(head)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError:
        event = None
    if not isinstance(event, h11.Request):
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        return None
    return conn, event, head


async def respond(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    status: int,
    content_type: str,
    body: bytes,
    *extra: tuple[str, str],
) -> None:
    headers = [
        ("content-type", content_type),
        ("content-length", str(len(body))),
        ("cache-control", "no-store"),
        ("connection", "close"),
        ("x-content-type-options", "nosniff"),
    ]
    headers += extra
    out = conn.send(h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase.encode()))
    out = (out or b"") + (conn.send(h11.Data(data=body)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
    await stream.send_all(out)


async def _serve_feed(ws: WebSocketConnection, feed: StateFeed) -> None:
    with feed.subscribe() as sub:
        try:
            await ws.send_message(json.dumps(sub.snapshot, separators=(",", ":")))
            async with trio.open_nursery() as nursery:
                # Read (and ignore) whatever the client sends so pings are answered and a close is noticed.
                async def discard_incoming() -> None:
                    try:
                        while True:
                            await ws.get_message()
                    except ConnectionClosed:
                        nursery.cancel_scope.cancel(reason="client closed the websocket")

                nursery.start_soon(discard_incoming)
                async for message in sub.messages:
                    await ws.send_message(message)
                nursery.cancel_scope.cancel(reason="feed ended")
        except ConnectionClosed:
            return
        code, reason = (_SLOW_CONSUMER_CODE, sub.dropped) if sub.dropped else (_GOING_AWAY, "ops server closing")
        if sub.dropped:
            log.warning("ops: dropped websocket client %s: %s", ws.remote, sub.dropped)
        with trio.move_on_after(_CLOSE_TIMEOUT_S):
            await ws.aclose(code, reason)


async def _handle(feed: StateFeed, page: bytes, stream: trio.abc.Stream) -> None:
    received = None
    try:
        with trio.move_on_after(HEAD_TIMEOUT_S):
            received = await read_request(stream)
        if received is None:
            return  # nothing to answer, or the head did not arrive in time
        conn, event, head = received
        path = urlsplit(event.target.decode("latin-1")).path
        headers = {name.lower(): value for name, value in event.headers}
        upgrade = b"websocket" in headers.get(b"upgrade", b"").lower()
        if event.method != b"GET":
            await respond(stream, conn, 405, "text/plain", b"read-only: GET only\n", ("allow", "GET"))
        elif path == "/ws" and upgrade:
            async with trio.open_nursery() as nursery:
                request = await wrap_server_stream(nursery, _Replay(stream, head))
                ws = await request.accept()
                await _serve_feed(ws, feed)
                nursery.cancel_scope.cancel(reason="websocket done")
        elif path == "/ws":
            await respond(stream, conn, 426, "text/plain", b"websocket upgrade required\n", ("upgrade", "websocket"))
        elif path in ("/", "/index.html"):
            await respond(stream, conn, 200, "text/html; charset=utf-8", page, ("content-security-policy", _CSP))
        elif path == "/favicon.ico":
            await respond(stream, conn, 204, "image/x-icon", b"")
        elif path == "/snapshot":
            body = json.dumps(feed.snapshot(), indent=1).encode()
            await respond(stream, conn, 200, "application/json", body)
        else:
            await respond(stream, conn, 404, "text/plain", b"not found: try / or /ws\n")
    except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionClosed):
        pass
    finally:
        await trio.aclose_forcefully(stream)


async def serve_ops(
    feed: StateFeed,
    host: str,
    port: int,
    *,
    title: str = "openengine-sidecar",
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the page and the feed on ``host:port`` (0 = the OS picks) until cancelled; runs the feed's flusher.

    ``task_status.started((host, port))`` reports the address actually bound.
    """
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        # One line for the operator (the worker refuses to start with it), not trio's multi-attempt traceback.
        raise OSError(exc.errno, f"--ops-port {port} on {host}: {exc.strerror or exc}") from None
    page = render_page(feed.kinds, title=title).encode()
    bound = listeners[0].socket.getsockname()
    async with trio.open_nursery() as nursery:
        await nursery.start(feed.run)
        task_status.started((str(bound[0]), int(bound[1])))
        await trio.serve_listeners(partial(_handle, feed, page), listeners, handler_nursery=nursery)


async def serve_live_state(
    worker: WorkerLifecycle,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The worker's ops port: a :class:`StateFeed` over every machine, served until cancelled (observers removed).

    Started with ``nursery.start`` before the worker contacts anything, so start-up itself can be watched.
    """
    from .feed import StateFeed

    feed = StateFeed(worker=worker)
    feed.install()
    try:
        async with trio.open_nursery() as nursery:
            bound_host, bound_port = await nursery.start(serve_ops, feed, host, port)
            url = f"{bound_host}:{bound_port}"
            log.info("ops: live state page http://%s/, feed ws://%s/ws", url, url)
            task_status.started((bound_host, bound_port))
    finally:
        feed.uninstall()
