"""One HTTP/1.1 request relayed from the system port to Dynamo's own system server, the answer streamed back.

The sidecar owns the system port for the worker's whole life (``sidecar.ops.health``) and answers ``/health`` and
``/live`` itself; everything else (``/metrics``, ``/engine/<control>``, ``/v1/metadata/...``, whatever Dynamo adds)
is Dynamo's and goes through :func:`forward`: the method, target (path and query), headers and body as the client
sent them (minus hop-by-hop headers), over a fresh connection that closes after the answer. h11 frames both sides,
so a chunked body stays chunked and a Content-Length is kept exact.

Every step is bounded: connecting (:data:`CONNECT_TIMEOUT_S`), the client's body (:data:`BODY_TIMEOUT_S`), Dynamo's
answer head (the caller's ``answer_timeout_s``: long for ``/engine/`` controls that load a LoRA, short otherwise) and
each later piece of the answer (:data:`IDLE_TIMEOUT_S`). Dynamo's server not answering is one line to the client:
502 when it refuses or drops the connection, 504 when it says nothing in time.
"""

from __future__ import annotations

import logging
from typing import Final

import h11
import trio

from .server import respond

__all__ = ["BODY_TIMEOUT_S", "CONNECT_TIMEOUT_S", "IDLE_TIMEOUT_S", "forward"]

log: Final = logging.getLogger("sidecar.ops")

CONNECT_TIMEOUT_S: Final = 5.0
BODY_TIMEOUT_S: Final = 30.0
IDLE_TIMEOUT_S: Final = 30.0
_CHUNK: Final = 64 * 1024

# RFC 9110 7.6.1: meaningful for one connection only. Framing (content-length, transfer-encoding) is h11's business
# on each side; `expect` is answered here, not passed on (the client waits for our 100 Continue, not Dynamo's).
_HOP_BY_HOP: Final = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade", b"expect", b"transfer-encoding"}
)


class _Unanswered(Exception):
    """Dynamo's server gave no answer: the status (502 or 504) and the one line the client gets."""

    def __init__(self, status: int, line: str) -> None:
        super().__init__(line)
        self.status = status
        self.line = line


def _headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    connection_tokens = {
        token.strip().lower() for name, value in headers if name.lower() == b"connection" for token in value.split(b",")
    }
    dropped = _HOP_BY_HOP | connection_tokens
    return [(name, value) for name, value in headers if name.lower() not in dropped]


async def forward(
    client: trio.abc.Stream,
    conn: h11.Connection,
    request: h11.Request,
    upstream: tuple[str, int],
    *,
    answer_timeout_s: float,
) -> None:
    """Relay ``request`` (its head already parsed by ``conn``, its body still to come) to ``upstream``.

    Raises what the client connection raises (broken, closed); the caller closes ``client``.
    """
    host, port = upstream
    where = f"{host}:{port}"
    up: trio.abc.Stream | None = None
    answered = False
    try:
        up = await _connect(host, port, where)
        upconn = h11.Connection(h11.CLIENT)
        head = h11.Request(
            method=request.method,
            target=request.target,
            headers=[*_headers(list(request.headers)), (b"connection", b"close")],
            http_version=b"1.1",
        )
        await _send(up, upconn.send(head), where)
        await _relay_body(client, conn, up, upconn, where)
        response = await _answer_head(up, upconn, where, answer_timeout_s)
        answered = True
        # h11 picks the framing towards our client (chunked, or close-delimited for HTTP/1.0) when there is no length.
        out = h11.Response(
            status_code=response.status_code,
            headers=[*_headers(list(response.headers)), (b"connection", b"close")],
            reason=response.reason,
        )
        await client.send_all(conn.send(out) or b"")
        await _relay_answer(client, conn, up, upconn, where)
    except _Unanswered as exc:
        if answered:  # a cut answer cannot become an error any more: the client sees the connection close early
            log.warning("system port: Dynamo's answer to %s %s was cut: %s", _method(request), _path(request), exc)
            return
        log.warning("system port: %s %s: %s", _method(request), _path(request), exc.line)
        await respond(client, conn, exc.status, "text/plain; charset=utf-8", f"{exc.line}\n".encode())
    finally:
        if up is not None:
            await trio.aclose_forcefully(up)


