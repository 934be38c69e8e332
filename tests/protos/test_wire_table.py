"""The generated descriptors are OpenEngine **v0.1.0**, not the main branch (wire reference §6).

Three layers: the numbering traps named one by one; a full snapshot of every service, enum and
message (``wire_table.txt``); and, when the v0.1.0 reference is at hand, every table in it compared
item by item with the descriptors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import pytest

from openengine.v1 import error_pb2, kv_pb2, lifecycle_pb2
from openengine_bp.openengine.v1 import ErrorCode, HealthState, KvConnectorInfo
from sidecar.errors import EngineErrorCode

from . import wire

#: The v0.1.0 wire tables this project's codecs were built from (Markdown, rendered from the descriptors of the eight
#: .proto files TensorRT-LLM vendors). Not part of the repository: the committed snapshot ``wire_table.txt`` carries
#: what was checked against them; point this variable at a copy to compare again.
REFERENCE = os.environ.get("OPENENGINE_WIRE_REFERENCE", "")


@pytest.fixture(scope="module")
def descriptors() -> wire.WireModel:
    return wire.from_descriptors()


@pytest.fixture(scope="module")
def reference() -> wire.WireModel:
    if not REFERENCE or not Path(REFERENCE).is_file():
        pytest.skip("no v0.1.0 wire tables to compare with (set OPENENGINE_WIRE_REFERENCE to a copy)")
    return wire.from_reference(Path(REFERENCE).read_text())


# ------------------------------------------------------------------------------------ numbering traps


def test_error_code_internal_is_11() -> None:
    assert error_pb2.ERROR_CODE_INTERNAL == 11
    assert int(ErrorCode.INTERNAL) == 11


def test_health_state_not_ready_is_4() -> None:
    assert lifecycle_pb2.HEALTH_STATE_NOT_READY == 4
    assert int(HealthState.NOT_READY) == 4


def test_kv_connector_schema_version_is_field_8() -> None:
    assert kv_pb2.KvConnectorInfo.DESCRIPTOR.fields_by_name["schema_version"].number == 8
    assert cast(Any, KvConnectorInfo)._betterproto.field_name_by_number[8] == "schema_version"
    assert "supports_drain" not in kv_pb2.KvConnectorInfo.DESCRIPTOR.fields_by_name


def test_nothing_about_draining(descriptors: wire.WireModel) -> None:
    names = [value for values in descriptors.enums.values() for value, _ in values]
    names += [name for fields in descriptors.messages.values() for _, name, _, _ in fields]
    names += [rpc for rpcs in descriptors.services.values() for rpc, _, _, _ in rpcs]
    names += list(descriptors.messages)
    assert [name for name in names if "drain" in name.lower()] == []
    rpcs = {rpc for rpcs in descriptors.services.values() for rpc, _, _, _ in rpcs}
    assert "GetKvConnectorInfo" not in rpcs


def test_error_table_codes_match_the_schema() -> None:
    # sidecar.errors mirrors ErrorCode so that convert/ and dynamo/ need no generated code for it.
    schema = {name.removeprefix("ERROR_CODE_"): number for name, number in error_pb2.ErrorCode.items()}
    assert {code.name: int(code) for code in EngineErrorCode} == schema


# ------------------------------------------------------------------------------------------ snapshot


def test_snapshot_matches_descriptors(descriptors: wire.WireModel) -> None:
    assert wire.render(descriptors) == wire.SNAPSHOT.read_text(), (
        "the generated descriptors differ from tests/protos/wire_table.txt; "
        "if the schema change is deliberate, run: python -m tests.protos.wire --write"
    )


def test_snapshot_covers_every_file(descriptors: wire.WireModel) -> None:
    assert list(descriptors.files) == list(wire.PROTO_FILES)
    # openengine.proto declares the services and no messages.
    assert descriptors.files["openengine/v1/openengine.proto"] == ["openengine.v1.Inference", "openengine.v1.Control"]


# ------------------------------------------------------------------------- against the v0.1.0 reference


def test_reference_totals(reference: wire.WireModel, descriptors: wire.WireModel) -> None:
    # "8 files, 2 services, 11 RPCs, 63 messages (6 of them empty), 9 enums, 243 fields"
    for model in (reference, descriptors):
        assert len(model.services) == 2
        assert sum(len(rpcs) for rpcs in model.services.values()) == 11
        assert len(model.messages) == 63
        assert sum(1 for fields in model.messages.values() if not fields) == 6
        assert len(model.enums) == 9
        assert sum(len(fields) for fields in model.messages.values()) == 243


def test_reference_services(reference: wire.WireModel, descriptors: wire.WireModel) -> None:
    assert descriptors.services == reference.services


def test_reference_enums(reference: wire.WireModel, descriptors: wire.WireModel) -> None:
    assert sorted(descriptors.enums) == sorted(reference.enums)
    for name, values in reference.enums.items():
        assert descriptors.enums[name] == values, name


def test_reference_messages(reference: wire.WireModel, descriptors: wire.WireModel) -> None:
    assert sorted(descriptors.messages) == sorted(reference.messages)
    for name, fields in reference.messages.items():
        # (number, name, type, label) for every field, in declaration order.
        assert descriptors.messages[name] == fields, name


def test_reference_file_of_each_item(reference: wire.WireModel, descriptors: wire.WireModel) -> None:
    declared_in = {item: file for file, items in descriptors.files.items() for item in items}
    for file, items in reference.files.items():
        for item in items:
            assert declared_in[item] == file, item
