"""``google.protobuf.Struct`` ⇄ plain JSON, keeping numbers faithful.

A Struct number is an IEEE-754 double, exact for integers only up to 2^53. The disaggregation
handoff (``KvSessionRef.attributes_struct``) and the ``extra`` fields carry engine data that must
survive a round trip *without re-typing*: vLLM restoring ``remote_pp_size=1`` as ``1.0`` broke a
native handoff, and TensorRT-LLM's ``disagg_request_id`` exceeds 2^53. So, in both directions:

* whole doubles come back as Python ``int`` (``3.0`` → ``3``) when they are exactly representable
  (|x| ≤ 2^53); a fraction comes back unrounded; larger whole doubles stay ``float`` because they
  were never exact integers to begin with;
* an ``int`` with |n| > 2^53 is refused (:class:`StructValueError`) unless the caller's schema
  carries such ids as decimal strings (``big_ints="string"``) — decoding never turns a string back
  into a number, the caller's schema decides that;
* NaN and ±infinity are refused both ways (JSON has no spelling for them);
* ``bool`` stays ``bool`` (``bool_value``, never the number 1/0), ``None`` ⇄ ``null_value``;
* nesting is bounded by :data:`MAX_DEPTH`, below upb's parse recursion limit, so that anything we
  encode can also be parsed by the engine.

Two message families are served with the same rules: upb (``google.protobuf.struct_pb2``), used on
the ``Generate`` hot path, and betterproto2 (``openengine_bp.google.protobuf``), used by the typed
Control RPCs. Never use betterproto2's own ``Struct.from_dict``/``to_dict`` for this: they keep
whole doubles as floats and accept non-finite numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal, TypeAlias

from google.protobuf import message as _pb_message
from google.protobuf import struct_pb2

from openengine_bp.google import protobuf as bp_struct

__all__ = [
    "MAX_DEPTH",
    "MAX_SAFE_INT",
    "BigInts",
    "JsonObject",
    "JsonValue",
    "StructValueError",
    "bp_struct_to_json",
    "bp_value_to_json",
    "json_to_bp_struct",
    "json_to_bp_value",
    "json_to_pb_struct",
    "json_to_pb_value",
    "json_to_struct_bytes",
    "pb_struct_to_json",
    "pb_value_to_json",
    "struct_bytes_to_json",
]

JsonValue: TypeAlias = "bool | int | float | str | list[JsonValue] | dict[str, JsonValue] | None"
JsonObject: TypeAlias = "dict[str, JsonValue]"

#: What to do with an ``int`` whose magnitude exceeds 2^53: refuse it, or carry it as a decimal string.
BigInts: TypeAlias = Literal["refuse", "string"]

#: Largest magnitude a double represents exactly together with all smaller integers.
MAX_SAFE_INT = 2**53

#: Containers (objects and arrays, the root object included) that may nest. upb refuses to parse
#: a Struct nested ~34 objects deep (each JSON object costs three message levels: Struct, map entry,
#: Value); 32 keeps every Struct we build parseable by the engine.
MAX_DEPTH = 32


class StructValueError(ValueError):
    """A value cannot cross the Struct boundary faithfully; ``path`` names where (``a.b[2]``)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path or '<root>'}: {reason}")
        self.path = path
        self.reason = reason


def _key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check_int(value: int, path: str, big_ints: BigInts) -> str | None:
    """Return the decimal string to send instead of ``value``, or None to send it as a number."""
    if -MAX_SAFE_INT <= value <= MAX_SAFE_INT:
        return None
    if big_ints == "string":
        return str(value)
    raise StructValueError(path, f"integer {value} exceeds 2^53 and cannot travel as a Struct number")


def _check_float(value: float, path: str) -> None:
    if not math.isfinite(value):
        raise StructValueError(path, f"non-finite number {value!r} has no JSON representation")


def _number_to_json(value: float, path: str) -> int | float:
    # Whole doubles are integers that went through a double; give them back as int, but only in
    # the range where a double is exact — beyond it the "integer" was already rounded.
    if not math.isfinite(value):
        raise StructValueError(path, f"non-finite number {value!r} has no JSON representation")
    if value.is_integer() and -MAX_SAFE_INT <= value <= MAX_SAFE_INT:
        return int(value)
    return value


def _depth_error(path: str) -> StructValueError:
    return StructValueError(path, f"nested deeper than {MAX_DEPTH} objects/arrays")


def _unsupported(path: str, value: object) -> StructValueError:
    return StructValueError(path, f"{type(value).__name__} is not a JSON value")