async def _connect(host: str, port: int, where: str) -> trio.abc.Stream:
    with trio.move_on_after(CONNECT_TIMEOUT_S):
        try:
            return await trio.open_tcp_stream(host, port)
        except OSError as exc:
            raise _Unanswered(502, f"Dynamo's system server ({where}) is not answering: {_reason(exc)}") from None
    raise _Unanswered(
        502, f"Dynamo's system server ({where}) did not accept a connection within {CONNECT_TIMEOUT_S:g}s"
    )


async def _send(up: trio.abc.Stream, data: bytes | None, where: str) -> None:
    try:
        await up.send_all(data or b"")
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise _Unanswered(502, f"Dynamo's system server ({where}) closed the connection: {exc}") from None


async def _relay_body(
    client: trio.abc.Stream, conn: h11.Connection, up: trio.abc.Stream, upconn: h11.Connection, where: str
) -> None:
    if conn.they_are_waiting_for_100_continue:
        await client.send_all(conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
    with trio.move_on_after(BODY_TIMEOUT_S) as scope:
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:  # cut short or badly chunked: nothing sensible to relay
                raise trio.BrokenResourceError(f"the client's request body: {exc}") from None
            if event is h11.NEED_DATA:
                conn.receive_data(bytes(await client.receive_some(_CHUNK)))
            elif isinstance(event, h11.Data):
                await _send(up, upconn.send(h11.Data(data=event.data)), where)
            elif isinstance(event, h11.EndOfMessage):
                await _send(up, upconn.send(h11.EndOfMessage()), where)
                return
            else:  # the client hung up mid-body (ConnectionClosed) or paused it (PAUSED cannot happen before the end)
                raise trio.BrokenResourceError("the client closed the connection before its request body ended")
    if scope.cancelled_caught:
        raise trio.BrokenResourceError(f"the client did not send its request body within {BODY_TIMEOUT_S:g}s")


async def _receive(up: trio.abc.Stream, upconn: h11.Connection, where: str) -> h11.Event:
    """The next event of Dynamo's answer (reading more when needed); a broken answer is :class:`_Unanswered`."""
    while True:
        try:
            event = upconn.next_event()
        except h11.RemoteProtocolError as exc:
            raise _Unanswered(502, f"Dynamo's system server ({where}) answered with broken HTTP: {exc}") from None
        if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            raise _Unanswered(502, f"Dynamo's system server ({where}) closed the connection without answering")
        if event is not h11.NEED_DATA:
            assert isinstance(event, h11.Event)
            return event
        try:
            data = await up.receive_some(_CHUNK)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise _Unanswered(502, f"Dynamo's system server ({where}) closed the connection: {exc}") from None
        upconn.receive_data(bytes(data))


async def _answer_head(up: trio.abc.Stream, upconn: h11.Connection, where: str, timeout_s: float) -> h11.Response:
    with trio.move_on_after(timeout_s):
        while True:
            event = await _receive(up, upconn, where)
            if isinstance(event, h11.Response):
                return event
            # InformationalResponse (a 100 Continue of Dynamo's own): nothing for the client.
    raise _Unanswered(504, f"Dynamo's system server ({where}) did not answer within {timeout_s:g}s")


async def _relay_answer(
    client: trio.abc.Stream, conn: h11.Connection, up: trio.abc.Stream, upconn: h11.Connection, where: str
) -> None:
    while True:
        event = None
        with trio.move_on_after(IDLE_TIMEOUT_S):
            event = await _receive(up, upconn, where)
        if not isinstance(event, h11.Data | h11.EndOfMessage):
            raise _Unanswered(504, f"Dynamo's system server ({where}) stalled for {IDLE_TIMEOUT_S:g}s mid-answer")
        if isinstance(event, h11.Data):
            await client.send_all(conn.send(h11.Data(data=event.data)) or b"")
        else:
            await client.send_all(conn.send(h11.EndOfMessage()) or b"")
            return


def _reason(exc: OSError) -> str:
    # trio.open_tcp_stream raises one OSError for all its attempts, caused by a group of them: the first one says why.
    cause: BaseException = exc
    if isinstance(exc.__cause__, BaseExceptionGroup) and exc.__cause__.exceptions:
        cause = exc.__cause__.exceptions[0]
    return (cause.strerror if isinstance(cause, OSError) else None) or str(cause)


def _method(request: h11.Request) -> str:
    return request.method.decode("latin-1")


def _path(request: h11.Request) -> str:
    return request.target.decode("latin-1").split("?", 1)[0]
