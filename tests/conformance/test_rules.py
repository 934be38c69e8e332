"""The stream rules (``sidecar.conformance.rules``): each breach fails exactly its own rule.

First on real streams: the mock's per-request ``extra.mock.violation`` faults, observed with the kit's own
``generate`` (the kit itself never sends them). Then on hand-built streams, for the breaches today's mock cannot
produce per request (cumulative deltas, usage on every finish) and for legal streams that must not be mistaken for
breaches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest
from grpclib.const import Status

from openengine.v1 import generation_pb2
from sidecar.conformance import Observation, Target, generate, rules
from tests.mock.conftest import MockProcess

JUDGES: dict[str, Callable[[Sequence[Observation]], rules.Finding]] = {
    name: getattr(rules, name) for name in rules.__all__ if name.startswith("judge_")
}


def _observe(address: str, request: generation_pb2.GenerateRequest) -> Observation:
    host, _, port = address.rpartition(":")
    target = Target(address, host=host, port=int(port))

    async def one() -> Observation:
        channel = target.channel()
        try:
            return await generate(channel, request, bound=20)
        finally:
            channel.close()

    return asyncio.run(one())


def _request(request_id: str, *, n: int = 1, violation: str | None = None) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(request_id=request_id, model="tiny-oe", prompt="The river")
    request.stopping.max_tokens = 6
    request.stopping.ignore_eos = True
    request.sampling.num_sequences = n
    request.sampling.temperature = 1.0
    request.sampling.seed = 11
    if violation is not None:
        request.extra.update({"mock": {"violation": violation}})
    return request


def _verdicts(streams: Sequence[Observation]) -> dict[str, bool | None]:
    return {name: judge(streams).ok for name, judge in JUDGES.items()}


@pytest.mark.parametrize("n", [1, 2])
def test_clean_mock_streams_pass_every_rule(default_mock: MockProcess, n: int) -> None:
    obs = _observe(default_mock.address, _request(f"clean-{n}", n=n))
    assert _verdicts([obs]) == dict.fromkeys(JUDGES, True)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(
    ("violation", "judge"),
    [
        ("wrong_request_id", "judge_request_id"),
        ("event_after_terminal", "judge_nothing_after_terminal"),
        ("missing_output_index", "judge_output_index"),
        ("usage_on_non_final", "judge_usage_last"),
        ("unspecified_finish", "judge_finish_reason"),
    ],
)
def test_each_mock_violation_fails_exactly_its_rule(
    default_mock: MockProcess, violation: str, judge: str, n: int
) -> None:
    obs = _observe(default_mock.address, _request(f"{violation}-{n}", n=n, violation=violation))
    verdicts = _verdicts([obs])
    assert verdicts.pop(judge) is False
    assert set(verdicts.values()) == {True}, verdicts


def test_a_stream_ended_before_its_terminal_event_fails_the_finish_rule(default_mock: MockProcess) -> None:
    obs = _observe(default_mock.address, _request("eof", violation="eof_before_terminal"))
    assert obs.status is Status.OK
    verdicts = _verdicts([obs])
    assert verdicts.pop("judge_one_finished") is False
    # Rules about the terminal event have nothing to judge: they point at the finish rule rather than fail too.
    assert {k for k, v in verdicts.items() if v is None} == {
        "judge_nothing_after_terminal",
        "judge_usage_last",
        "judge_finish_reason",
    }
    assert {v for v in verdicts.values() if v is not None} == {True}


# -- hand-built streams ------------------------------------------------------------------------------------------------


def _token(index: int | None, ids: Sequence[int], text: str) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(request_id="r")
    if index is not None:
        response.token.output_index = index
    response.token.tokens.extend(generation_pb2.TokenInfo(token_id=i) for i in ids)
    response.token.text = text
    return response


def _finished(index: int, *, usage: tuple[int, int] | None = None) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(request_id="r")
    response.finished.output_index = index
    response.finished.reason = generation_pb2.FINISH_REASON_LENGTH
    if usage is not None:
        prompt, completion = usage
        response.usage.prompt_tokens = prompt
        response.usage.completion_tokens = completion
        response.usage.total_tokens = prompt + completion
    return response


def _stream(*messages: generation_pb2.GenerateResponse, n: int = 1) -> Observation:
    return Observation(request_id="r", n=n, messages=list(messages), status=Status.OK)


def test_cumulative_deltas_fail_only_the_non_cumulative_rule() -> None:
    obs = _stream(
        _token(0, [5], "a"),
        _token(0, [5, 6], "ab"),
        _token(0, [5, 6, 7], "abc"),
        _token(0, [5, 6, 7, 8], "abcd"),
        _finished(0, usage=(3, 4)),
    )
    verdicts = _verdicts([obs])
    assert verdicts.pop("judge_non_cumulative") is False
    assert set(verdicts.values()) == {True}
    assert rules.assemble(obs) == ([5, 6, 7, 8], "abcd"), "the other rules read what was generated"


def test_more_tokens_streamed_than_generated_is_cumulative() -> None:
    obs = _stream(_token(0, [5], "a"), _token(0, [5, 6], "ab"), _finished(0, usage=(3, 2)))
    finding = rules.judge_non_cumulative([obs])
    assert finding.ok is False
    assert "3 tokens streamed but usage.completion_tokens = 2" in finding.evidence


def test_usage_on_every_finish_fails_only_the_usage_rule() -> None:
    obs = _stream(
        _token(0, [5], "a"),
        _token(1, [9], "x"),
        _finished(0, usage=(3, 1)),
        _finished(1, usage=(3, 2)),
        n=2,
    )
    verdicts = _verdicts([obs])
    assert verdicts.pop("judge_usage_last") is False
    assert set(verdicts.values()) == {True}


@pytest.mark.parametrize(
    "messages",
    [
        # the same token twice, one per delta: not cumulative
        (_token(0, [5], "a"), _token(0, [5], "a"), _token(0, [5], "a"), _finished(0, usage=(3, 3))),
        # stop-string hold-back: tokens without text, then catch-up text
        (_token(0, [5], ""), _token(0, [6], ""), _token(0, [7, 8], "abcd"), _finished(0, usage=(3, 4))),
        # n = 2 interleaved, output 1 finishing first
        (
            _token(0, [5], "a"),
            _token(1, [9], "x"),
            _finished(1),
            _token(0, [6], "b"),
            _finished(0, usage=(3, 3)),
        ),
    ],
    ids=["repeated-token", "hold-back", "interleaved"],
)
def test_legal_streams_pass_every_rule(messages: tuple[generation_pb2.GenerateResponse, ...]) -> None:
    n = 1 + max((m.token.output_index for m in messages if m.WhichOneof("event") == "token"), default=0)
    assert _verdicts([_stream(*messages, n=n)]) == dict.fromkeys(JUDGES, True)


def test_output_index_missing_in_an_n2_stream_does_not_break_the_finish_count() -> None:
    obs = _stream(_token(None, [5], "a"), _token(None, [9], "x"), _finished(0), _finished(0, usage=(3, 2)), n=2)
    for response in obs.messages:
        if response.WhichOneof("event") == "finished":
            response.finished.ClearField("output_index")
    verdicts = _verdicts([obs])
    assert verdicts.pop("judge_output_index") is False
    assert set(verdicts.values()) == {True}
