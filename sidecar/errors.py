"""The one boundary table: every failure the sidecar can meet, and what Dynamo is told about it.

Three families, kept apart on purpose (h11's local/remote split):

* :class:`EngineRpcError` — the engine (or the transport to it) answered an RPC with a non-OK gRPC
  status, or the connection broke. Raised by ``sidecar.engine`` only; the status is carried as a
  :class:`GrpcCode` so that nothing outside ``sidecar.engine`` imports grpclib.
* :class:`EngineFailure` — an accepted request ended with one terminal in-band ``EngineError``.
* :class:`ProtocolViolation` — the engine broke the OpenEngine stream contract (remote protocol error).
* :class:`RequestRejected` — the client's request cannot be served by this engine (local, before any RPC).

Each carries a :class:`DynamoErrorKind`, which ``sidecar.dynamo`` turns into the matching
``dynamo.llm.exceptions`` class. The kinds decide what the frontend does (Dynamo 1.6.1, checked by experiment):
``DISCONNECTED``/``ENGINE_SHUTDOWN``/``CANNOT_CONNECT``/``CONNECTION_TIMEOUT`` are migrated to another worker
when the frontend runs with ``--migration-limit`` > 0; ``INVALID_ARGUMENT`` is a 400; ``CANCELLED`` a 499;
``UNKNOWN`` a 500.

Dynamo's Rust sidecars ignore ``EngineError.retryable``; we honour it: a retryable failure is migratable. That includes
TensorRT-LLM's retryable ``OVERLOADED``, which it sends only when our consumer stalled for 30 s; the frontend's
``--migration-limit`` bounds how often such a request moves.
"""

from __future__ import annotations

import enum
from typing import Final


