"""The handoff codec (``sidecar.convert.handoff``): KvSessionRef ⇄ ``disaggregated_params`` JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest

from openengine.v1 import kv_pb2
from sidecar.convert.capabilities import KvConnector, KvEndpointInfo
from sidecar.convert.handoff import HandoffError, handoff_to_session, session_to_handoff
from sidecar.errors import DynamoErrorKind, RequestRejected
from sidecar.testing.mock.structs import fill_struct

BIG_ID = "18446744073709551615"  # u64 max: no double holds it
WHERE = "prefill_result.disaggregated_params"


def connector(backend: str = "NIXL", protocols: tuple[str, ...] = ()) -> KvConnector:
    return KvConnector(
        enabled=True,
        transfer_backend=backend,
        local_endpoints=(KvEndpointInfo("10.0.0.5", 5555, "tcp"),),
        supported_protocols=protocols,
        supports_remote_prefill=True,
        supports_decode_pull=False,
        supports_abort_cleanup=False,
        schema_version=1,
    )


def engine_session(**attributes: Any) -> kv_pb2.KvSessionRef:
    """A KvSessionRef as TensorRT-LLM's server sends it (numbers are doubles on the wire)."""
    session = kv_pb2.KvSessionRef(session_id="12", transfer_backend="NIXL", dp_rank=0)
    session.endpoints.add(host="10.0.0.5", port=5555, protocol="tcp")
    attrs: dict[str, Any] = {
        "ctx_info_endpoint": "tcp://10.0.0.5:5555",
        "opaque_state": "AAEC",
        "first_gen_tokens": [1234],
        "disagg_request_id": BIG_ID,
        "ctx_dp_rank": 0,
        "schedule_style": 1,
        "first_gen_log_probs": [-0.25],
    }
    attrs.update(attributes)
    fill_struct(session.attributes_struct, attrs)
    return session


def handoff(**overrides: Any) -> dict[str, Any]:
    """The JSON a prefill worker produces (after the frontend: plain JSON types)."""
    params: dict[str, Any] = json.loads(json.dumps(session_to_handoff(engine_session())))
    params.update(overrides)
    return params


def test_encode_keeps_ints_ints_fractions_fractions_and_big_ids_strings() -> None:
    params: Any = session_to_handoff(engine_session(ratio=0.5, whole_double=3.0, flag=False, nothing=None))
    attrs = params["attributes_struct"]
    assert attrs["first_gen_tokens"] == [1234]
    assert type(attrs["first_gen_tokens"][0]) is int
    assert type(attrs["ctx_dp_rank"]) is int  # explicit zero kept as the integer 0
    assert attrs["ctx_dp_rank"] == 0
    assert type(attrs["whole_double"]) is int
    assert attrs["ratio"] == 0.5
    assert attrs["first_gen_log_probs"] == [-0.25]
    assert attrs["disagg_request_id"] == BIG_ID, "a large id stays a decimal string"
    assert attrs["flag"] is False
    assert attrs["nothing"] is None
    assert params["session_id"] == "12"
    assert params["endpoints"] == [{"host": "10.0.0.5", "port": 5555, "protocol": "tcp"}]
    assert params["dp_rank"] == 0
    assert params["transfer_backend"] == "NIXL"
    # The JSON text renders integers without a fraction: what the frontend forwards byte-faithfully.
    assert '"first_gen_tokens": [1234]' in json.dumps(params)


def test_round_trip_replays_the_same_session_verbatim() -> None:
    original = engine_session(nested={"zero": 0, "list": [1, 2.5, "x", True, None]})
    replayed = handoff_to_session(json.loads(json.dumps(session_to_handoff(original))), connector=connector())
    assert replayed == original
    assert replayed.SerializeToString(deterministic=True) == original.SerializeToString(deterministic=True)


def test_unknown_fields_are_preserved_in_attributes_and_accepted_elsewhere() -> None:
    params = handoff(future_top_level={"x": 1})
    params["endpoints"][0]["future_endpoint_field"] = "ignored"
    params["attributes_struct"]["tensorrt_llm.future_profile.v9"] = {"opaque": [1, 2, 3], "id": BIG_ID}
    session = handoff_to_session(params, connector=connector())
    again: Any = session_to_handoff(session)
    assert again["attributes_struct"]["tensorrt_llm.future_profile.v9"] == {"opaque": [1, 2, 3], "id": BIG_ID}
    assert again["endpoints"] == [{"host": "10.0.0.5", "port": 5555, "protocol": "tcp"}]


def test_the_attributes_alias_of_the_rust_sidecar_is_accepted() -> None:
    params = handoff()
    params["attributes"] = params.pop("attributes_struct")
    assert handoff_to_session(params, connector=connector()).attributes_struct.fields["disagg_request_id"]


