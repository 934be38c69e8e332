"""Struct ⇄ JSON number fidelity, for upb and betterproto2 alike."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from openengine_bp.google import protobuf as bp_struct
from sidecar.convert import structjson
from sidecar.convert.structjson import MAX_DEPTH, MAX_SAFE_INT, StructValueError

# Each codec: JSON object → message → wire bytes, and message → JSON object.
Encode = Callable[..., Any]
CODECS: dict[str, tuple[Encode, Callable[[Any], Any], Callable[[bytes], Any]]] = {
    "upb": (
        structjson.json_to_pb_struct,
        structjson.pb_struct_to_json,
        struct_pb2.Struct.FromString,
    ),
    "betterproto2": (
        structjson.json_to_bp_struct,
        structjson.bp_struct_to_json,
        bp_struct.Struct.parse,
    ),
}


def _to_bytes(message: Any) -> bytes:
    if isinstance(message, struct_pb2.Struct):
        data: bytes = message.SerializeToString(deterministic=True)
        return data
    return bytes(message)


def roundtrip(codec: str, obj: dict[str, Any], **kwargs: Any) -> Any:
    """Encode, serialize, parse with the same runtime, decode."""
    encode, decode, parse = CODECS[codec]
    return decode(parse(_to_bytes(encode(obj, **kwargs))))


# (id, input, expected output) — exact equality *and* exact types (1 stays int, True stays bool).
FIDELITY = [
    ("int", {"a": 3}, {"a": 3}),
    ("zero", {"a": 0}, {"a": 0}),
    ("negative int", {"a": -17}, {"a": -17}),
    ("2^53", {"a": MAX_SAFE_INT}, {"a": MAX_SAFE_INT}),
    ("-2^53", {"a": -MAX_SAFE_INT}, {"a": -MAX_SAFE_INT}),
    ("whole float comes back int", {"a": 3.0}, {"a": 3}),
    ("fraction unrounded", {"a": 0.1}, {"a": 0.1}),
    ("tiny fraction", {"a": 5e-324}, {"a": 5e-324}),
    ("large whole float stays float", {"a": 1e20}, {"a": 1e20}),
    ("true", {"a": True}, {"a": True}),
    ("false", {"a": False}, {"a": False}),
    ("null", {"a": None}, {"a": None}),
    ("empty string", {"a": ""}, {"a": ""}),
    ("unicode", {"a": "héllo ☃"}, {"a": "héllo ☃"}),
    ("empty object", {"a": {}}, {"a": {}}),
    ("empty list", {"a": []}, {"a": []}),
    ("tuple as list", {"a": (1, 2)}, {"a": [1, 2]}),
    (
        "nested lists and objects",
        {"a": [1, 2.5, None, True, "x", [[], {}], {"b": {"c": [0, -1]}}]},
        {"a": [1, 2.5, None, True, "x", [[], {}], {"b": {"c": [0, -1]}}]},
    ),
    ("empty root", {}, {}),
    ("many keys", {"k1": 1, "k2": "v", "k3": None, "k4": False}, {"k1": 1, "k2": "v", "k3": None, "k4": False}),
]


def _typed(value: Any) -> Any:
    """The value with every scalar tagged by its type, so 1 == 1.0 == True cannot pass for equal."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return (type(value).__name__, value)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(("case", "given_obj", "expected"), FIDELITY, ids=[c[0] for c in FIDELITY])
def test_fidelity(codec: str, case: str, given_obj: dict[str, Any], expected: dict[str, Any]) -> None:
    assert _typed(roundtrip(codec, given_obj)) == _typed(expected)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("big", [MAX_SAFE_INT + 1, -(MAX_SAFE_INT + 1), 2**64 - 1, 10**30])
def test_big_int_refused_naming_the_key_path(codec: str, big: int) -> None:
    encode = CODECS[codec][0]
    with pytest.raises(StructValueError) as info:
        encode({"outer": {"ids": [1, big]}})
    assert info.value.path == "outer.ids[1]"
    assert "2^53" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("codec", CODECS)
def test_big_int_as_decimal_string(codec: str) -> None:
    big = MAX_SAFE_INT + 1
    result = roundtrip(codec, {"disagg_request_id": big, "small": 7}, big_ints="string")
    assert result == {"disagg_request_id": "9007199254740993", "small": 7}
    assert type(result["small"]) is int


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_refused(codec: str, bad: float) -> None:
    encode = CODECS[codec][0]
    with pytest.raises(StructValueError) as info:
        encode({"a": [{"b": bad}]})
    assert info.value.path == "a[0].b"


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    ("bad", "path"),
    [({"a": b"bytes"}, "a"), ({"a": {1: 2}}, "a"), ({"a": {"b": object()}}, "a.b"), ({"s": {1, 2}}, "s")],
)
def test_non_json_values_refused(codec: str, bad: dict[str, Any], path: str) -> None:
    with pytest.raises(StructValueError) as info:
        CODECS[codec][0](bad)
    assert info.value.path == path


