"""The status boundary: every grpclib status and transport failure → one EngineRpcError."""

from __future__ import annotations

import asyncio
import errno

import h2.exceptions
import pytest
from google.protobuf.message import DecodeError  # type: ignore[import-untyped,unused-ignore]
from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from sidecar.engine import GRPCLIB_STATUS_CODE, to_engine_rpc_error
from sidecar.errors import GOING_AWAY_STATUS_KIND, GRPC_STATUS_KIND, DynamoErrorKind, EngineRpcError, GrpcCode

NON_OK = [s for s in Status if s is not Status.OK]


def test_table_covers_every_status_both_ways() -> None:
    assert set(GRPCLIB_STATUS_CODE) == set(Status)
    assert set(GRPCLIB_STATUS_CODE.values()) == set(GrpcCode)
    for status, code in GRPCLIB_STATUS_CODE.items():
        assert status.name == code.name
        assert status.value == code.value


@pytest.mark.parametrize("status", NON_OK, ids=lambda s: s.name)
def test_every_status(status: Status) -> None:
    error = to_engine_rpc_error("GetLoad", GRPCError(status, "why"))
    assert isinstance(error, EngineRpcError)
    assert error.code is GrpcCode[status.name]
    assert error.rpc == "GetLoad"
    assert error.details == "why"
    assert error.kind is GRPC_STATUS_KIND[error.code]
    assert str(error) == f"GetLoad: {status.name}: why"


def test_status_without_message() -> None:
    error = to_engine_rpc_error("Generate", GRPCError(Status.UNIMPLEMENTED))
    assert error is not None
    assert str(error) == "Generate: UNIMPLEMENTED"


def test_ok_as_error_reads_unknown() -> None:
    error = to_engine_rpc_error("Abort", GRPCError(Status.OK, "odd"))
    assert error is not None
    assert error.code is GrpcCode.UNKNOWN


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        # grpclib's deadline raises asyncio.TimeoutError (= TimeoutError on 3.11) without an errno.
        (TimeoutError("Deadline exceeded"), GrpcCode.DEADLINE_EXCEEDED),
        (TimeoutError(errno.ETIMEDOUT, "Connection timed out"), GrpcCode.UNAVAILABLE),
        (StreamTerminatedError("Connection lost"), GrpcCode.UNAVAILABLE),
        (StreamTerminatedError("Stream reset by remote party, error_code: 2"), GrpcCode.UNAVAILABLE),
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed"), GrpcCode.UNAVAILABLE),
        (ConnectionResetError(errno.ECONNRESET, "reset"), GrpcCode.UNAVAILABLE),
        (OSError(errno.EHOSTUNREACH, "No route to host"), GrpcCode.UNAVAILABLE),
        (h2.exceptions.ProtocolError("bad frame"), GrpcCode.UNAVAILABLE),
        (h2.exceptions.StreamClosedError(1), GrpcCode.UNAVAILABLE),
        (EOFError(), GrpcCode.UNAVAILABLE),
        (DecodeError("truncated"), GrpcCode.INTERNAL),
        (ProtocolError("Request is already sent"), GrpcCode.INTERNAL),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_transport_failures(exc: BaseException, code: GrpcCode) -> None:
    error = to_engine_rpc_error("Generate", exc)
    assert error is not None
    assert error.code is code


def test_not_ours_passes_through() -> None:
    assert to_engine_rpc_error("Generate", asyncio.CancelledError()) is None
    assert to_engine_rpc_error("Generate", KeyError("bug")) is None
    same = EngineRpcError("Generate", GrpcCode.UNAVAILABLE, "x")
    assert to_engine_rpc_error("Generate", same) is same


def test_a_cancelled_status_after_the_engines_goaway_is_the_engine_going_away() -> None:
    """grpc-core answers a stream that reached it between its two GOAWAYs trailers-only CANCELLED: not a client's
    cancel (499) but an engine going away, so the frontend migrates the request."""
    plain = to_engine_rpc_error("Generate", GRPCError(Status.CANCELLED, "CANCELLED"))
    assert plain is not None
    assert (plain.kind, plain.migratable, plain.after_goaway) == (DynamoErrorKind.CANCELLED, False, False)
    going = to_engine_rpc_error("Generate", GRPCError(Status.CANCELLED, "CANCELLED"), after_goaway=True)
    assert going is not None
    assert going.code is GrpcCode.CANCELLED
    assert (going.kind, going.migratable, going.after_goaway) == (DynamoErrorKind.DISCONNECTED, True, True)
    assert going.details == "CANCELLED (after the engine's GOAWAY: it is going away)"


@pytest.mark.parametrize("status", [s for s in NON_OK if s is not Status.CANCELLED], ids=lambda s: s.name)
def test_other_statuses_after_a_goaway_keep_their_kind(status: Status) -> None:
    error = to_engine_rpc_error("Generate", GRPCError(status, "why"), after_goaway=True)
    assert error is not None
    assert error.kind is GRPC_STATUS_KIND[error.code]
    assert set(GOING_AWAY_STATUS_KIND) == {GrpcCode.CANCELLED}


def test_a_transport_failure_after_a_goaway_is_unchanged() -> None:
    error = to_engine_rpc_error("Generate", StreamTerminatedError("Connection lost"), after_goaway=True)
    assert error is not None
    assert (error.code, error.after_goaway) == (GrpcCode.UNAVAILABLE, False)