# ---------------------------------------------------------------------------------------------- upb


def _fill_pb_value(target: struct_pb2.Value, value: object, path: str, depth: int, big_ints: BigInts) -> None:
    # bool before int: bool is an int subclass and must stay a bool_value.
    if isinstance(value, str):
        target.string_value = value
    elif isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int):
        text = _check_int(value, path, big_ints)
        if text is None:
            target.number_value = float(value)
        else:
            target.string_value = text
    elif isinstance(value, float):
        _check_float(value, path)
        target.number_value = value
    elif value is None:
        target.null_value = struct_pb2.NULL_VALUE
    elif isinstance(value, Mapping):
        if depth >= MAX_DEPTH:
            raise _depth_error(path)
        # SetInParent marks an empty object as present (an empty Struct is still a struct_value).
        target.struct_value.SetInParent()
        _fill_pb_struct(target.struct_value, value, path, depth + 1, big_ints)
    elif isinstance(value, list | tuple):
        if depth >= MAX_DEPTH:
            raise _depth_error(path)
        target.list_value.SetInParent()
        values = target.list_value.values
        for i, item in enumerate(value):
            _fill_pb_value(values.add(), item, f"{path}[{i}]", depth + 1, big_ints)
    else:
        raise _unsupported(path, value)


def _fill_pb_struct(
    target: struct_pb2.Struct, obj: Mapping[object, object], path: str, depth: int, big_ints: BigInts
) -> None:
    fields = target.fields
    for key, value in obj.items():
        if not isinstance(key, str):
            raise StructValueError(path, f"object key {key!r} is not a string")
        _fill_pb_value(fields[key], value, _key_path(path, key), depth, big_ints)


def json_to_pb_struct(obj: Mapping[str, object], *, big_ints: BigInts = "refuse", path: str = "") -> struct_pb2.Struct:
    """Build a upb ``Struct`` from a JSON object; ``path`` prefixes key paths in errors.

    Raises :class:`StructValueError` for big ints (unless ``big_ints="string"``), non-finite
    floats, non-JSON values, non-string keys and nesting beyond :data:`MAX_DEPTH`.
    """
    checked: object = obj  # callers hand us decoded JSON typed Any; check what it really is
    if not isinstance(checked, Mapping):
        raise StructValueError(path, f"{type(checked).__name__} is not a JSON object")
    result = struct_pb2.Struct()
    _fill_pb_struct(result, checked, path, 1, big_ints)
    return result


def json_to_pb_value(value: object, *, big_ints: BigInts = "refuse", path: str = "") -> struct_pb2.Value:
    """Build a upb ``Value`` from any JSON value (same rules as :func:`json_to_pb_struct`)."""
    result = struct_pb2.Value()
    _fill_pb_value(result, value, path, 0, big_ints)
    return result


def _pb_value_to_json(value: struct_pb2.Value, path: str) -> JsonValue:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        text: str = value.string_value
        return text
    if kind == "number_value":
        return _number_to_json(value.number_value, path)
    if kind == "bool_value":
        flag: bool = value.bool_value
        return flag
    if kind == "null_value":
        # Any NullValue number (also one we do not know) means JSON null.
        return None
    if kind == "struct_value":
        return _pb_struct_to_json(value.struct_value, path)
    if kind == "list_value":
        return [_pb_value_to_json(item, f"{path}[{i}]") for i, item in enumerate(value.list_value.values)]
    raise StructValueError(path, "Value has no kind set")


def _pb_struct_to_json(struct: struct_pb2.Struct, path: str) -> JsonObject:
    return {key: _pb_value_to_json(value, _key_path(path, key)) for key, value in struct.fields.items()}


def pb_struct_to_json(struct: struct_pb2.Struct, *, path: str = "") -> JsonObject:
    """Read a upb ``Struct`` as a JSON object (whole doubles ≤ 2^53 as int; non-finite refused)."""
    return _pb_struct_to_json(struct, path)


def pb_value_to_json(value: struct_pb2.Value, *, path: str = "") -> JsonValue:
    """Read a upb ``Value`` as a JSON value (same rules as :func:`pb_struct_to_json`)."""
    return _pb_value_to_json(value, path)


def json_to_struct_bytes(obj: Mapping[str, object], *, big_ints: BigInts = "refuse") -> bytes:
    """Serialize a JSON object as ``google.protobuf.Struct`` wire bytes (map keys sorted)."""
    data: bytes = json_to_pb_struct(obj, big_ints=big_ints).SerializeToString(deterministic=True)
    return data


