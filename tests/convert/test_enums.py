"""Lenient enum reads and optional presence."""

from __future__ import annotations

import pytest

from openengine.v1 import error_pb2, generation_pb2, lifecycle_pb2
from openengine_bp.openengine.v1 import ErrorCode, FinishReason, GenerateResponse, HealthState, TokenOutput
from sidecar.convert.enums import bp_enum, bp_or, known_enum, pb_enum, pb_optional


@pytest.mark.parametrize(
    ("value", "enum_type", "expected"),
    [
        (2, generation_pb2.FinishReason, 2),
        (0, generation_pb2.FinishReason, 0),
        (99, generation_pb2.FinishReason, 0),
        (11, error_pb2.ErrorCode, 11),
        (12, error_pb2.ErrorCode, 0),  # main-branch INTERNAL is not a v0.1.0 value
        (4, lifecycle_pb2.HealthState, 4),
        (5, lifecycle_pb2.HealthState, 0),
    ],
)
def test_pb_enum(value: int, enum_type: object, expected: int) -> None:
    assert pb_enum(value, enum_type) == expected


def test_pb_enum_on_a_parsed_unknown_value() -> None:
    # finished{reason: 99} as a newer engine would send it.
    response = generation_pb2.GenerateResponse.FromString(bytes([0x2A, 0x02, 0x10, 99]))
    assert response.finished.reason == 99  # upb keeps the number ...
    assert pb_enum(response.finished.reason, generation_pb2.FinishReason) == 0  # ... we read UNSPECIFIED


def test_bp_enum_on_a_parsed_unknown_value() -> None:
    response = GenerateResponse.parse(bytes([0x2A, 0x02, 0x10, 99]))
    assert response.finished is not None
    assert int(response.finished.reason) == 99
    assert bp_enum(response.finished.reason) is FinishReason.UNSPECIFIED
    assert bp_enum(FinishReason.LENGTH) is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("cls", "value", "expected"),
    [
        (HealthState, 4, HealthState.NOT_READY),
        (HealthState, 5, HealthState.UNSPECIFIED),
        (ErrorCode, 11, ErrorCode.INTERNAL),
        (ErrorCode, 99, ErrorCode.UNSPECIFIED),
    ],
)
def test_known_enum(cls: type, value: int, expected: object) -> None:
    assert known_enum(cls, value) is expected


def test_pb_optional_tells_explicit_zero_from_absent() -> None:
    absent = generation_pb2.TokenOutput()
    zero = generation_pb2.TokenOutput(output_index=0)
    assert pb_optional(absent, "output_index") is None
    assert pb_optional(zero, "output_index") == 0
    assert pb_optional(generation_pb2.GenerateResponse(), "usage") is None


def test_bp_or_keeps_explicit_zero() -> None:
    assert bp_or(TokenOutput(output_index=0).output_index, 7) == 0
    assert bp_or(TokenOutput().output_index, 7) == 7
    assert bp_or(False, True) is False
    assert bp_or("", "x") == ""