class GrpcCode(enum.IntEnum):
    """gRPC status codes, mirrored so that convert/ and dynamo/ never import grpclib."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class DynamoErrorKind(enum.StrEnum):
    """The Dynamo exception class a failure becomes; the value is the class name in ``dynamo.llm.exceptions``."""

    INVALID_ARGUMENT = "InvalidArgument"
    DISCONNECTED = "Disconnected"
    ENGINE_SHUTDOWN = "EngineShutdown"
    CANNOT_CONNECT = "CannotConnect"
    CONNECTION_TIMEOUT = "ConnectionTimeout"
    CANCELLED = "Cancelled"
    UNKNOWN = "Unknown"


MIGRATABLE_KINDS: Final = frozenset(
    {
        DynamoErrorKind.DISCONNECTED,
        DynamoErrorKind.ENGINE_SHUTDOWN,
        DynamoErrorKind.CANNOT_CONNECT,
        DynamoErrorKind.CONNECTION_TIMEOUT,
    }
)


class EngineErrorCode(enum.IntEnum):
    """``openengine.v1.ErrorCode`` as of v0.1.0 (INTERNAL is 11 here, 12 on the main branch)."""

    UNSPECIFIED = 0
    INVALID_ARGUMENT = 1
    UNSUPPORTED_FEATURE = 2
    ROLE_MISMATCH = 3
    MODEL_NOT_FOUND = 4
    OVERLOADED = 5
    REQUEST_NOT_FOUND = 6
    DUPLICATE_REQUEST = 7
    KV_SESSION_NOT_FOUND = 8
    KV_TRANSFER_FAILED = 9
    CANCELLED = 10
    INTERNAL = 11


# gRPC status of a failed RPC -> what the client is told. Transport loss (connection refused or reset,
# stream terminated) is reported by sidecar.engine as UNAVAILABLE.
GRPC_STATUS_KIND: Final[dict[GrpcCode, DynamoErrorKind]] = {
    # The request itself is wrong for this engine: retrying elsewhere gives the same answer.
    GrpcCode.INVALID_ARGUMENT: DynamoErrorKind.INVALID_ARGUMENT,
    GrpcCode.NOT_FOUND: DynamoErrorKind.INVALID_ARGUMENT,
    GrpcCode.ALREADY_EXISTS: DynamoErrorKind.INVALID_ARGUMENT,
    GrpcCode.OUT_OF_RANGE: DynamoErrorKind.INVALID_ARGUMENT,
    GrpcCode.FAILED_PRECONDITION: DynamoErrorKind.INVALID_ARGUMENT,
    # TensorRT-LLM answers UNIMPLEMENTED for every feature it lacks (media, LoRA, priority, ...).
    GrpcCode.UNIMPLEMENTED: DynamoErrorKind.INVALID_ARGUMENT,
    # Engine (or its connection) is not there right now: another worker can serve the request.
    GrpcCode.UNAVAILABLE: DynamoErrorKind.DISCONNECTED,
    # Admission control of this engine; another worker may have room.
    GrpcCode.RESOURCE_EXHAUSTED: DynamoErrorKind.DISCONNECTED,
    GrpcCode.DEADLINE_EXCEEDED: DynamoErrorKind.CONNECTION_TIMEOUT,
    GrpcCode.CANCELLED: DynamoErrorKind.CANCELLED,
    GrpcCode.UNKNOWN: DynamoErrorKind.UNKNOWN,
    GrpcCode.INTERNAL: DynamoErrorKind.UNKNOWN,
    GrpcCode.ABORTED: DynamoErrorKind.UNKNOWN,
    GrpcCode.DATA_LOSS: DynamoErrorKind.UNKNOWN,
    GrpcCode.PERMISSION_DENIED: DynamoErrorKind.UNKNOWN,
    GrpcCode.UNAUTHENTICATED: DynamoErrorKind.UNKNOWN,
    GrpcCode.OK: DynamoErrorKind.UNKNOWN,
}

# gRPC status the engine sent on a connection that had heard its GOAWAY -> what the client is told, where it differs
# from GRPC_STATUS_KIND. Between its two GOAWAYs grpc-core (TensorRT-LLM's server) answers a new stream trailers-only
# CANCELLED, then RST_STREAM NO_ERROR: the engine is going away and never ran the request, which another worker can
# serve. (The sidecar never causes a CANCELLED status: its own cancellation resets the stream and reads nothing more.)
GOING_AWAY_STATUS_KIND: Final[dict[GrpcCode, DynamoErrorKind]] = {
    GrpcCode.CANCELLED: DynamoErrorKind.DISCONNECTED,
}

# In-band terminal EngineError of an accepted request, when the engine did not flag it retryable.
ENGINE_ERROR_KIND: Final[dict[EngineErrorCode, DynamoErrorKind]] = {
    EngineErrorCode.INVALID_ARGUMENT: DynamoErrorKind.INVALID_ARGUMENT,
    EngineErrorCode.UNSUPPORTED_FEATURE: DynamoErrorKind.INVALID_ARGUMENT,
    EngineErrorCode.ROLE_MISMATCH: DynamoErrorKind.INVALID_ARGUMENT,
    EngineErrorCode.MODEL_NOT_FOUND: DynamoErrorKind.INVALID_ARGUMENT,
    EngineErrorCode.REQUEST_NOT_FOUND: DynamoErrorKind.INVALID_ARGUMENT,
    EngineErrorCode.DUPLICATE_REQUEST: DynamoErrorKind.INVALID_ARGUMENT,
    # The client never names a KV session: an expired or already claimed one is the engines' failure (500, like
    # TensorRT-LLM's plain INTERNAL for it), and replaying the same handoff elsewhere fails again, so not migrated.
    EngineErrorCode.KV_SESSION_NOT_FOUND: DynamoErrorKind.UNKNOWN,
    # Usually a transceiver both engines lack: the same pair fails again, so not migrated unless flagged.
    EngineErrorCode.KV_TRANSFER_FAILED: DynamoErrorKind.UNKNOWN,
    EngineErrorCode.OVERLOADED: DynamoErrorKind.UNKNOWN,
    EngineErrorCode.CANCELLED: DynamoErrorKind.CANCELLED,
    EngineErrorCode.INTERNAL: DynamoErrorKind.UNKNOWN,
    EngineErrorCode.UNSPECIFIED: DynamoErrorKind.UNKNOWN,
}

ROLE_MISMATCH_HINT: Final = "check --disaggregation-mode against the engine's role"

# Hints appended to an EngineError's message: what an operator should look at (the codes TensorRT-LLM's Rust sidecar
# annotates too: ai-dynamo/dynamo PR #14349).
ENGINE_ERROR_HINTS: Final[dict[EngineErrorCode, str]] = {
    EngineErrorCode.ROLE_MISMATCH: ROLE_MISMATCH_HINT,
    EngineErrorCode.KV_SESSION_NOT_FOUND: (
        "the prefill engine no longer holds this KV session: it expired, was claimed already, or never existed"
    ),
    EngineErrorCode.KV_TRANSFER_FAILED: (
        "check that the prefill and decode engines' KV cache transceivers use the same backend and reach each other"
    ),
}


class SidecarError(Exception):
    """Base of every failure that reaches a client; ``kind`` decides the Dynamo exception."""

    kind: DynamoErrorKind = DynamoErrorKind.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def migratable(self) -> bool:
        return self.kind in MIGRATABLE_KINDS


class EngineRpcError(SidecarError):
    """A non-OK gRPC status (or transport loss, reported as UNAVAILABLE) from one engine RPC.

    ``after_goaway``: the engine sent the status on a connection that had heard its GOAWAY
    (``GOING_AWAY_STATUS_KIND``).
    """

    def __init__(self, rpc: str, code: GrpcCode, details: str, *, after_goaway: bool = False) -> None:
        super().__init__(f"{rpc}: {code.name}: {details}" if details else f"{rpc}: {code.name}")
        self.rpc = rpc
        self.code = code
        self.details = details
        self.after_goaway = after_goaway
        kind = GOING_AWAY_STATUS_KIND.get(code) if after_goaway else None
        self.kind = kind if kind is not None else GRPC_STATUS_KIND[code]


class EngineFailure(SidecarError):
    """An accepted request ended with a terminal ``EngineError`` event."""

    def __init__(self, code: int, message: str, retryable: bool) -> None:
        try:
            known: EngineErrorCode = EngineErrorCode(code)
        except ValueError:
            # Enums only grow by appending: an unknown code reads as UNSPECIFIED, never as an error of ours.
            known = EngineErrorCode.UNSPECIFIED
        text = f"OpenEngine [{known.name}]: {message}" if message else f"OpenEngine [{known.name}]"
        hint = ENGINE_ERROR_HINTS.get(known)
        if hint is not None:
            text = f"{text} ({hint})"
        super().__init__(text)
        self.code = known
        self.retryable = retryable
        self.kind = DynamoErrorKind.DISCONNECTED if retryable else ENGINE_ERROR_KIND[known]


class Violation(enum.StrEnum):
    """Names of stream-contract breaches; counted per name, so the set stays small and fixed."""

    WRONG_REQUEST_ID = "wrong_request_id"
    EVENT_AFTER_TERMINAL = "event_after_terminal"
    MISSING_OUTPUT_INDEX = "missing_output_index"
    OUTPUT_INDEX_OUT_OF_RANGE = "output_index_out_of_range"
    DUPLICATE_FINISH = "duplicate_finish"
    USAGE_BEFORE_END = "usage_before_end"
    MISSING_USAGE = "missing_usage"
    EOF_BEFORE_TERMINAL = "eof_before_terminal"
    UNSPECIFIED_FINISH_REASON = "unspecified_finish_reason"
    EMPTY_EVENT = "empty_event"
    UNEXPECTED_EVENT = "unexpected_event"
    BAD_HANDOFF = "bad_handoff"


class ProtocolViolation(SidecarError):
    """The engine broke the stream contract. Fails that request only (500); the worker keeps serving.

    Not migrated: a misbehaving engine build is usually replicated on every worker, and replaying the
    request elsewhere would hide the fault instead of surfacing it.
    """

    kind = DynamoErrorKind.UNKNOWN

    def __init__(self, violation: Violation, detail: str) -> None:
        super().__init__(f"engine protocol violation ({violation}): {detail}")
        self.violation = violation
        self.detail = detail


class RequestRejected(SidecarError):
    """The request asks for something this engine does not advertise or the contract forbids (HTTP 400)."""

    kind = DynamoErrorKind.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class EngineGone(SidecarError):
    """The engine went away under an in-flight request (connection lost, engine restarting)."""

    kind = DynamoErrorKind.DISCONNECTED


class HandoffMissing(SidecarError):
    """A prefill leg ended without handing its KV cache off (no ``PrefillReady``), and not by a legitimate stop.

    Not migrated: the usual cause is the engine's configuration (TensorRT-LLM without ``cache_transceiver_config``
    runs a context-only request as a plain one-token generation), which every worker of the deployment shares.
    """

    kind = DynamoErrorKind.UNKNOWN


class WorkerDraining(SidecarError):
    """The worker is draining or degraded: the request is sent elsewhere.

    ``EngineShutdown`` also takes this worker out of the frontend's routing for a few seconds (measured), which is
    what a draining worker wants — and why it must never be used for trouble with a single request.
    """

    kind = DynamoErrorKind.ENGINE_SHUTDOWN


class LoraErrorCode(enum.StrEnum):
    """The ``code`` of a failed ``load_lora`` / ``unload_lora`` answer (a control endpoint, not a request: no HTTP
    status is involved, the operator reads ``{"status": "error", "code": …, "message": …}``)."""

    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    UNSUPPORTED = "unsupported"
    CAPACITY = "capacity"
    UNAVAILABLE = "unavailable"
    ENGINE_ERROR = "engine_error"
    CONTROL_PLANE = "control_plane"


# A LoRA lifecycle RPC's gRPC status -> the answer's code (wire §7.9: conflicts are ALREADY_EXISTS, unknown adapters
# NOT_FOUND, a LoRA-disabled engine FAILED_PRECONDITION; TensorRT-LLM answers UNIMPLEMENTED to all of them).
LORA_STATUS_CODE: Final[dict[GrpcCode, LoraErrorCode]] = {
    GrpcCode.INVALID_ARGUMENT: LoraErrorCode.INVALID_ARGUMENT,
    GrpcCode.NOT_FOUND: LoraErrorCode.NOT_FOUND,
    GrpcCode.ALREADY_EXISTS: LoraErrorCode.CONFLICT,
    GrpcCode.FAILED_PRECONDITION: LoraErrorCode.UNSUPPORTED,
    GrpcCode.UNIMPLEMENTED: LoraErrorCode.UNSUPPORTED,
    GrpcCode.RESOURCE_EXHAUSTED: LoraErrorCode.CAPACITY,
    GrpcCode.UNAVAILABLE: LoraErrorCode.UNAVAILABLE,
    GrpcCode.DEADLINE_EXCEEDED: LoraErrorCode.UNAVAILABLE,
}


class LoraRefused(SidecarError):
    """A LoRA lifecycle call that did not happen (or was undone); ``code`` tells the operator what kind of problem."""

    kind = DynamoErrorKind.INVALID_ARGUMENT

    def __init__(self, code: LoraErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def from_rpc(cls, error: EngineRpcError, what: str) -> LoraRefused:
        code = LORA_STATUS_CODE.get(error.code, LoraErrorCode.ENGINE_ERROR)
        return cls(code, f"{what}: the engine answered {error.code.name}: {error.details or 'no details'}")
