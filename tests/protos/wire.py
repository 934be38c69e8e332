"""The OpenEngine wire contract as data: from the generated descriptors, and from the v0.1.0 reference.

Both sides produce the same :class:`WireModel` — every service, enum and message with its numbers,
names, types and labels — so a test can compare them item by item, and :func:`render` turns the
descriptor side into the committed snapshot ``tests/protos/wire_table.txt``.

The label vocabulary is the v0.1.0 wire reference's (its "Label column legend"):
``singular``, ``optional`` (proto3 optional), ``singular (message)``, ``repeated``, ``oneof <group>``.

Regenerate the snapshot (after a deliberate schema change only)::

    python -m tests.protos.wire --write
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool

import openengine.v1.openengine_pb2  # noqa: F401  (registers all eight files in the default pool)

PROTO_FILES = (
    "openengine/v1/error.proto",
    "openengine/v1/generation.proto",
    "openengine/v1/kv.proto",
    "openengine/v1/lifecycle.proto",
    "openengine/v1/lora.proto",
    "openengine/v1/model.proto",
    "openengine/v1/openengine.proto",
    "openengine/v1/server.proto",
)
PACKAGE = "openengine.v1"
SNAPSHOT = Path(__file__).with_name("wire_table.txt")

Field = tuple[int, str, str, str]  # number, name, type, label
Rpc = tuple[str, str, str, str]  # name, request, response, streaming ("unary" | "server" | "client" | "bidi")


@dataclass
class WireModel:
    """Services, enums and messages, each keyed by full name, plus the file that declares it."""

    files: dict[str, list[str]] = field(default_factory=dict)  # file → declared full names, in order
    services: dict[str, list[Rpc]] = field(default_factory=dict)
    enums: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    messages: dict[str, list[Field]] = field(default_factory=dict)


_SCALAR = {
    value: name.removeprefix("TYPE_").lower()
    for name, value in descriptor_pb2.FieldDescriptorProto.Type.items()
    if name not in ("TYPE_MESSAGE", "TYPE_ENUM", "TYPE_GROUP")
}


def _label(proto: descriptor_pb2.FieldDescriptorProto, message: descriptor_pb2.DescriptorProto) -> str:
    if proto.proto3_optional:
        return "optional"
    if proto.HasField("oneof_index"):
        return f"oneof {message.oneof_decl[proto.oneof_index].name}"
    if proto.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED:
        return "repeated"
    if proto.type == descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE:
        return "singular (message)"
    return "singular"


def _type(proto: descriptor_pb2.FieldDescriptorProto) -> str:
    if proto.type in (descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE, descriptor_pb2.FieldDescriptorProto.TYPE_ENUM):
        type_name: str = proto.type_name
        return type_name.removeprefix(".")
    scalar: str = _SCALAR[proto.type]
    return scalar


def _streaming(method: descriptor_pb2.MethodDescriptorProto) -> str:
    return {
        (False, False): "unary",
        (False, True): "server",
        (True, False): "client",
        (True, True): "bidi",
    }[(method.client_streaming, method.server_streaming)]


def from_descriptors() -> WireModel:
    """The contract as the generated upb modules carry it."""
    pool = descriptor_pool.Default()
    model = WireModel()
    for name in PROTO_FILES:
        proto = descriptor_pb2.FileDescriptorProto()
        pool.FindFileByName(name).CopyToProto(proto)
        declared = model.files.setdefault(name, [])
        prefix = f"{proto.package}."
        for enum in proto.enum_type:
            declared.append(prefix + enum.name)
            model.enums[prefix + enum.name] = [(value.name, value.number) for value in enum.value]
        for message in proto.message_type:
            _add_message(model, declared, prefix, message)
        for service in proto.service:
            declared.append(prefix + service.name)
            model.services[prefix + service.name] = [
                (m.name, m.input_type.removeprefix("."), m.output_type.removeprefix("."), _streaming(m))
                for m in service.method
            ]
    return model


def _add_message(model: WireModel, declared: list[str], prefix: str, message: descriptor_pb2.DescriptorProto) -> None:
    full = prefix + message.name
    declared.append(full)
    model.messages[full] = [(f.number, f.name, _type(f), _label(f, message)) for f in message.field]
    for enum in message.enum_type:
        declared.append(f"{full}.{enum.name}")
        model.enums[f"{full}.{enum.name}"] = [(value.name, value.number) for value in enum.value]
    for nested in message.nested_type:
        _add_message(model, declared, f"{full}.", nested)


def render(model: WireModel) -> str:
    """The snapshot text: one block per file, items in declaration order."""
    lines = [
        "# OpenEngine v0.1.0 wire table, rendered from the generated descriptors by tests/protos/wire.py.",
        "# Do not edit by hand: a difference is a schema change (python -m tests.protos.wire --write).",
    ]
    for name, declared in model.files.items():
        lines.append("")
        lines.append(f"file {name}")
        for full in declared:
            if full in model.services:
                lines.append(f"  service {full}")
                lines.extend(f"    rpc {rpc} {req} -> {resp} {kind}" for rpc, req, resp, kind in model.services[full])
            elif full in model.enums:
                lines.append(f"  enum {full}")
                lines.extend(f"    {number} {value}" for value, number in model.enums[full])
            else:
                fields = model.messages[full]
                lines.append(f"  message {full}" + ("" if fields else " (empty)"))
                lines.extend(f"    {number} {fname} {ftype} {label}" for number, fname, ftype, label in fields)
    return "\n".join(lines) + "\n"


_CODE = re.compile(r"`([^`]*)`")


def _unquote(text: str) -> str:
    return _CODE.sub(r"\1", text)


def _cells(line: str) -> list[str]:
    return [_unquote(cell.strip()) for cell in line.strip().strip("|").split("|")]


def from_reference(text: str) -> WireModel:
    """The contract as the v0.1.0 reference's tables state it (§2 services, §3 enums, §4 messages)."""
    model = WireModel()
    section = current_file = ""
    service = enum = message = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("## "):
            section = line.split()[1]
            service = enum = message = None
            continue
        if section == "2." and line.startswith("### "):
            service = _unquote(line.split()[1])
            model.services[service] = []
        elif section == "3." and line.startswith("### "):
            # ### `ErrorCode` (openengine/v1/error.proto)
            _, name, declared_in = line.split()
            enum = f"{PACKAGE}.{_unquote(name)}"
            model.enums[enum] = []
            model.files.setdefault(declared_in.strip("()"), []).append(enum)
        elif section == "4." and line.startswith("### "):
            current_file = line.split()[1]
        elif section == "4." and line.startswith("#### "):
            message = f"{PACKAGE}.{_unquote(line.split()[1])}"
            model.messages[message] = []
            model.files.setdefault(current_file, []).append(message)
        elif not line.startswith("|") or line.startswith("|---") or line.startswith("| #") or line.startswith("| RPC"):
            continue
        elif section == "2." and service is not None:
            rpc, request, response, streaming = _cells(line)
            model.services[service].append((rpc, request, response, streaming))
        elif section == "3." and enum is not None and not line.startswith("| Value"):
            value, number = _cells(line)
            model.enums[enum].append((value, int(number)))
        elif section == "4." and message is not None:
            number, name, type_, label = _cells(line)
            model.messages[message].append((int(number), name, type_, label))
    return model


def main(argv: list[str] | None = None) -> int:
    """Print the snapshot, or write it with ``--write``."""
    parser = argparse.ArgumentParser(description="Render the OpenEngine wire table from the descriptors.")
    parser.add_argument("--write", action="store_true", help=f"write {SNAPSHOT.name}")
    args = parser.parse_args(argv)
    text = render(from_descriptors())
    if args.write:
        SNAPSHOT.write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
