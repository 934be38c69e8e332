"""Per-request fault injection: ``GenerateRequest.extra["mock"]`` (keys in ``docs/mock.md``).

Parsing is strict — an unknown key or a wrong type is ``INVALID_ARGUMENT`` — so a typo in a test fails loudly instead
of silently running without the fault.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal, cast, get_args

from grpclib.const import Status

from openengine.v1 import error_pb2

from .structs import JsonValue

__all__ = ["VIOLATIONS", "FaultError", "MockFaults", "Violation", "parse_faults", "prompt_fault_spec"]

# `[mock-fault key=value ...]` inside the prompt text, for tests that can only reach the engine through the real
# frontend (no way to set GenerateRequest.extra there). Off unless the mock runs with --faults-from-prompt.
_PROMPT_DIRECTIVE = re.compile(r"\[mock-fault((?:\s+[a-z_]+=[A-Za-z0-9_.-]+)+)\s*\]")

Violation = Literal[
    "wrong_request_id",
    "event_after_terminal",
    "missing_output_index",
    "usage_on_non_final",
    "eof_before_terminal",
    "unspecified_finish",
    "cumulative_deltas",
    "usage_on_every_finish",
]
VIOLATIONS: tuple[str, ...] = get_args(Violation)

_KEYS = frozenset(
    {
        "reject_status",
        "reject_message",
        "error_after_tokens",
        "error_code",
        "error_retryable",
        "drop_after_tokens",
        "hang_after_tokens",
        "violation",
        "tokens",
        "split_finish_ms",
        "trailing_unavailable",
    }
)


class FaultError(ValueError):
    """``extra["mock"]`` is malformed (→ ``INVALID_ARGUMENT``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class MockFaults:
    """The faults requested for one request; all ``None`` = behave."""

    reject_status: Status | None = None
    reject_message: str = ""
    error_after_tokens: int | None = None
    error_code: error_pb2.ErrorCode = error_pb2.ERROR_CODE_INTERNAL
    error_retryable: bool = False
    drop_after_tokens: int | None = None
    hang_after_tokens: int | None = None
    violation: Violation | None = None
    tokens: tuple[int, ...] | None = None
    #: Milliseconds between an output's last token message and its ``finished`` (``None``: ``--split-finish-ms``).
    split_finish_ms: float | None = None
    #: After the stream delivered every response (its terminal event included), end it with status ``UNAVAILABLE``
    #: instead of ``OK``: TensorRT-LLM's coordinator failing during the request's final cleanup.
    trailing_unavailable: bool = False

    @property
    def token_faults(self) -> bool:
        """Whether a fault fires after some number of tokens."""
        return (
            self.error_after_tokens is not None
            or self.drop_after_tokens is not None
            or self.hang_after_tokens is not None
        )


def _count(key: str, value: JsonValue) -> int:
    if isinstance(value, bool) or not isinstance(value, float) or not value.is_integer() or value < 0:
        raise FaultError(f"extra.mock.{key} must be a non-negative integer, got {value!r}")
    return int(value)


def _string(key: str, value: JsonValue) -> str:
    if not isinstance(value, str):
        raise FaultError(f"extra.mock.{key} must be a string, got {value!r}")
    return value


def parse_faults(raw: JsonValue) -> MockFaults:
    """``extra["mock"]`` (a Struct object) → :class:`MockFaults`; raises :class:`FaultError`."""
    if not isinstance(raw, dict):
        raise FaultError("extra.mock must be an object")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise FaultError(f"unknown extra.mock key(s): {', '.join(unknown)}")
    faults = MockFaults()
    if "reject_status" in raw:
        name = _string("reject_status", raw["reject_status"]).upper()
        status = Status.__members__.get(name)
        if status is None or status is Status.OK:
            raise FaultError(f"extra.mock.reject_status must name a non-OK gRPC status, got {name!r}")
        faults = dataclasses.replace(faults, reject_status=status)
    if "reject_message" in raw:
        faults = dataclasses.replace(faults, reject_message=_string("reject_message", raw["reject_message"]))
    if "error_after_tokens" in raw:
        faults = dataclasses.replace(faults, error_after_tokens=_count("error_after_tokens", raw["error_after_tokens"]))
    if "drop_after_tokens" in raw:
        faults = dataclasses.replace(faults, drop_after_tokens=_count("drop_after_tokens", raw["drop_after_tokens"]))
    if "hang_after_tokens" in raw:
        faults = dataclasses.replace(faults, hang_after_tokens=_count("hang_after_tokens", raw["hang_after_tokens"]))
    if "error_code" in raw:
        name = _string("error_code", raw["error_code"]).upper()
        if not name.startswith("ERROR_CODE_"):
            name = "ERROR_CODE_" + name
        try:
            code = error_pb2.ErrorCode.Value(name)
        except ValueError:
            raise FaultError(f"extra.mock.error_code: unknown ErrorCode {name!r}") from None
        faults = dataclasses.replace(faults, error_code=code)
    if "error_retryable" in raw:
        retryable = raw["error_retryable"]
        if not isinstance(retryable, bool):
            raise FaultError("extra.mock.error_retryable must be a boolean")
        faults = dataclasses.replace(faults, error_retryable=retryable)
    if "trailing_unavailable" in raw:
        trailing = raw["trailing_unavailable"]
        if not isinstance(trailing, bool):
            raise FaultError("extra.mock.trailing_unavailable must be a boolean")
        faults = dataclasses.replace(faults, trailing_unavailable=trailing)
    if "violation" in raw:
        violation = _string("violation", raw["violation"])
        if violation not in VIOLATIONS:
            raise FaultError(f"extra.mock.violation must be one of {', '.join(VIOLATIONS)}; got {violation!r}")
        faults = dataclasses.replace(faults, violation=cast(Violation, violation))
    if "split_finish_ms" in raw:
        value = raw["split_finish_ms"]
        if isinstance(value, bool) or not isinstance(value, float) or not value >= 0.0 or value > 60_000.0:
            raise FaultError(f"extra.mock.split_finish_ms must be milliseconds in [0, 60000], got {value!r}")
        faults = dataclasses.replace(faults, split_finish_ms=value)
    if "tokens" in raw:
        tokens = raw["tokens"]
        if not isinstance(tokens, list) or not tokens:
            raise FaultError("extra.mock.tokens must be a non-empty list of token ids")
        faults = dataclasses.replace(faults, tokens=tuple(_count("tokens[]", t) for t in tokens))
    return faults


def prompt_fault_spec(text: str) -> dict[str, JsonValue] | None:
    """The ``[mock-fault k=v ...]`` directive in ``text`` as an ``extra.mock`` object, or None when absent.

    Values read as JSON would: ``true``/``false`` are booleans, whole numbers are numbers (Struct numbers are
    doubles), anything else is a string. ``tokens`` cannot be given this way.
    """
    match = _PROMPT_DIRECTIVE.search(text)
    if match is None:
        return None
    spec: dict[str, JsonValue] = {}
    for pair in match.group(1).split():
        key, _, value = pair.partition("=")
        if value in ("true", "false"):
            spec[key] = value == "true"
        elif value.isdigit():
            spec[key] = float(value)
        else:
            spec[key] = value
    return spec
