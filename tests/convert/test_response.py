"""GenerateResponse batches → LLMEngineOutput chunks: every event kind, every violation."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openengine.v1 import error_pb2, generation_pb2, kv_pb2
from sidecar.convert import ResponseMapper
from sidecar.convert.response import LOGPROB_FLOOR
from sidecar.errors import DynamoErrorKind, EngineErrorCode, EngineFailure, ProtocolViolation, Violation

from .factories import REQUEST_ID, error, finished, token, usage

STOP = generation_pb2.FINISH_REASON_STOP
LENGTH = generation_pb2.FINISH_REASON_LENGTH
CANCELLED = generation_pb2.FINISH_REASON_CANCELLED
R = generation_pb2.GenerateResponse
StopMatch = generation_pb2.StopMatch


def mapper(n: int = 1, logprobs: int | None = None, prompt_tokens: int = 3) -> ResponseMapper:
    return ResponseMapper(REQUEST_ID, n=n, logprobs=logprobs, prompt_tokens=prompt_tokens)


def final_usage(prompt: int = 3, completion: int = 1, **details: Any) -> dict[str, Any]:
    result: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    result.update(details)
    return result


def candidate(token_id: int, logprob: float, token_text: str = "", rank: int | None = None) -> generation_pb2.LogProb:
    result = generation_pb2.LogProb(token_id=token_id, logprob=logprob, token=token_text)
    if rank is not None:
        result.rank = rank
    return result


def info(token_id: int, logprob: float | None = None, rank: int | None = None, **fields: Any) -> Any:
    result = generation_pb2.TokenInfo(token_id=token_id, **fields)
    if logprob is not None:
        result.logprob = logprob
    if rank is not None:
        result.rank = rank
    return result


def token_event(index: int, *infos: generation_pb2.TokenInfo, text: str = "") -> generation_pb2.GenerateResponse:
    return R(request_id=REQUEST_ID, token=generation_pb2.TokenOutput(output_index=index, tokens=infos, text=text))


# ---------------------------------------------------------------------------------------- mapping

# (id, mapper kwargs, batches, chunks expected from each batch)
MAPPING: list[tuple[str, dict[str, Any], list[list[Any]], list[list[dict[str, Any]]]]] = [
    (
        "token then stop on a stop token",
        {},
        [[token(0, 5)], [finished(0, STOP, stop_match=StopMatch(stop_token_id=7), with_usage=usage(3, 1))]],
        [
            [{"token_ids": [5], "index": 0}],
            [
                {
                    "token_ids": [],
                    "index": 0,
                    "finish_reason": "stop",
                    "stop_reason": 7,
                    "completion_usage": final_usage(3, 1),
                }
            ],
        ],
    ),
    (
        "stop token id 0 is a stop reason",
        {},
        [[finished(0, STOP, stop_match=StopMatch(stop_token_id=0), with_usage=usage(3, 0))]],
        [
            [
                {
                    "token_ids": [],
                    "index": 0,
                    "finish_reason": "stop",
                    "stop_reason": 0,
                    "completion_usage": final_usage(3, 0),
                }
            ]
        ],
    ),
    (
        "stop string",
        {},
        [[token(0, 5, 6), finished(0, STOP, stop_match=StopMatch(stop_text="END"), with_usage=usage(3, 2))]],
        [
            [
                {
                    "token_ids": [5, 6],
                    "index": 0,
                    "finish_reason": "stop",
                    "stop_reason": "END",
                    "completion_usage": final_usage(3, 2),
                }
            ]
        ],
    ),
    (
        "eos",
        {},
        [[token(0, 2), finished(0, STOP, stop_match=StopMatch(eos_token_id=2), with_usage=usage(3, 1))]],
        [
            [
                {
                    "token_ids": [2],
                    "index": 0,
                    "finish_reason": "stop",
                    "stop_reason": 2,
                    "completion_usage": final_usage(),
                }
            ]
        ],
    ),
    (
        "stop without a match",
        {},
        [[finished(0, STOP, with_usage=usage(3, 0))]],
        [[{"token_ids": [], "index": 0, "finish_reason": "stop", "completion_usage": final_usage(3, 0)}]],
    ),
    (
        "length ignores a stop match",
        {},
        [[token(0, 1), finished(0, LENGTH, stop_match=StopMatch(stop_text="x"), with_usage=usage(3, 1))]],
        [[{"token_ids": [1], "index": 0, "finish_reason": "length", "completion_usage": final_usage()}]],
    ),
    (
        "cancelled by the engine",
        {},
        [[finished(0, CANCELLED, message="aborted", with_usage=usage(3, 0))]],
        [[{"token_ids": [], "index": 0, "finish_reason": "cancelled", "completion_usage": final_usage(3, 0)}]],
    ),
    (
        "consecutive tokens coalesce, finish joins them",
        {},
        [[token(0, 1), token(0, 2, 3), finished(0, LENGTH, with_usage=usage(3, 3))]],
        [[{"token_ids": [1, 2, 3], "index": 0, "finish_reason": "length", "completion_usage": final_usage(3, 3)}]],
    ),
    (
        "batches are not coalesced across calls",
        {},
        [[token(0, 1)], [token(0, 2)], [finished(0, LENGTH, with_usage=usage(3, 2))]],
        [
            [{"token_ids": [1], "index": 0}],
            [{"token_ids": [2], "index": 0}],
            [{"token_ids": [], "index": 0, "finish_reason": "length", "completion_usage": final_usage(3, 2)}],
        ],
    ),
    (
        "text-only delta gives no chunk",
        {},
        [[token_event(0, text="held back text")], []],
        [[], []],
    ),
    (
        "n=2 interleaved: a finish joins its output's last chunk; usage on the last terminal only",
        {"n": 2},
        [
            [token(0, 1), token(1, 2), token(0, 3), finished(1, STOP, stop_match=StopMatch(eos_token_id=9))],
            [token(0, 4), finished(0, LENGTH, with_usage=usage(3, 4))],
        ],
        [
            [
                {"token_ids": [1], "index": 0},
                {"token_ids": [3], "index": 0},
                {"token_ids": [2], "index": 1, "finish_reason": "stop", "stop_reason": 9},
            ],
            [{"token_ids": [4], "index": 0, "finish_reason": "length", "completion_usage": final_usage(3, 4)}],
        ],
    ),
    (
        "n=2, an output may finish before the other starts",
        {"n": 2},
        [[finished(1, LENGTH)], [token(0, 8), finished(0, STOP, with_usage=usage(3, 1))]],
        [
            [{"token_ids": [], "index": 1, "finish_reason": "length"}],
            [{"token_ids": [8], "index": 0, "finish_reason": "stop", "completion_usage": final_usage()}],
        ],
    ),
    (
        "usage details",
        {},
        [[finished(0, LENGTH, with_usage=usage(10, 5, cached_prompt_tokens=4, reasoning_tokens=2))]],
        [
            [
                {
                    "token_ids": [],
                    "index": 0,
                    "finish_reason": "length",
                    "completion_usage": final_usage(
                        10,
                        5,
                        prompt_tokens_details={"cached_tokens": 4},
                        completion_tokens_details={"reasoning_tokens": 2},
                    ),
                }
            ]
        ],
    ),
    (
        "explicit zero cached tokens kept",
        {},
        [[finished(0, LENGTH, with_usage=usage(10, 5, cached_prompt_tokens=0))]],
        [
            [
                {
                    "token_ids": [],
                    "index": 0,
                    "finish_reason": "length",
                    "completion_usage": final_usage(10, 5, prompt_tokens_details={"cached_tokens": 0}),
                }
            ]
        ],
    ),
    (
        "details clamped to their totals",
        {},
        [[finished(0, LENGTH, with_usage=usage(10, 5, cached_prompt_tokens=40, reasoning_tokens=9))]],
        [
            [
                {
                    "token_ids": [],
                    "index": 0,
                    "finish_reason": "length",
                    "completion_usage": final_usage(
                        10,
                        5,
                        prompt_tokens_details={"cached_tokens": 10},
                        completion_tokens_details={"reasoning_tokens": 5},
                    ),
                }
            ]
        ],
    ),
    (
        "zero usage counts replaced by what was seen",
        {"prompt_tokens": 7},
        [[token(0, 1, 2), finished(0, LENGTH, with_usage=generation_pb2.Usage())]],
        [[{"token_ids": [1, 2], "index": 0, "finish_reason": "length", "completion_usage": final_usage(7, 2)}]],
    ),
    (
        "engine totals win over local counts",
        {"prompt_tokens": 7},
        [[token(0, 1), finished(0, LENGTH, with_usage=usage(9, 4))]],
        [[{"token_ids": [1], "index": 0, "finish_reason": "length", "completion_usage": final_usage(9, 4)}]],
    ),
    (
        "logprobs with candidates",
        {"logprobs": 2},
        [
            [
                token_event(
                    0,
                    info(
                        5, -0.1, rank=1, token="a", candidates=[candidate(5, -0.1, "a", 1), candidate(6, -2.5, "b", 2)]
                    ),
                    info(7, -0.3, candidates=[candidate(8, -0.2, "", None), candidate(7, -0.3, "c", None)]),
                )
            ]
        ],
        [
            [
                {
                    "token_ids": [5, 7],
                    "index": 0,
                    "log_probs": [-0.1, -0.3],
                    "top_logprobs": [
                        [
                            {"rank": 1, "token_id": 5, "token": "a", "logprob": -0.1},
                            {"rank": 2, "token_id": 6, "token": "b", "logprob": -2.5},
                        ],
                        # No rank on the wire: the position in the (rank-sorted) list; empty text: None.
                        [
                            {"rank": 1, "token_id": 8, "token": None, "logprob": -0.2},
                            {"rank": 2, "token_id": 7, "token": "c", "logprob": -0.3},
                        ],
                    ],
                }
            ]
        ],
    ),
    (
        "logprobs 0: selected logprob, no alternatives",
        {"logprobs": 0},
        [[token_event(0, info(5, -0.1, candidates=[candidate(9, -0.05, "z", 1)]))]],
        [[{"token_ids": [5], "index": 0, "log_probs": [-0.1], "top_logprobs": [[]]}]],
    ),
    (
        "missing and non-finite logprobs become the floor",
        {"logprobs": 1},
        [
            [
                token_event(
                    0,
                    info(1),
                    info(2, -math.inf),
                    info(3, math.nan, candidates=[candidate(3, -math.inf, "x", 1), candidate(4, math.inf, "y", 2)]),
                    info(4, 0.0),
                    info(5, math.inf),
                )
            ]
        ],
        [
            [
                {
                    "token_ids": [1, 2, 3, 4, 5],
                    "index": 0,
                    "log_probs": [LOGPROB_FLOOR, LOGPROB_FLOOR, LOGPROB_FLOOR, 0.0, LOGPROB_FLOOR],
                    "top_logprobs": [
                        [],
                        [],
                        [
                            {"rank": 1, "token_id": 3, "token": "x", "logprob": LOGPROB_FLOOR},
                            {"rank": 2, "token_id": 4, "token": "y", "logprob": LOGPROB_FLOOR},
                        ],
                        [],
                        [],
                    ],
                }
            ]
        ],
    ),
    (
        "coalesced logprobs stay aligned",
        {"logprobs": 1},
        [[token_event(0, info(1, -1.0)), token_event(0, info(2, -2.0)), finished(0, STOP, with_usage=usage(3, 2))]],
        [
            [
                {
                    "token_ids": [1, 2],
                    "index": 0,
                    "log_probs": [-1.0, -2.0],
                    "top_logprobs": [[], []],
                    "finish_reason": "stop",
                    "completion_usage": final_usage(3, 2),
                }
            ]
        ],
    ),
    ("empty batch", {}, [[]], [[]]),
]


@pytest.mark.parametrize(("case", "kwargs", "batches", "expected"), MAPPING, ids=[c[0] for c in MAPPING])
def test_mapping(
    case: str, kwargs: dict[str, Any], batches: list[list[Any]], expected: list[list[dict[str, Any]]]
) -> None:
    m = mapper(**kwargs)
    for batch, chunks in zip(batches, expected, strict=True):
        assert m.map(batch) == chunks
    for chunks in expected:
        for chunk in chunks:
            assert "text" not in chunk
    finished_all = any("completion_usage" in chunk for chunks in expected for chunk in chunks)
    assert m.done is finished_all
    if finished_all:
        m.end_of_stream()  # a complete stream ends cleanly


def test_completion_tokens_counter() -> None:
    m = mapper(n=2)
    m.map([token(0, 1, 2), token(1, 3)])
    assert m.completion_tokens == 3


def test_n_must_be_positive() -> None:
    with pytest.raises(ValueError, match="n must be"):
        mapper(n=0)


# -------------------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    ("code", "expected", "retryable", "kind"),
    [
        (error_pb2.ERROR_CODE_INTERNAL, EngineErrorCode.INTERNAL, False, DynamoErrorKind.UNKNOWN),
        (
            error_pb2.ERROR_CODE_INVALID_ARGUMENT,
            EngineErrorCode.INVALID_ARGUMENT,
            False,
            DynamoErrorKind.INVALID_ARGUMENT,
        ),
        (error_pb2.ERROR_CODE_OVERLOADED, EngineErrorCode.OVERLOADED, True, DynamoErrorKind.DISCONNECTED),
        (99, EngineErrorCode.UNSPECIFIED, False, DynamoErrorKind.UNKNOWN),
    ],
)
def test_error_event(code: int, expected: EngineErrorCode, retryable: bool, kind: DynamoErrorKind) -> None:
    m = mapper()
    assert m.map([token(0, 1)]) == [{"token_ids": [1], "index": 0}]
    failing = error(code, "it broke", retryable)
    failing.usage.CopyFrom(usage(3, 1))  # TensorRT-LLM attaches usage to the error; it is not needed
    with pytest.raises(EngineFailure) as info_:
        m.map([failing])  # an error with nothing before it in its batch is raised at once
    assert info_.value.code is expected
    assert info_.value.retryable is retryable
    assert info_.value.kind is kind
    assert "it broke" in str(info_.value)
    assert m.done
    assert m.failure is None
    m.end_of_stream()  # the error was the terminal: no EOF violation on top
    with pytest.raises(ProtocolViolation) as after:
        m.map([token(0, 3)])
    assert after.value.violation is Violation.EVENT_AFTER_TERMINAL


@pytest.mark.parametrize("carried", [False, True], ids=["same batch", "carried from the previous batch"])
def test_tokens_before_an_error_are_returned_and_the_error_kept_pending(carried: bool) -> None:
    """Issue 14 item 2: the tokens the engine sent before its terminal error are the client's; before the fix the
    mapper raised at once and dropped them (6 of 10 streaming clients saw no text)."""
    m = mapper()
    failing = error(error_pb2.ERROR_CODE_INTERNAL, "it broke", False)
    if carried:
        held = m.map([token(0, 1, 2, 3, 4)])
        chunks = m.map([failing], carry=held)
    else:
        chunks = m.map([token(0, 1, 2), token(0, 3, 4), failing])
    assert chunks == [{"token_ids": [1, 2, 3, 4], "index": 0}]
    assert m.done
    assert m.failure is not None
    assert m.failure.code is EngineErrorCode.INTERNAL
    with pytest.raises(EngineFailure):
        m.end_of_stream()
    with pytest.raises(EngineFailure):
        m.map([token(0, 5)])


# -------------------------------------------------------------------------------- the terminal hold


def holding_mapper(**kw: Any) -> ResponseMapper:
    return ResponseMapper(REQUEST_ID, n=kw.pop("n", 1), logprobs=None, prompt_tokens=3, **kw)


@pytest.mark.parametrize(
    ("kw", "batch", "awaits"),
    [
        ({"terminal_ids": {2}}, [token(0, 5, 2)], True),
        ({"terminal_ids": {2}}, [token(0, 2, 5)], False),
        ({"terminal_ids": {2}, "min_tokens": 3}, [token(0, 5, 2)], False),
        ({"terminal_ids": {2}, "min_tokens": 2}, [token(0, 5, 2)], True),
        ({"max_tokens": 2}, [token(0, 5, 6)], True),
        ({"max_tokens": 3}, [token(0, 5, 6)], False),
        ({}, [token(0, 5, 2)], False),
        ({"terminal_ids": {2}, "n": 2}, [token(0, 2), token(1, 7)], True),
        ({"terminal_ids": {2}, "n": 2}, [token(0, 2), token(0, 8), token(1, 7)], False),
    ],
)
def test_awaits_terminal_names_the_chunks_whose_finish_is_due(kw: dict[str, Any], batch: list[R], awaits: bool) -> None:
    m = holding_mapper(**kw)
    assert m.awaits_terminal(m.map(batch)) is awaits


def test_a_held_chunk_and_the_next_batchs_finish_become_one_chunk() -> None:
    """Issue 14 item 1: the EOS token and the finish that follows in the next message reach the frontend together."""
    m = holding_mapper(terminal_ids={2})
    held = m.map([token(0, 5, 2)])
    assert m.awaits_terminal(held)
    chunks = m.map([finished(0, STOP, stop_match=StopMatch(eos_token_id=2), with_usage=usage(3, 2))], carry=held)
    assert chunks == [
        {
            "token_ids": [5, 2],
            "index": 0,
            "finish_reason": "stop",
            "stop_reason": 2,
            "completion_usage": final_usage(3, 2),
        }
    ]
    assert m.done


def text_event(index: int, token_id: int, text: str) -> R:
    event = token(index, token_id)
    event.token.text = text
    return event


def test_with_stop_strings_a_token_whose_text_the_engine_holds_back_awaits_the_next_event() -> None:
    """The engine holds back text that may begin a stop string and cuts the stop string when it completes: a token
    event with tokens and no text may be the last one (only once the engine has shown it sends text)."""
    m = holding_mapper(stop_texts=True)
    assert m.awaits_terminal(m.map([token(0, 4)])), "the output's first token may complete a stop string"
    assert not m.awaits_terminal(m.map([token(0, 5)])), "no text seen yet: the engine may not detokenize"
    assert not m.awaits_terminal(m.map([text_event(0, 6, "The")]))
    held = m.map([text_event(0, 7, "")])
    assert m.awaits_terminal(held)
    chunks = m.map([finished(0, STOP, stop_match=StopMatch(stop_text=" the"), with_usage=usage(3, 3))], carry=held)
    assert chunks[0]["token_ids"] == [7]
    assert chunks[0]["finish_reason"] == "stop"
    assert "completion_usage" in chunks[0]


def test_a_stop_string_completed_by_the_first_token_of_an_output_joins_its_finish() -> None:
    """Found by ``bench.chaos``: a stream migrated after 7 tokens continued with one token that completed the stop
    string. Failed before (no text seen yet, so no hold): the frontend ended the stream at the stop string and the
    sidecar counted the complete answer as cancelled, with an Abort."""
    m = holding_mapper(stop_texts=True, n=2)
    held = m.map([token(0, 7)])
    assert m.awaits_terminal(held)
    chunks = m.map([finished(0, STOP, stop_match=StopMatch(stop_text=" the"))], carry=held)
    assert chunks == [{"token_ids": [7], "index": 0, "finish_reason": "stop", "stop_reason": " the"}]
    assert m.awaits_terminal(m.map([token(1, 8)])), "each output's first token"


@pytest.mark.parametrize(
    ("texts", "stopped_at"),
    [
        ([" The", " the"], 1),  # inside a token: " th" in " the"
        ([" a", " t", "his"], 2),  # across tokens: " t" + "h"
        ([" The", " ri", "ver"], None),  # never
        ([" th"], 0),  # exactly a token
    ],
    ids=["inside a token", "across tokens", "no match", "a whole token"],
)
def test_the_frontends_stop_string_match_on_the_engines_text_ends_the_output(
    texts: list[str], stopped_at: int | None
) -> None:
    """Issue 27 item 4(c): the frontend ends the answer at the token whose text completes a stop string, inside a
    token too; an engine matching stop strings as token sequences goes on. The mapper sees the same match in the
    engine's text: that chunk awaits the terminal, what follows is dropped, and the terminal -- whatever the engine's
    reason -- closes the output with ``stop``, the stop string and the client's token count."""
    m = holding_mapper(stop_strings=(" th",))
    held: list[dict[str, Any]] = []
    for i, text in enumerate(texts):
        chunks = m.map([text_event(0, 10 + i, text)], carry=held)
        held = chunks if m.awaits_terminal(chunks) else []
        assert m.ends_at_stop_string == (stopped_at is not None and i >= stopped_at)
    if stopped_at is None:
        return
    assert m.stop_string == " th"
    assert m.map([text_event(0, 99, " river")], carry=held) == held, "past the stop: dropped"
    engine_usage = usage(3, len(texts) + 1, cached_prompt_tokens=2)
    [final] = m.map([finished(0, generation_pb2.FINISH_REASON_CANCELLED, with_usage=engine_usage)], carry=held)
    assert final["token_ids"][-1] == 10 + stopped_at
    assert (final["finish_reason"], final["stop_reason"]) == ("stop", " th")
    assert final["completion_usage"]["completion_tokens"] == stopped_at + 1
    assert final["completion_usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_without_stop_strings_text_does_not_matter() -> None:
    m = holding_mapper()
    m.map([text_event(0, 6, "The")])
    assert not m.awaits_terminal(m.map([text_event(0, 7, "")]))


def test_a_held_chunk_followed_by_more_tokens_merges_with_them() -> None:
    m = holding_mapper(terminal_ids={2})
    held = m.map([token(0, 5, 2)])
    chunks = m.map([token(0, 6)], carry=held)
    assert chunks == [{"token_ids": [5, 2, 6], "index": 0}]
    assert not m.awaits_terminal(chunks)


# ------------------------------------------------------------------------- a stop token kept in the output


def test_a_kept_stop_token_is_taken_out_of_the_output_and_the_count() -> None:
    """Issue 27 item 4(a): with ``include_stop_in_output`` TensorRT-LLM streams and counts the stop token id, and
    Dynamo's frontend never shows a ``stop_token_ids`` token (it counts every id it is sent): the client saw 2 words
    and was billed 3. The token leaves the output's last chunk, its logprob entries and the completion count."""
    m = ResponseMapper(REQUEST_ID, n=1, logprobs=1, prompt_tokens=3, terminal_ids={7}, hidden_stop_ids={7})
    held = m.map([token(0, 5, 7, logprob=-0.5)])
    assert m.awaits_terminal(held), "the stop token waits for its finish"
    chunks = m.map([finished(0, STOP, stop_match=StopMatch(stop_token_id=7), with_usage=usage(3, 2))], carry=held)
    assert chunks == [
        {
            "token_ids": [5],
            "index": 0,
            "log_probs": [-0.5],
            "top_logprobs": [[]],
            "finish_reason": "stop",
            "stop_reason": 7,
            "completion_usage": final_usage(3, 1),
        }
    ]
    assert m.completion_tokens == 1


@pytest.mark.parametrize(
    ("hidden", "stop_match", "expected_ids", "completion"),
    [
        (set(), StopMatch(stop_token_id=7), [5, 7], 2),  # not kept on request: the engine's output as it is
        ({7}, StopMatch(stop_text="x"), [5, 7], 2),  # a stop string ended it: the frontend shows stop strings
        ({7}, StopMatch(eos_token_id=7), [5, 7], 2),  # EOS is not a stop token id
        ({8}, StopMatch(stop_token_id=8), [5, 7], 2),  # the output does not end with the matched id
    ],
)
def test_only_the_kept_stop_token_that_ended_the_output_is_taken_out(
    hidden: set[int], stop_match: Any, expected_ids: list[int], completion: int
) -> None:
    m = ResponseMapper(REQUEST_ID, n=1, logprobs=None, prompt_tokens=3, hidden_stop_ids=hidden)
    chunks = m.map([token(0, 5, 7), finished(0, STOP, stop_match=stop_match, with_usage=usage(3, 2))])
    assert chunks[0]["token_ids"] == expected_ids
    assert chunks[0]["completion_usage"]["completion_tokens"] == completion


def test_a_stop_token_already_sent_stays_counted() -> None:
    """The hold is bounded: a stop token whose chunk went out before its finish reached the client; usage counts it."""
    m = ResponseMapper(REQUEST_ID, n=1, logprobs=None, prompt_tokens=3, terminal_ids={7}, hidden_stop_ids={7})
    assert m.map([token(0, 5, 7)]) == [{"token_ids": [5, 7], "index": 0}]
    chunks = m.map([finished(0, STOP, stop_match=StopMatch(stop_token_id=7), with_usage=usage(3, 2))])
    assert chunks == [
        {"token_ids": [], "index": 0, "finish_reason": "stop", "stop_reason": 7, "completion_usage": final_usage(3, 2)}
    ]


def _prompt_event() -> Any:
    return R(request_id=REQUEST_ID, prompt=generation_pb2.PromptOutput(tokens=[generation_pb2.TokenInfo(token_id=1)]))


def _prefill_ready() -> Any:
    return R(
        request_id=REQUEST_ID,
        prefill_ready=generation_pb2.PrefillReady(kv_session=kv_pb2.KvSessionRef(session_id="1")),
        usage=usage(3, 0),
    )


def _usage_only() -> Any:
    return R(request_id=REQUEST_ID, usage=usage())


def _token_with_usage() -> Any:
    response = token(0, 1)
    response.usage.CopyFrom(usage())
    return response


# (id, mapper kwargs, batches; the last response of the last batch breaks the contract, expected violation)
VIOLATIONS: list[tuple[str, dict[str, Any], list[list[Any]], Violation]] = [
    ("wrong request id on a token", {}, [[token(0, 1, request_id="other")]], Violation.WRONG_REQUEST_ID),
    (
        "wrong request id on a finish",
        {},
        [[finished(0, with_usage=usage(), request_id="")]],
        Violation.WRONG_REQUEST_ID,
    ),
    (
        "token after its output finished",
        {"n": 2},
        [[finished(0, LENGTH)], [token(0, 1)]],
        Violation.EVENT_AFTER_TERMINAL,
    ),
    (
        "token after the stream ended",
        {},
        [[token(0, 1), finished(0, LENGTH, with_usage=usage()), token(0, 2)]],
        Violation.EVENT_AFTER_TERMINAL,
    ),
    (
        "finish after the stream ended",
        {},
        [[finished(0, LENGTH, with_usage=usage())], [finished(0, LENGTH, with_usage=usage())]],
        Violation.EVENT_AFTER_TERMINAL,
    ),
    ("token without output_index", {}, [[token(None, 1)]], Violation.MISSING_OUTPUT_INDEX),
    ("finish without output_index", {}, [[finished(None, with_usage=usage())]], Violation.MISSING_OUTPUT_INDEX),
    ("token index out of range", {}, [[token(1, 1)]], Violation.OUTPUT_INDEX_OUT_OF_RANGE),
    ("finish index out of range", {"n": 2}, [[finished(5, with_usage=usage())]], Violation.OUTPUT_INDEX_OUT_OF_RANGE),
    ("duplicate finish", {"n": 2}, [[finished(0, LENGTH)], [finished(0, LENGTH)]], Violation.DUPLICATE_FINISH),
    ("usage on a token", {}, [[_token_with_usage()]], Violation.USAGE_BEFORE_END),
    ("usage before the last finish", {"n": 2}, [[finished(1, LENGTH, with_usage=usage())]], Violation.USAGE_BEFORE_END),
    ("final finish without usage", {}, [[token(0, 1), finished(0, LENGTH)]], Violation.MISSING_USAGE),
    ("final of two without usage", {"n": 2}, [[finished(0, STOP)], [finished(1, STOP)]], Violation.MISSING_USAGE),
    ("unspecified finish reason", {}, [[finished(0, 0, with_usage=usage())]], Violation.UNSPECIFIED_FINISH_REASON),
    ("unknown finish reason", {}, [[finished(0, 99, with_usage=usage())]], Violation.UNSPECIFIED_FINISH_REASON),
    ("no event", {}, [[R(request_id=REQUEST_ID)]], Violation.EMPTY_EVENT),
    ("usage but no event", {}, [[_usage_only()]], Violation.EMPTY_EVENT),
    ("prompt event not asked for", {}, [[_prompt_event()]], Violation.UNEXPECTED_EVENT),
    ("prefill_ready on an aggregated request", {}, [[token(0, 1)], [_prefill_ready()]], Violation.UNEXPECTED_EVENT),
]


@pytest.mark.parametrize(("case", "kwargs", "batches", "violation"), VIOLATIONS, ids=[c[0] for c in VIOLATIONS])
def test_violation(case: str, kwargs: dict[str, Any], batches: list[list[Any]], violation: Violation) -> None:
    m = mapper(**kwargs)
    for batch in batches[:-1]:
        m.map(batch)
    with pytest.raises(ProtocolViolation) as info_:
        m.map(batches[-1])
    assert info_.value.violation is violation
    assert info_.value.kind is DynamoErrorKind.UNKNOWN
    assert not info_.value.migratable
    # The mapper is closed: the stream is over for good.
    assert m.done
    m.end_of_stream()
    with pytest.raises(ProtocolViolation) as again:
        m.map([token(0, 1)])
    assert again.value.violation is Violation.EVENT_AFTER_TERMINAL


@pytest.mark.parametrize(
    ("kwargs", "batches"),
    [
        ({}, []),
        ({}, [[token(0, 1, 2)]]),
        ({"n": 2}, [[token(0, 1), finished(0, LENGTH)]]),
    ],
    ids=["nothing", "tokens only", "one of two finished"],
)
def test_eof_before_terminal(kwargs: dict[str, Any], batches: list[list[Any]]) -> None:
    m = mapper(**kwargs)
    for batch in batches:
        m.map(batch)
    assert not m.done
    with pytest.raises(ProtocolViolation) as info_:
        m.end_of_stream()
    assert info_.value.violation is Violation.EOF_BEFORE_TERMINAL
    assert m.done


# ------------------------------------------------------------------------------------ cancellation


def test_cancelled_chunk_has_partial_usage() -> None:
    m = mapper(n=2, prompt_tokens=5)
    m.map([token(0, 1, 2), token(1, 3), finished(0, LENGTH)])
    chunk = m.cancelled_chunk()
    assert chunk == {
        "token_ids": [],
        "index": 1,
        "finish_reason": "cancelled",
        "completion_usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }
    assert m.done
    m.end_of_stream()
    with pytest.raises(ProtocolViolation) as info_:
        m.map([token(1, 4)])
    assert info_.value.violation is Violation.EVENT_AFTER_TERMINAL
    with pytest.raises(RuntimeError):
        m.cancelled_chunk()


def test_cancelled_before_any_token() -> None:
    chunk = mapper(prompt_tokens=4).cancelled_chunk()
    assert chunk["completion_usage"] == {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}
    assert chunk["index"] == 0


def test_cancelled_chunk_after_completion_is_a_caller_bug() -> None:
    m = mapper()
    m.map([finished(0, STOP, with_usage=usage())])
    with pytest.raises(RuntimeError):
        m.cancelled_chunk()


# -------------------------------------------------------------------------------------------- fuzz

_indexes = st.none() | st.integers(min_value=0, max_value=3)


@st.composite
def _responses(draw: st.DrawFn) -> Any:
    kind = draw(
        st.sampled_from(["token", "token", "token", "finished", "finished", "error", "prompt", "none", "ready"])
    )
    response = R(request_id=draw(st.sampled_from([REQUEST_ID] * 15 + ["other"])))
    if kind == "token":
        output = response.token
        output.SetInParent()
        index = draw(_indexes)
        if index is not None:
            output.output_index = index
        for token_id in draw(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=3)):
            token_info = output.tokens.add(token_id=token_id)
            logprob = draw(st.none() | st.floats())
            if logprob is not None:
                token_info.logprob = logprob
            for rank in range(draw(st.integers(min_value=0, max_value=2))):
                token_info.candidates.add(token_id=rank, logprob=draw(st.floats()))
    elif kind == "finished":
        event = response.finished
        event.SetInParent()
        index = draw(_indexes)
        if index is not None:
            event.output_index = index
        event.reason = draw(st.sampled_from([0, 1, 1, 2, 2, 3, 99]))  # type: ignore[assignment]
        which = draw(st.sampled_from([None, "stop_token_id", "stop_text", "eos_token_id"]))
        if which == "stop_text":
            event.stop_match.stop_text = "s"
        elif which is not None:
            setattr(event.stop_match, which, 1)
    elif kind == "error":
        response.error.code = draw(st.integers(min_value=0, max_value=20))  # type: ignore[assignment]
        response.error.retryable = draw(st.booleans())
    elif kind == "prompt":
        response.prompt.SetInParent()
    elif kind == "ready":
        response.prefill_ready.SetInParent()
    if draw(st.integers(min_value=0, max_value=3)) == 0:
        response.usage.prompt_tokens = draw(st.integers(min_value=0, max_value=5))
        response.usage.completion_tokens = draw(st.integers(min_value=0, max_value=5))
    return response


@st.composite
def _streams(draw: st.DrawFn) -> tuple[int, list[list[Any]]]:
    """A valid stream for n outputs, then up to two mutations, cut into random batches."""
    n = draw(st.integers(min_value=1, max_value=3))
    pending = {index: draw(st.integers(min_value=0, max_value=3)) for index in range(n)}  # tokens left
    events: list[Any] = []
    total = 0
    while pending:
        index = draw(st.sampled_from(sorted(pending)))
        if pending[index]:
            pending[index] -= 1
            total += 1
            response = token(index, draw(st.integers(min_value=0, max_value=2**32 - 1)))
            if draw(st.booleans()):
                response.token.tokens[0].logprob = draw(st.floats())
                response.token.tokens[0].candidates.add(token_id=1, logprob=draw(st.floats()))
            events.append(response)
        else:
            del pending[index]
            reason = draw(st.sampled_from([STOP, LENGTH, CANCELLED]))
            events.append(finished(index, reason, with_usage=None if pending else usage(3, total)))
    for _ in range(draw(st.integers(min_value=0, max_value=2))):
        mutation = draw(st.sampled_from(["insert", "drop", "duplicate", "truncate"]))
        position = draw(st.integers(min_value=0, max_value=len(events)))
        if mutation == "insert":
            events.insert(position, draw(_responses()))
        elif events and mutation == "drop":
            del events[min(position, len(events) - 1)]
        elif events and mutation == "duplicate":
            events.insert(position, events[min(position, len(events) - 1)])
        elif mutation == "truncate":
            del events[position:]
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=len(events)), max_size=4)))
    batches = [events[a:b] for a, b in zip([0, *cuts], [*cuts, len(events)], strict=True)]
    return n, batches


