"""``google.protobuf.Struct`` ⇄ plain Python values (numbers stay doubles, as on the wire)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from google.protobuf import struct_pb2

__all__ = ["JsonValue", "fill_struct", "struct_to_dict", "value_to_python"]

JsonValue = None | bool | float | str | list["JsonValue"] | dict[str, "JsonValue"]


def value_to_python(value: struct_pb2.Value) -> JsonValue:
    """One ``Value`` as ``None`` / ``bool`` / ``float`` / ``str`` / ``list`` / ``dict``."""
    kind = value.WhichOneof("kind")
    if kind == "null_value" or kind is None:
        return None
    if kind == "bool_value":
        return bool(value.bool_value)
    if kind == "number_value":
        return float(value.number_value)
    if kind == "string_value":
        return str(value.string_value)
    if kind == "list_value":
        return [value_to_python(v) for v in value.list_value.values]
    return struct_to_dict(value.struct_value)


def struct_to_dict(struct: struct_pb2.Struct) -> dict[str, JsonValue]:
    """A ``Struct`` as a ``dict``."""
    return {key: value_to_python(v) for key, v in struct.fields.items()}


def _fill_value(target: struct_pb2.Value, value: object) -> None:
    if value is None:
        target.null_value = struct_pb2.NULL_VALUE
    elif isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int | float):
        target.number_value = float(value)
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, Mapping):
        target.struct_value.Clear()
        fill_struct(target.struct_value, value)
    elif isinstance(value, Sequence):
        target.list_value.Clear()
        for item in value:
            _fill_value(target.list_value.values.add(), item)
    else:
        raise TypeError(f"cannot put {type(value).__name__} into a Struct")


def fill_struct(target: struct_pb2.Struct, values: Mapping[str, object]) -> None:
    """Set ``target``'s fields from ``values`` (ints become doubles; big ids should be strings)."""
    for key, value in values.items():
        _fill_value(target.fields[key], value)
