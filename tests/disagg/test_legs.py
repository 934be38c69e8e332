"""Prefill and decode legs in ``sidecar.convert``: request mapping by role, and the response mapper per leg."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from openengine.v1 import error_pb2, generation_pb2
from sidecar.convert import ResponseMapper
from sidecar.convert.capabilities import KvConnector
from sidecar.convert.handoff import session_to_handoff
from sidecar.convert.structjson import pb_struct_to_json
from sidecar.errors import DynamoErrorKind, EngineFailure, HandoffMissing, ProtocolViolation, RequestRejected, Violation
from tests.convert.factories import CAPS, REQUEST_ID, build
from tests.disagg.test_handoff import engine_session

R = generation_pb2.GenerateResponse
STOP = generation_pb2.FINISH_REASON_STOP
LENGTH = generation_pb2.FINISH_REASON_LENGTH
CANCELLED = generation_pb2.FINISH_REASON_CANCELLED

NIXL = KvConnector(
    enabled=True,
    transfer_backend="NIXL",
    local_endpoints=(),
    supported_protocols=(),
    supports_remote_prefill=True,
    supports_decode_pull=False,
    supports_abort_cleanup=False,
    schema_version=1,
)
DISAGG_CAPS = dataclasses.replace(CAPS, kv_connector=NIXL)


def handoff_json() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(session_to_handoff(engine_session())))
    return loaded


def decode_request(**extra: Any) -> dict[str, Any]:
    return {
        "token_ids": [11, 12, 13, 14],
        "stop_conditions": {"max_tokens": 8},
        "prefill_result": {
            "disaggregated_params": handoff_json(),
            "prompt_tokens_details": {"audio_tokens": None, "cached_tokens": 2},
        },
        **extra,
    }


# ---------------------------------------------------------------------------------------------- request mapping


def test_a_prefill_leg_is_one_context_only_token_with_min_tokens_kept() -> None:
    call = build(
        {"token_ids": [11, 12, 13], "stop_conditions": {"max_tokens": 1, "min_tokens": 5, "ignore_eos": False}},
        role="prefill",
    )
    request = call.request
    assert call.leg == "prefill"
    assert call.max_tokens == 1
    assert request.stopping.max_tokens == 1
    assert request.stopping.min_tokens == 1, "EOS may not end the one-token context phase"
    assert pb_struct_to_json(request.extra) == {"request_type": "context_only"}
    assert not request.HasField("kv")
    assert not call.handoff


def test_a_prefill_leg_without_max_tokens_still_asks_for_one() -> None:
    call = build({"token_ids": [11, 12, 13]}, role="prefill")
    assert call.request.stopping.max_tokens == 1
    assert not call.request.stopping.HasField("min_tokens")


def test_a_prefill_leg_serves_one_output() -> None:
    with pytest.raises(RequestRejected) as caught:
        build({"token_ids": [11], "sampling_options": {"n": 2}}, role="prefill")
    assert caught.value.field == "sampling_options.n"


@pytest.mark.parametrize("role", ["aggregated", "prefill"])
def test_a_handoff_on_a_non_decode_worker_is_rejected(role: Any) -> None:
    with pytest.raises(RequestRejected) as caught:
        build(decode_request(), role=role, capabilities=DISAGG_CAPS)
    assert caught.value.field == "prefill_result"
    assert "decode worker" in caught.value.reason


def test_a_decode_leg_replays_the_handoff_as_kv_session_with_the_full_prompt() -> None:
    call = build(decode_request(), role="decode", capabilities=DISAGG_CAPS)
    assert call.leg == "decode"
    assert call.handoff
    assert list(call.request.token_ids.ids) == [11, 12, 13, 14]
    assert call.request.kv.session == engine_session()
    assert call.request.stopping.max_tokens == 8
    assert not call.request.HasField("extra"), "no request_type on a decode leg: kv.session says generation_only"
    assert call.prefill_cached_tokens == 2


def test_a_decode_worker_without_a_handoff_runs_the_whole_request() -> None:
    call = build({"token_ids": [11, 12], "stop_conditions": {"max_tokens": 8}}, role="decode")
    assert call.leg == "aggregated"
    assert not call.handoff
    assert not call.request.HasField("kv")
    assert call.request.stopping.max_tokens == 8


def test_a_decode_handoff_is_validated_naming_the_field() -> None:
    body = decode_request()
    body["prefill_result"]["disaggregated_params"]["transfer_backend"] = "UCX"
    with pytest.raises(RequestRejected) as caught:
        build(body, role="decode", capabilities=DISAGG_CAPS)
    assert caught.value.field == "prefill_result.disaggregated_params.transfer_backend"

    body = decode_request()
    body["prefill_result"]["disaggregated_params"] = None
    with pytest.raises(RequestRejected) as caught:
        build(body, role="decode", capabilities=DISAGG_CAPS)
    assert caught.value.field == "prefill_result.disaggregated_params"


def test_a_decode_leg_with_n_above_one_is_rejected() -> None:
    with pytest.raises(RequestRejected):
        build(decode_request(sampling_options={"n": 2}), role="decode", capabilities=DISAGG_CAPS)


def test_bootstrap_info_is_refused_on_every_role() -> None:
    for role in ("aggregated", "prefill", "decode"):
        with pytest.raises(RequestRejected) as caught:
            build({"token_ids": [1], "bootstrap_info": {"bootstrap_host": "h"}}, role=role)
        assert caught.value.field == "bootstrap_info"


# ---------------------------------------------------------------------------------------------- response mapping


def prefill_mapper(logprobs: int | None = None) -> ResponseMapper:
    return ResponseMapper(REQUEST_ID, n=1, logprobs=logprobs, prompt_tokens=3, leg="prefill")


def token(*ids: int, logprob: float | None = None) -> R:
    response = R(request_id=REQUEST_ID)
    response.token.output_index = 0
    for i in ids:
        info = response.token.tokens.add(token_id=i)
        if logprob is not None:
            info.logprob = logprob
    return response


def usage(response: R, prompt: int = 3, completion: int = 1, cached: int | None = None) -> R:
    response.usage.prompt_tokens = prompt
    response.usage.completion_tokens = completion
    response.usage.total_tokens = prompt + completion
    if cached is not None:
        response.usage.cached_prompt_tokens = cached
    return response


def prefill_ready(session: Any = None, with_usage: bool = True) -> R:
    response = R(request_id=REQUEST_ID)
    response.prefill_ready.kv_session.CopyFrom(engine_session() if session is None else session)
    return usage(response, cached=1) if with_usage else response


def finished(reason: int, message: str = "") -> R:
    response = R(request_id=REQUEST_ID)
    response.finished.output_index = 0
    response.finished.reason = reason  # type: ignore[assignment]
    if message:
        response.finished.message = message
    if reason == STOP:
        response.finished.stop_match.eos_token_id = 2
    return usage(response)


def test_prefill_ready_is_the_terminal_handoff_chunk() -> None:
    m = prefill_mapper()
    assert m.map([token(1234)]) == [], "the prefill token is held back: the decode engine replays it"
    chunks = m.map([prefill_ready()])
    assert m.done
    assert m.handed_off
    assert chunks == [
        {
            "token_ids": [],
            "index": 0,
            "finish_reason": "length",  # the frontend chains into decode only on length
            "completion_usage": {
                "prompt_tokens": 3,
                "completion_tokens": 0,
                "total_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 1},
            },
            "disaggregated_params": session_to_handoff(engine_session()),
        }
    ]
    m.end_of_stream()


def test_prefill_ready_keeps_the_engines_reported_prompt_usage() -> None:
    m = ResponseMapper(REQUEST_ID, n=1, logprobs=None, prompt_tokens=3, leg="prefill")
    response = prefill_ready()
    response.usage.prompt_tokens = 7
    (chunk,) = m.map([response])
    assert chunk["completion_usage"]["prompt_tokens"] == 7


def test_a_legitimate_early_stop_returns_the_held_tokens_as_the_whole_answer() -> None:
    m = prefill_mapper(logprobs=0)
    assert m.map([token(2, logprob=-0.5)]) == []
    (chunk,) = m.map([finished(STOP)])
    assert chunk["token_ids"] == [2]
    assert chunk["log_probs"] == [-0.5]
    assert chunk["finish_reason"] == "stop"
    assert chunk["stop_reason"] == 2
    assert chunk["completion_usage"]["completion_tokens"] == 1
    assert "disaggregated_params" not in chunk
    assert m.done
    assert not m.handed_off


def test_a_prefill_that_ran_out_of_budget_without_a_handoff_says_why() -> None:
    m = prefill_mapper()
    m.map([token(7)])
    with pytest.raises(HandoffMissing) as caught:
        m.map([finished(LENGTH)])
    assert "no PrefillReady" in str(caught.value)
    assert "cache_transceiver_config" in str(caught.value), "tells the operator what to check"
    assert caught.value.kind is DynamoErrorKind.UNKNOWN
    assert not caught.value.migratable
    assert m.done


def test_a_prefill_the_engine_cancelled_says_so() -> None:
    with pytest.raises(HandoffMissing) as caught:
        prefill_mapper().map([finished(CANCELLED, message="aborted")])
    assert "'cancelled'" in str(caught.value)
    assert "engine says: aborted" in str(caught.value)


@pytest.mark.parametrize(
    ("batch", "violation"),
    [
        ([prefill_ready(with_usage=False)], Violation.MISSING_USAGE),
        ([prefill_ready(session=engine_session().__class__(session_id="1"))], Violation.BAD_HANDOFF),
        ([token(1), token(2), prefill_ready(), token(3)], Violation.EVENT_AFTER_TERMINAL),
    ],
    ids=["no usage", "no attributes", "event after the handoff"],
)
def test_a_malformed_prefill_ready_is_a_protocol_violation(batch: list[R], violation: Violation) -> None:
    with pytest.raises(ProtocolViolation) as caught:
        prefill_mapper().map(batch)
    assert caught.value.violation is violation


def test_a_handoff_with_a_bad_port_is_a_protocol_violation_naming_it() -> None:
    session = engine_session()
    session.endpoints[0].port = 70000
    with pytest.raises(ProtocolViolation) as caught:
        prefill_mapper().map([prefill_ready(session)])
    assert caught.value.violation is Violation.BAD_HANDOFF
    assert "endpoints[0].port" in str(caught.value)


def test_prefill_ready_on_an_aggregated_request_or_a_decode_leg_is_unexpected() -> None:
    for leg in ("aggregated", "decode"):
        m = ResponseMapper(REQUEST_ID, n=1, logprobs=None, prompt_tokens=3, leg=leg)
        with pytest.raises(ProtocolViolation) as caught:
            m.map([prefill_ready()])
        assert caught.value.violation is Violation.UNEXPECTED_EVENT


def test_a_decode_leg_streams_the_replayed_first_token_and_reports_the_prefill_cache_hits() -> None:
    m = ResponseMapper(REQUEST_ID, n=1, logprobs=0, prompt_tokens=4, leg="decode", cached_tokens=2)
    first = m.map([token(1234)])  # replayed without a logprob
    assert first == [{"token_ids": [1234], "index": 0, "log_probs": [-9999.0], "top_logprobs": [[]]}]
    response = finished(LENGTH)
    usage(response, prompt=4, completion=2, cached=4)  # the engine counts the transferred prompt as cached
    (last,) = m.map([token(99, logprob=-0.1), response])
    assert last["token_ids"] == [99]
    assert last["completion_usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_a_decode_engine_error_keeps_its_hint() -> None:
    error = R(request_id=REQUEST_ID)
    error.error.code = error_pb2.ERROR_CODE_KV_SESSION_NOT_FOUND
    error.error.message = "session 12 expired"
    with pytest.raises(EngineFailure) as caught:
        ResponseMapper(REQUEST_ID, n=1, logprobs=None, prompt_tokens=3, leg="decode").map([error])
    assert "expired" in str(caught.value)
    assert "no longer holds this KV session" in str(caught.value)
    assert caught.value.kind is DynamoErrorKind.UNKNOWN, "a lost KV session is the engines' failure (500), not a 400"


def test_role_mismatch_is_a_400_with_a_hint() -> None:
    failure = EngineFailure(error_pb2.ERROR_CODE_ROLE_MISMATCH, "this engine serves decode", retryable=False)
    assert failure.kind is DynamoErrorKind.INVALID_ARGUMENT
    assert "--disaggregation-mode" in failure.message
    assert not failure.migratable


def test_a_prefill_mapper_has_one_output() -> None:
    with pytest.raises(ValueError, match="one output"):
        ResponseMapper(REQUEST_ID, n=2, logprobs=None, prompt_tokens=3, leg="prefill")
