"""``extra.detokenize = false`` (issue 14 item 8): sent when the engine is known to accept it, never when the sidecar
needs the engine's token text; the response side maps token ids, never text, so the output is the same either way."""

from __future__ import annotations

from typing import Any

import pytest

from openengine.v1 import generation_pb2
from openengine_bp.openengine.v1 import CandidateTokenSelectionMode
from sidecar.convert.capabilities import LogprobSupport
from sidecar.convert.structjson import pb_struct_to_json
from sidecar.startup import engine_detokenizes

from .factories import BASE_REQUEST, build, caps, finished, merge, token, usage

PROMPT_LP = caps(
    prompt_logprobs=LogprobSupport(supported=True, max_top_n=5, modes=frozenset({CandidateTokenSelectionMode.TOP_N}))
)


def extra(request: dict[str, Any], detokenize: bool, **kwargs: Any) -> dict[str, Any]:
    call = build(request, engine_detokenize=detokenize, **kwargs)
    return pb_struct_to_json(call.request.extra) if call.request.HasField("extra") else {}


def test_an_engine_that_detokenizes_is_sent_nothing() -> None:
    assert extra(BASE_REQUEST, True) == {}


def test_otherwise_the_engine_is_asked_not_to_detokenize_with_a_bool() -> None:
    call = build(BASE_REQUEST, engine_detokenize=False)
    value = call.request.extra.fields["detokenize"]
    assert value.WhichOneof("kind") == "bool_value", "TensorRT-LLM refuses the string 'false' (INVALID_ARGUMENT)"
    assert value.bool_value is False


@pytest.mark.parametrize(
    ("patch", "capabilities"),
    [
        ({"output_options": {"logprobs": 2}}, None),
        ({"output_options": {"prompt_logprobs": 1}}, PROMPT_LP),
        ({"annotations": ['openengine-extra:{"detokenize": true}']}, None),
        ({"stop_conditions": {"stop": ["river"]}}, None),
    ],
    ids=["top logprobs", "prompt logprobs", "the request's own extra", "stop strings"],
)
def test_a_request_that_needs_the_engine_text_keeps_it(patch: dict[str, Any], capabilities: Any) -> None:
    kwargs = {"capabilities": capabilities} if capabilities is not None else {}
    assert extra(merge(BASE_REQUEST, patch), False, **kwargs).get("detokenize", True) is True


def test_selected_token_logprobs_alone_need_no_engine_text() -> None:
    assert extra(merge(BASE_REQUEST, {"output_options": {"logprobs": 0}}), False) == {"detokenize": False}


def test_a_prefill_leg_keeps_its_phase_next_to_the_switch() -> None:
    body = merge(BASE_REQUEST, {"stop_conditions": {"max_tokens": 1}})
    assert extra(body, False, role="prefill") == {"detokenize": False, "request_type": "context_only"}


@pytest.mark.parametrize(
    ("mode", "engine", "detokenizes"),
    [
        ("auto", "tensorrt_llm", False),
        ("auto", "openengine-mock", True),
        ("auto", "", True),
        ("on", "tensorrt_llm", True),
        ("off", "openengine-mock", False),
    ],
)
def test_engine_detokenize_modes(mode: str, engine: str, detokenizes: bool) -> None:
    assert engine_detokenizes(mode, engine) is detokenizes


def test_the_output_is_the_same_whether_the_engine_detokenizes_or_not() -> None:
    """The engine's text (empty with detokenize=false) never reaches a chunk: the frontend detokenizes the ids."""
    outputs = []
    for text in ("Hello", ""):
        call = build(BASE_REQUEST, engine_detokenize=not text)
        mapper = call.response_mapper()
        event = token(0, 5, 6)
        event.token.text = text
        chunks = mapper.map([event, finished(0, generation_pb2.FINISH_REASON_LENGTH, with_usage=usage(3, 2))])
        outputs.append(chunks)
    assert outputs[0] == outputs[1]


def test_the_flag_does_not_claim_a_saving_for_tensorrt_llms_merged_server() -> None:
    """Issue 27 item 6: TensorRT-LLM's merged OpenEngine server never reads ``extra.detokenize``. The switch is kept
    (newer revisions and other engines honour it), but the flag's help -- and the operator guide generated from it --
    must say that TensorRT-LLM's merged server detokenizes anyway."""
    from sidecar.cli import build_parser

    [action] = [a for a in build_parser()._actions if "--engine-detokenize" in a.option_strings]
    assert action.help is not None
    assert "merged OpenEngine server ignores it" in action.help
