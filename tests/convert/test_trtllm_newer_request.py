"""What newer TensorRT-LLM servers need from a request (issue 36 §2): ``extra.conversation_id`` from the session Dynamo
1.6.1 hands a worker (``agent_context.session_id``, from the client's ``X-Dynamo-Session-ID``), request ids within the
multi-frontend limit, no DP-rank target with several outputs. Through the real frontend:
``tests/e2e/test_trtllm_newer.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.convert.request import FIELD_POLICY
from sidecar.errors import RequestRejected
from tests.disagg.test_legs import NIXL, decode_request

from .factories import BASE_REQUEST, build, caps, merge

TRT = caps(engine_name="tensorrt_llm")
#: TensorRT-LLM's multi-frontend limit on request ids, in UTF-8 bytes.
MAX_REQUEST_ID_BYTES = 1024
#: What the 1.6.1 frontend put in the request dict for ``X-Dynamo-Session-ID: sess-7`` (observed with an echo worker).
AGENT_CONTEXT = {"session_id": "sess-7", "input_trigger": "user_message"}


def conversation(call: Any) -> str | None:
    field = call.request.extra.fields.get("conversation_id")
    return None if field is None else str(field.string_value)


def test_the_session_becomes_the_conversation_id_for_tensorrt_llm() -> None:
    call = build(merge(BASE_REQUEST, {"agent_context": AGENT_CONTEXT}), capabilities=TRT)
    assert conversation(call) == "sess-7"
    assert FIELD_POLICY.get("agent_context.session_id", ("",))[0] == "mapped"


def test_it_is_trimmed_and_a_blank_one_is_not_sent() -> None:
    padded = build(merge(BASE_REQUEST, {"agent_context": {"session_id": "  sess-7\t"}}), capabilities=TRT)
    assert conversation(padded) == "sess-7"
    blank = build(merge(BASE_REQUEST, {"agent_context": {"session_id": "   "}}), capabilities=TRT)
    assert conversation(blank) is None
    assert conversation(build(BASE_REQUEST, capabilities=TRT)) is None
    assert conversation(build(merge(BASE_REQUEST, {"agent_context": None}), capabilities=TRT)) is None


@pytest.mark.parametrize("role", ["aggregated", "prefill"])
def test_both_legs_carry_the_same_conversation_id(role: Any) -> None:
    call = build(merge(BASE_REQUEST, {"agent_context": AGENT_CONTEXT}), capabilities=TRT, role=role)
    assert conversation(call) == "sess-7"
    if role == "prefill":
        assert call.request.extra.fields["request_type"].string_value == "context_only", "beside the phase"


def test_the_decode_leg_carries_it_too() -> None:
    request = decode_request()
    request["agent_context"] = AGENT_CONTEXT
    call = build(request, capabilities=caps(engine_name="tensorrt_llm", kv_connector=NIXL), role="decode")
    assert call.leg == "decode"
    assert conversation(call) == "sess-7"


def test_an_engine_not_known_to_take_it_is_not_sent_it() -> None:
    call = build(merge(BASE_REQUEST, {"agent_context": AGENT_CONTEXT}))  # engine_name "mock"
    assert conversation(call) is None


def test_the_requests_own_extra_annotation_wins() -> None:
    body = merge(
        BASE_REQUEST, {"agent_context": AGENT_CONTEXT, "annotations": ['openengine-extra:{"conversation_id": "mine"}']}
    )
    assert conversation(build(body, capabilities=TRT)) == "mine"


@pytest.mark.parametrize(
    ("agent_context", "field"),
    [({"session_id": 7}, "agent_context.session_id"), ("sess-7", "agent_context")],
)
def test_a_malformed_session_is_refused_naming_it(agent_context: Any, field: str) -> None:
    with pytest.raises(RequestRejected) as caught:
        build(merge(BASE_REQUEST, {"agent_context": agent_context}), capabilities=TRT)
    assert caught.value.field == field


def test_request_ids_up_to_the_multi_frontend_limit_are_sent_longer_ones_refused() -> None:
    longest = "é" * (MAX_REQUEST_ID_BYTES // 2)  # 1024 UTF-8 bytes in 512 characters
    assert build(BASE_REQUEST, request_id=longest).request.request_id == longest
    for too_long in ("é" * (MAX_REQUEST_ID_BYTES // 2 + 1), "x" * (MAX_REQUEST_ID_BYTES + 1)):
        with pytest.raises(RequestRejected) as caught:
            build(BASE_REQUEST, request_id=too_long)
        assert caught.value.field == "request_id"
        assert str(MAX_REQUEST_ID_BYTES) in caught.value.reason


def test_a_dp_rank_is_not_targeted_for_several_outputs() -> None:
    """TensorRT-LLM refuses ``openengine-target-dp-rank`` with ``n > 1`` (INVALID_ARGUMENT); Dynamo's KV router stamps a
    rank on every request, so the hint is dropped rather than failing the request."""
    dp2 = caps(engine_name="tensorrt_llm", data_parallel_size=2, dp_rank_targeting=True, max_num_sequences=4)
    one = build(merge(BASE_REQUEST, {"routing": {"dp_rank": 1}}), capabilities=dp2)
    assert dict(one.metadata)["openengine-target-dp-rank"] == "1"
    body = merge(BASE_REQUEST, {"routing": {"dp_rank": 1}, "sampling_options": {"n": 2, "temperature": 1.0}})
    several = build(body, capabilities=dp2)
    assert several.n == 2
    assert "openengine-target-dp-rank" not in dict(several.metadata)