@pytest.mark.parametrize("missing", ["session_id", "transfer_backend", "endpoints", "dp_rank", "attributes_struct"])
def test_a_missing_field_is_rejected_naming_it(missing: str) -> None:
    params = handoff()
    del params[missing]
    with pytest.raises(RequestRejected) as caught:
        handoff_to_session(params, connector=connector())
    assert caught.value.field == f"{WHERE}.{missing}"
    assert "missing" in caught.value.reason
    assert caught.value.kind is DynamoErrorKind.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (lambda p: p["endpoints"][0].update(port=70000), "endpoints[0].port", "out of range"),
        (lambda p: p["endpoints"][0].update(port=0), "endpoints[0].port", "out of range"),
        (lambda p: p["endpoints"][0].update(port="5555"), "endpoints[0].port", "integer"),
        (lambda p: p["endpoints"][0].update(port=True), "endpoints[0].port", "integer"),
        (lambda p: p["endpoints"][0].pop("port"), "endpoints[0].port", "missing"),
        (lambda p: p["endpoints"][0].update(host="  "), "endpoints[0].host", "empty"),
        (lambda p: p["endpoints"][0].update(protocol=""), "endpoints[0].protocol", "empty"),
        (lambda p: p.update(endpoints={"host": "x"}), "endpoints", "list"),
        (lambda p: p.update(session_id=""), "session_id", "empty"),
        (lambda p: p.update(session_id=12), "session_id", "string"),
        (lambda p: p.update(dp_rank=-1), "dp_rank", "out of range"),
        (lambda p: p.update(dp_rank=2**32), "dp_rank", "out of range"),
        (lambda p: p.update(attributes_struct=[1]), "attributes_struct", "object"),
        (lambda p: p["attributes_struct"].update(id=2**53 + 1), "attributes_struct.id", "2^53"),
        (lambda p: p["attributes_struct"].update(x=float("inf")), "attributes_struct.x", "non-finite"),
        (lambda p: p.update(attributes=p["attributes_struct"]), "attributes", "together"),
    ],
    ids=[
        "port 70000",
        "port 0",
        "port string",
        "port bool",
        "port missing",
        "blank host",
        "empty protocol",
        "endpoints not a list",
        "empty session id",
        "numeric session id",
        "negative dp rank",
        "dp rank beyond u32",
        "attributes not an object",
        "2^53+1 id",
        "infinity",
        "both attribute keys",
    ],
)
def test_a_bad_field_is_rejected_naming_it(mutate: Any, field: str, words: str) -> None:
    params = handoff()
    mutate(params)
    with pytest.raises(RequestRejected) as caught:
        handoff_to_session(params, connector=connector())
    assert caught.value.field == f"{WHERE}.{field}"
    assert words in caught.value.reason


def test_a_transfer_backend_other_than_the_connectors_is_rejected() -> None:
    with pytest.raises(RequestRejected) as caught:
        handoff_to_session(handoff(transfer_backend="UCX"), connector=connector("NIXL"))
    assert caught.value.field == f"{WHERE}.transfer_backend"
    assert "'UCX'" in caught.value.reason
    assert "'NIXL'" in caught.value.reason
    # Case does not matter; an engine that reports no connector has nothing to check against.
    assert handoff_to_session(handoff(transfer_backend="nixl"), connector=connector("NIXL"))
    assert handoff_to_session(handoff(transfer_backend="UCX"), connector=None)


def test_an_endpoint_protocol_the_connector_does_not_list_is_rejected() -> None:
    with pytest.raises(RequestRejected) as caught:
        handoff_to_session(handoff(), connector=connector(protocols=("ucx", "nixl")))
    assert caught.value.field == f"{WHERE}.endpoints[0].protocol"
    assert handoff_to_session(handoff(), connector=connector(protocols=("TCP",)))


def test_empty_endpoints_and_null_attributes_are_valid() -> None:
    session = handoff_to_session(handoff(endpoints=[], attributes_struct=None), connector=connector())
    assert list(session.endpoints) == []
    assert not session.HasField("attributes_struct")


def test_a_whole_float_number_is_accepted_where_an_integer_is_due() -> None:
    session = handoff_to_session(handoff(dp_rank=1.0), connector=connector())
    assert session.dp_rank == 1
    with pytest.raises(RequestRejected):
        handoff_to_session(handoff(dp_rank=1.5), connector=connector())


def test_not_an_object_is_rejected() -> None:
    with pytest.raises(RequestRejected) as caught:
        handoff_to_session("session-12", connector=None)
    assert caught.value.field == WHERE


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda s: setattr(s, "session_id", ""), "session_id"),
        (lambda s: s.ClearField("attributes_struct"), "attributes_struct"),
        (lambda s: s.endpoints[0].__setattr__("port", 70000), "endpoints[0].port"),
        (lambda s: s.endpoints[0].__setattr__("port", 0), "endpoints[0].port"),
        (lambda s: s.endpoints[0].__setattr__("host", ""), "endpoints[0].host"),
        (lambda s: s.attributes_struct.fields["x"].__setattr__("number_value", float("nan")), "attributes_struct.x"),
    ],
    ids=["no session id", "no attributes", "port 70000", "port 0", "no host", "NaN"],
)
def test_an_unusable_engine_session_cannot_be_handed_off(mutate: Any, field: str) -> None:
    session = engine_session()
    mutate(session)
    with pytest.raises(HandoffError) as caught:
        session_to_handoff(session)
    assert caught.value.field == field