@pytest.mark.parametrize("codec", CODECS)
def test_root_must_be_object(codec: str) -> None:
    with pytest.raises(StructValueError):
        CODECS[codec][0]([1, 2])


def _nested(depth: int) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for _ in range(depth - 1):
        obj = {"a": obj}
    return obj


@pytest.mark.parametrize("codec", CODECS)
def test_depth_limit(codec: str) -> None:
    deepest = _nested(MAX_DEPTH)
    assert roundtrip(codec, deepest) == deepest
    with pytest.raises(StructValueError, match="nested deeper"):
        CODECS[codec][0](_nested(MAX_DEPTH + 1))


def test_deepest_allowed_struct_parses_in_upb() -> None:
    # The limit exists so that the engine can parse what we send: check against upb itself.
    data = structjson.json_to_struct_bytes(_nested(MAX_DEPTH))
    assert structjson.struct_bytes_to_json(data) == _nested(MAX_DEPTH)


def test_decode_refuses_non_finite_from_the_wire() -> None:
    struct = struct_pb2.Struct()
    struct.fields["x"].number_value = math.nan
    with pytest.raises(StructValueError, match="non-finite"):
        structjson.pb_struct_to_json(struct)
    bp = bp_struct.Struct(fields={"x": bp_struct.Value(number_value=math.inf)})
    with pytest.raises(StructValueError, match="non-finite"):
        structjson.bp_struct_to_json(bp)


def test_decode_refuses_value_without_kind() -> None:
    struct = struct_pb2.Struct()
    struct.fields["x"].SetInParent()
    with pytest.raises(StructValueError, match="no kind") as info:
        structjson.pb_struct_to_json(struct, path="extra")
    assert info.value.path == "extra.x"
    with pytest.raises(StructValueError, match="no kind"):
        structjson.bp_struct_to_json(bp_struct.Struct(fields={"x": bp_struct.Value()}))


def test_struct_bytes_helpers() -> None:
    data = structjson.json_to_struct_bytes({"b": 1, "a": [True, None]})
    # Deterministic: map keys sorted, so equal objects give equal bytes whatever the key order.
    assert data == structjson.json_to_struct_bytes({"a": [True, None], "b": 1})
    assert structjson.struct_bytes_to_json(data) == {"a": [True, None], "b": 1}
    with pytest.raises(StructValueError, match=r"not a google\.protobuf\.Struct"):
        structjson.struct_bytes_to_json(b"\xff\xff\xff")


def test_value_helpers() -> None:
    assert structjson.pb_value_to_json(structjson.json_to_pb_value([1, 2.5])) == [1, 2.5]
    assert structjson.bp_value_to_json(structjson.json_to_bp_value({"a": None})) == {"a": None}
    assert structjson.pb_value_to_json(structjson.json_to_pb_value(7)) == 7


def test_upb_and_betterproto2_encode_identically() -> None:
    obj: dict[str, Any] = {"k": [1, 2.5, None, True, "s", {"n": -3}, []]}
    pb = structjson.json_to_pb_struct(obj).SerializeToString(deterministic=True)
    assert bytes(structjson.json_to_bp_struct(obj)) == pb


# JSON values as a JSON parser would produce them, within the Struct-safe range.
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-MAX_SAFE_INT, max_value=MAX_SAFE_INT)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_json = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=20,
)


def _normalized(value: Any) -> Any:
    # What a faithful round trip must give back: whole floats within 2^53 as int, all else equal.
    if isinstance(value, dict):
        return {k: _normalized(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_SAFE_INT:
        return int(value)
    return value


@given(st.dictionaries(st.text(max_size=6), _json, max_size=5))
def test_fuzz_roundtrip_both_runtimes(obj: dict[str, Any]) -> None:
    expected = _typed(_normalized(obj))
    for codec in CODECS:
        assert _typed(roundtrip(codec, obj)) == expected
    # And the two runtimes agree on the meaning of each other's bytes.
    bp_bytes = bytes(structjson.json_to_bp_struct(obj))
    assert _typed(structjson.struct_bytes_to_json(bp_bytes)) == expected
    # The decoded object is plain JSON.
    json.dumps(structjson.struct_bytes_to_json(bp_bytes), allow_nan=False)
