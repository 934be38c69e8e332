"""gRPC request metadata: the OpenEngine keys (wire contract §7.6) and W3C trace context.

Validation happens here, on our side, because a malformed value would otherwise only come back as an
``INVALID_ARGUMENT`` from the engine — or, worse, be passed through by an engine that does not check.

Only the three ``openengine-*`` keys of OpenEngine v0.1.0 may be sent; any other key with that prefix is refused
here, because TensorRT-LLM's newer servers answer an ``openengine-*`` key they do not know with ``UNIMPLEMENTED``.
Of the three, the request path sends ``openengine-target-dp-rank`` only to an engine that advertises DP-rank
targeting, ``openengine-priority`` only to one that advertises priority, and ``openengine-routing-key`` never
(TensorRT-LLM's newer servers refuse it too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "PRIORITY_KEY",
    "ROUTING_KEY",
    "TARGET_DP_RANK_KEY",
    "TRACEPARENT_KEY",
    "TRACESTATE_KEY",
    "MetadataError",
    "RequestMetadata",
    "TraceContext",
    "check_metadata",
]

ROUTING_KEY: Final = "openengine-routing-key"
TARGET_DP_RANK_KEY: Final = "openengine-target-dp-rank"
PRIORITY_KEY: Final = "openengine-priority"
TRACEPARENT_KEY: Final = "traceparent"
TRACESTATE_KEY: Final = "tracestate"
_RESERVED_PREFIX: Final = "openengine-"
_FIELD_KEYS: Final = frozenset({ROUTING_KEY, TARGET_DP_RANK_KEY, PRIORITY_KEY, TRACEPARENT_KEY, TRACESTATE_KEY})
#: The ``openengine-*`` keys of OpenEngine v0.1.0.
_OPENENGINE_KEYS: Final = frozenset({ROUTING_KEY, TARGET_DP_RANK_KEY, PRIORITY_KEY})

# What grpclib (and HTTP/2 header rules for gRPC) accept; checked here so the error names the field.
_KEY_RE: Final = re.compile(r"^[0-9a-z_.\-]+$")
_VALUE_RE: Final = re.compile(r"^[ -~]*$")
_NOT_METADATA: Final = frozenset({"te", "content-type", "user-agent"})
# W3C Trace Context level 1: version-traceid-parentid-flags, lowercase hex; version ff is invalid.
_TRACEPARENT_RE: Final = re.compile(
    r"^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}(-.*)?$"
)
_UINT32_MAX: Final = 2**32 - 1
_INT32_MIN: Final = -(2**31)
_INT32_MAX: Final = 2**31 - 1


class MetadataError(ValueError):
    """Metadata the contract forbids (malformed value, repeated ``openengine-*`` key, reserved key)."""


@dataclass(frozen=True, slots=True)
class TraceContext:
    """W3C trace context propagated as ``traceparent``/``tracestate`` on every RPC."""

    traceparent: str
    tracestate: str = ""

    def __post_init__(self) -> None:
        if not _TRACEPARENT_RE.match(self.traceparent):
            raise MetadataError(f"traceparent: not a W3C traceparent: {self.traceparent!r}")
        if not _VALUE_RE.match(self.tracestate) or len(self.tracestate) > 8192:
            raise MetadataError(f"tracestate: not printable ASCII (or too long): {self.tracestate[:64]!r}")

    def pairs(self) -> list[tuple[str, str]]:
        """The metadata pairs; ``tracestate`` only when non-empty."""
        if self.tracestate:
            return [(TRACEPARENT_KEY, self.traceparent), (TRACESTATE_KEY, self.tracestate)]
        return [(TRACEPARENT_KEY, self.traceparent)]


@dataclass(frozen=True, slots=True)
class RequestMetadata:
    """Per-request ``Generate`` metadata, validated at construction.

    :param routing_key: ``openengine-routing-key``, non-empty printable ASCII (TensorRT-LLM's merged server ignores it,
        its newer servers answer UNIMPLEMENTED).
    :param target_dp_rank: ``openengine-target-dp-rank``, a ``uint32`` (send only when the engine advertises DP-rank
        targeting; TensorRT-LLM's baseline answers UNIMPLEMENTED).
    :param priority: ``openengine-priority``, an ``int32``, higher = more urgent (only when the model advertises
        ``generation.supports_priority``).
    :param traceparent: W3C ``traceparent``; ``tracestate`` only together with it.
    :param extra: further application pairs; the keys above must be set through their fields, and no other
        ``openengine-*`` key is allowed.
    """

    routing_key: str | None = None
    target_dp_rank: int | None = None
    priority: int | None = None
    traceparent: str | None = None
    tracestate: str | None = None
    extra: Sequence[tuple[str, str]] = ()

    def __post_init__(self) -> None:
        if self.routing_key is not None and not (
            self.routing_key and self.routing_key.isascii() and _VALUE_RE.match(self.routing_key)
        ):
            raise MetadataError(f"{ROUTING_KEY}: must be non-empty printable ASCII, got {self.routing_key!r}")
        if self.target_dp_rank is not None and not (
            _is_int(self.target_dp_rank) and 0 <= self.target_dp_rank <= _UINT32_MAX
        ):
            raise MetadataError(f"{TARGET_DP_RANK_KEY}: must be a uint32, got {self.target_dp_rank!r}")
        if self.priority is not None and not (_is_int(self.priority) and _INT32_MIN <= self.priority <= _INT32_MAX):
            raise MetadataError(f"{PRIORITY_KEY}: must be an int32, got {self.priority!r}")
        if self.tracestate is not None and self.traceparent is None:
            raise MetadataError("tracestate without traceparent")
        if self.traceparent is not None:
            TraceContext(self.traceparent, self.tracestate or "")  # validates both
        for key, _ in self.extra:
            if key in _FIELD_KEYS:
                raise MetadataError(f"{key}: set it through the RequestMetadata field, not extra")
        check_metadata(self.pairs())

    def pairs(self) -> list[tuple[str, str]]:
        """The metadata as ``(key, value)`` pairs, in a stable order, ready for :meth:`EngineClient.generate`."""
        out: list[tuple[str, str]] = []
        if self.routing_key is not None:
            out.append((ROUTING_KEY, self.routing_key))
        if self.target_dp_rank is not None:
            out.append((TARGET_DP_RANK_KEY, str(self.target_dp_rank)))
        if self.priority is not None:
            out.append((PRIORITY_KEY, str(self.priority)))
        if self.traceparent is not None:
            out.append((TRACEPARENT_KEY, self.traceparent))
            if self.tracestate:
                out.append((TRACESTATE_KEY, self.tracestate))
        out.extend(self.extra)
        return out


def check_metadata(pairs: Sequence[tuple[str, str]]) -> None:
    """Raise :class:`MetadataError` unless ``pairs`` is sendable: valid keys and values, no repeated reserved key, no
    ``openengine-*`` key outside the contract.

    Cheap enough for every request (a handful of pairs); it turns what would be an engine INVALID_ARGUMENT (or a
    grpclib ``ValueError`` on the edge thread) into a local error naming the key.
    """
    seen: set[str] = set()
    for pair in pairs:
        key, value = pair
        if not isinstance(key, str) or not _KEY_RE.match(key) or key in _NOT_METADATA or key.startswith("grpc-"):
            raise MetadataError(f"invalid metadata key {key!r}")
        if key.endswith("-bin"):
            raise MetadataError(f"{key}: binary metadata is not supported here")
        if key.startswith(_RESERVED_PREFIX) and key not in _OPENENGINE_KEYS:
            raise MetadataError(f"{key}: not an OpenEngine v0.1.0 metadata key (engines answer UNIMPLEMENTED)")
        if not isinstance(value, str) or not value or not _VALUE_RE.match(value):
            raise MetadataError(f"{key}: value must be non-empty printable ASCII, got {value!r}")
        if key.startswith(_RESERVED_PREFIX) or key in (TRACEPARENT_KEY, TRACESTATE_KEY):
            if key in seen:
                raise MetadataError(f"{key}: repeated; the contract allows at most one value")
            seen.add(key)


def _is_int(value: object) -> bool:
    # bool is an int subclass; True as a DP rank is a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)