@settings(max_examples=400, deadline=None)
@given(
    stream=_streams()
    | st.tuples(st.integers(min_value=1, max_value=3), st.lists(st.lists(_responses(), max_size=5), max_size=8)),
    logprobs=st.none() | st.integers(min_value=0, max_value=2),
)
def test_fuzz_response_mapper(stream: tuple[int, list[list[Any]]], logprobs: int | None) -> None:
    n, batches = stream
    m = mapper(n=n, logprobs=logprobs)
    chunks: list[dict[str, Any]] = []
    failed = False
    failure: Exception | None = None
    for batch in batches:
        try:
            chunks.extend(m.map(batch))
        except (ProtocolViolation, EngineFailure) as exc:
            failure = exc
        failure = failure or m.failure  # tokens before an error are returned, the error kept pending
        if failure is not None:
            failed = True
            assert m.done
            break
    if not failed:
        eof: ProtocolViolation | None = None
        try:
            m.end_of_stream()
        except ProtocolViolation as exc:
            eof = exc
        if eof is not None:
            assert eof.violation is Violation.EOF_BEFORE_TERMINAL
            failed = True
    finishes: dict[int, int] = {}
    for position, chunk in enumerate(chunks):
        assert isinstance(chunk["token_ids"], list)
        assert 0 <= chunk["index"] < n
        assert "text" not in chunk
        assert set(chunk) <= {
            "token_ids",
            "index",
            "log_probs",
            "top_logprobs",
            "finish_reason",
            "stop_reason",
            "completion_usage",
        }
        if "log_probs" in chunk:
            assert logprobs is not None
            assert len(chunk["log_probs"]) == len(chunk["top_logprobs"]) == len(chunk["token_ids"]) > 0
            assert all(math.isfinite(lp) for lp in chunk["log_probs"])
        else:
            assert logprobs is None or not chunk["token_ids"]
        if "finish_reason" in chunk:
            assert chunk["finish_reason"] in {"stop", "length", "cancelled"}
            finishes[chunk["index"]] = finishes.get(chunk["index"], 0) + 1
        if "completion_usage" in chunk:
            # Usage only on the very last chunk of a complete stream; an event after it is still a breach.
            assert position == len(chunks) - 1
            assert failure is None or getattr(failure, "violation", None) is Violation.EVENT_AFTER_TERMINAL
    assert all(count == 1 for count in finishes.values())
    if chunks and "completion_usage" in chunks[-1]:
        assert sorted(finishes) == list(range(n))
    if not failed:
        assert sorted(finishes) == list(range(n))
        assert "completion_usage" in chunks[-1]
