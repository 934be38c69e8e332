"""The transport boundary: every failure grpclib (or the socket under it) can raise → one ``EngineRpcError``.

Nothing outside ``sidecar.engine`` sees a grpclib, h2 or socket exception; what the status then means for Dynamo is
``sidecar.errors``' table, not this one.
"""

from __future__ import annotations

import asyncio
from typing import Final

import h2.exceptions
from google.protobuf.message import DecodeError  # type: ignore[import-untyped,unused-ignore]
from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from sidecar.errors import EngineRpcError, GrpcCode
from sidecar.http2 import GoawayRefused

from ._transport import TransportError

__all__ = ["GRPCLIB_STATUS_CODE", "to_engine_rpc_error"]

# grpclib's Status and our GrpcCode mirror the same numbers; the table is spelled out (not int(status)) so that a
# status either side lacks is a KeyError in the parametrized test, not a silent mismatch.
GRPCLIB_STATUS_CODE: Final[dict[Status, GrpcCode]] = {
    Status.OK: GrpcCode.OK,
    Status.CANCELLED: GrpcCode.CANCELLED,
    Status.UNKNOWN: GrpcCode.UNKNOWN,
    Status.INVALID_ARGUMENT: GrpcCode.INVALID_ARGUMENT,
    Status.DEADLINE_EXCEEDED: GrpcCode.DEADLINE_EXCEEDED,
    Status.NOT_FOUND: GrpcCode.NOT_FOUND,
    Status.ALREADY_EXISTS: GrpcCode.ALREADY_EXISTS,
    Status.PERMISSION_DENIED: GrpcCode.PERMISSION_DENIED,
    Status.RESOURCE_EXHAUSTED: GrpcCode.RESOURCE_EXHAUSTED,
    Status.FAILED_PRECONDITION: GrpcCode.FAILED_PRECONDITION,
    Status.ABORTED: GrpcCode.ABORTED,
    Status.OUT_OF_RANGE: GrpcCode.OUT_OF_RANGE,
    Status.UNIMPLEMENTED: GrpcCode.UNIMPLEMENTED,
    Status.INTERNAL: GrpcCode.INTERNAL,
    Status.UNAVAILABLE: GrpcCode.UNAVAILABLE,
    Status.DATA_LOSS: GrpcCode.DATA_LOSS,
    Status.UNAUTHENTICATED: GrpcCode.UNAUTHENTICATED,
}


def to_engine_rpc_error(rpc: str, exc: BaseException, *, after_goaway: bool = False) -> EngineRpcError | None:
    """Translate a failure of ``rpc`` into an :class:`EngineRpcError`, or ``None`` if it is not a transport failure.

    ``after_goaway``: the call's connection had heard the engine's GOAWAY when the failure came. A status the engine
    sent then is the engine going away (``sidecar.errors.GOING_AWAY_STATUS_KIND``): grpc-core answers a stream that
    reached it between its two GOAWAYs ``CANCELLED``, a cancellation we did not ask for.

    ``None`` is returned for cancellation (``asyncio.CancelledError`` must keep unwinding) and for exceptions that are
    bugs of ours, which must surface as themselves.
    """
    if isinstance(exc, EngineRpcError):
        return exc
    if isinstance(exc, GRPCError):
        code = GRPCLIB_STATUS_CODE.get(exc.status, GrpcCode.UNKNOWN)
        if code is GrpcCode.OK:
            # A GRPCError never carries OK from grpclib; if it ever did, "OK" as a failure would read as nonsense.
            code = GrpcCode.UNKNOWN
        details = exc.message or ""
        if after_goaway:
            details = f"{details} (after the engine's GOAWAY: it is going away)".lstrip()
        return EngineRpcError(rpc, code, details, after_goaway=after_goaway)
    if isinstance(exc, asyncio.CancelledError):
        return None
    # Python 3.11: asyncio.TimeoutError is TimeoutError, an OSError subclass. grpclib's deadline raises it without an
    # errno; a kernel-level connect timeout (ETIMEDOUT) carries one and is a transport failure.
    if isinstance(exc, TimeoutError) and exc.errno is None:
        return EngineRpcError(rpc, GrpcCode.DEADLINE_EXCEEDED, "deadline exceeded")
    if isinstance(exc, StreamTerminatedError):
        # RST_STREAM from the server, GOAWAY, or the connection lost under the stream.
        return EngineRpcError(rpc, GrpcCode.UNAVAILABLE, f"stream terminated: {exc}")
    if isinstance(exc, TransportError | GoawayRefused):
        # Already one sentence for the operator (TLS refusal, bad socket path, GOAWAY), naming what to check.
        return EngineRpcError(rpc, GrpcCode.UNAVAILABLE, str(exc))
    if isinstance(exc, ConnectionRefusedError):
        return EngineRpcError(rpc, GrpcCode.UNAVAILABLE, f"connection refused: {exc}")
    if isinstance(exc, OSError):
        return EngineRpcError(rpc, GrpcCode.UNAVAILABLE, f"connection failed: {_describe(exc)}")
    if isinstance(exc, h2.exceptions.ProtocolError):
        return EngineRpcError(rpc, GrpcCode.UNAVAILABLE, f"HTTP/2 protocol error: {_describe(exc)}")
    if isinstance(exc, EOFError):
        return EngineRpcError(rpc, GrpcCode.UNAVAILABLE, "connection closed")
    if isinstance(exc, DecodeError):
        # What grpcio reports for an undecodable response.
        return EngineRpcError(rpc, GrpcCode.INTERNAL, f"could not decode the response: {exc}")
    if isinstance(exc, ProtocolError):
        # grpclib says *we* misused the stream API; report it loudly but as a failed RPC, not a crashed worker.
        return EngineRpcError(rpc, GrpcCode.INTERNAL, f"client-side gRPC protocol error: {exc}")
    return None


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