def struct_bytes_to_json(data: bytes) -> JsonObject:
    """Parse ``google.protobuf.Struct`` wire bytes into a JSON object.

    Raises :class:`StructValueError` for bytes that are not a Struct and for values JSON cannot hold.
    """
    try:
        struct = struct_pb2.Struct.FromString(data)
    except _pb_message.DecodeError as exc:
        raise StructValueError("", f"not a google.protobuf.Struct: {exc}") from None
    return _pb_struct_to_json(struct, "")


# --------------------------------------------------------------------------------------- betterproto2


def _bp_value(value: object, path: str, depth: int, big_ints: BigInts) -> bp_struct.Value:
    # Exactly one oneof member is passed to each constructor: betterproto2 does not clear a
    # previously set member, so a Value must never be built by assigning two of them.
    if isinstance(value, str):
        return bp_struct.Value(string_value=value)
    if isinstance(value, bool):
        return bp_struct.Value(bool_value=value)
    if isinstance(value, int):
        text = _check_int(value, path, big_ints)
        if text is None:
            return bp_struct.Value(number_value=float(value))
        return bp_struct.Value(string_value=text)
    if isinstance(value, float):
        _check_float(value, path)
        return bp_struct.Value(number_value=value)
    if value is None:
        return bp_struct.Value(null_value=bp_struct.NullValue.NULL_VALUE)
    if isinstance(value, Mapping):
        if depth >= MAX_DEPTH:
            raise _depth_error(path)
        return bp_struct.Value(struct_value=_bp_struct(value, path, depth + 1, big_ints))
    if isinstance(value, list | tuple):
        if depth >= MAX_DEPTH:
            raise _depth_error(path)
        items = [_bp_value(item, f"{path}[{i}]", depth + 1, big_ints) for i, item in enumerate(value)]
        return bp_struct.Value(list_value=bp_struct.ListValue(values=items))
    raise _unsupported(path, value)


def _bp_struct(obj: Mapping[object, object], path: str, depth: int, big_ints: BigInts) -> bp_struct.Struct:
    fields: dict[str, bp_struct.Value] = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            raise StructValueError(path, f"object key {key!r} is not a string")
        fields[key] = _bp_value(value, _key_path(path, key), depth, big_ints)
    return bp_struct.Struct(fields=fields)


def json_to_bp_struct(obj: Mapping[str, object], *, big_ints: BigInts = "refuse", path: str = "") -> bp_struct.Struct:
    """Build a betterproto2 ``Struct`` from a JSON object (same rules as :func:`json_to_pb_struct`)."""
    checked: object = obj  # callers hand us decoded JSON typed Any; check what it really is
    if not isinstance(checked, Mapping):
        raise StructValueError(path, f"{type(checked).__name__} is not a JSON object")
    return _bp_struct(checked, path, 1, big_ints)


def json_to_bp_value(value: object, *, big_ints: BigInts = "refuse", path: str = "") -> bp_struct.Value:
    """Build a betterproto2 ``Value`` from any JSON value (same rules as :func:`json_to_pb_struct`)."""
    return _bp_value(value, path, 0, big_ints)


def _bp_value_to_json(value: bp_struct.Value, path: str) -> JsonValue:
    # betterproto2 reports an unset member as None (and explicit false/0/"" as values), so test
    # presence with `is not None`, never truthiness.
    if value.string_value is not None:
        return value.string_value
    if value.number_value is not None:
        return _number_to_json(value.number_value, path)
    if value.bool_value is not None:
        return value.bool_value
    if value.null_value is not None:
        return None
    if value.struct_value is not None:
        return _bp_struct_to_json(value.struct_value, path)
    if value.list_value is not None:
        return [_bp_value_to_json(item, f"{path}[{i}]") for i, item in enumerate(value.list_value.values)]
    raise StructValueError(path, "Value has no kind set")


def _bp_struct_to_json(struct: bp_struct.Struct, path: str) -> JsonObject:
    return {key: _bp_value_to_json(value, _key_path(path, key)) for key, value in struct.fields.items()}


def bp_struct_to_json(struct: bp_struct.Struct, *, path: str = "") -> JsonObject:
    """Read a betterproto2 ``Struct`` as a JSON object (same rules as :func:`pb_struct_to_json`)."""
    return _bp_struct_to_json(struct, path)


def bp_value_to_json(value: bp_struct.Value, *, path: str = "") -> JsonValue:
    """Read a betterproto2 ``Value`` as a JSON value (same rules as :func:`pb_struct_to_json`)."""
    return _bp_value_to_json(value, path)
