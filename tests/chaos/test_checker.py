"""The chaos soak's own parts, without processes: the checker catches every kind of wrong answer, the schedule and the
templates follow the seed alone, the reconciliation catches a lost answer, the proxy's faults do what they say."""

from __future__ import annotations

import functools
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from bench._chaos_check import (
    Answer,
    End,
    LifeCounts,
    Verdict,
    judge,
    log_ends,
    metric_counts,
    migrated_usage,
    parse,
    reconcile,
    reference_problems,
)
from bench._chaos_faults import FAULT_KINDS, QUIET_S, kv_faults, plan
from bench._chaos_load import Template, Transcript, catalogue
from bench._chaos_net import ProxyLink
from bench.chaos import parse_args

CHAT_STREAM = Template("t-chat", "chat", True, "base", 1, {"max_tokens": 4, "temperature": 0})
COMPLETION = Template("t-cmpl", "completions", False, "base", 1, {"max_tokens": 4, "temperature": 0})
N2_STREAM = Template("t-n2", "completions", True, "base", 2, {"max_tokens": 2, "temperature": 1, "seed": 3, "n": 2})
USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}


def chunk(text: str | None = None, finish: str | None = None, *, index: int = 0, usage: Any = None) -> str:
    choices = [] if text is None and finish is None else [{"index": index, "delta": {"content": text}}]
    if finish is not None:
        choices[0]["finish_reason"] = finish
    event: dict[str, Any] = {"id": "chatcmpl-abc", "choices": choices}
    if usage is not None:
        event["usage"] = usage
    return "data: " + json.dumps(event)


def streamed(template: Template, lines: list[str], status: int = 200, **kw: Any) -> Transcript:
    transcript = Transcript(1, 0, template, "fe1", "normal", 0.0, template.body_for(), status=status, **kw)
    transcript.lines = [(0.01 * i, line) for i, line in enumerate(lines)]
    return transcript


WHOLE = [chunk("The"), chunk(" old"), chunk(" mill"), chunk(" stood", "length"), chunk(usage=USAGE), "data: [DONE]"]


@pytest.fixture
def reference() -> Answer:
    answer = parse(streamed(CHAT_STREAM, WHOLE))
    assert reference_problems(CHAT_STREAM, answer) == []
    return answer


def test_an_exact_answer_is_complete_even_in_other_chunks_and_with_other_cached_tokens(reference: Answer) -> None:
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 4}}
    lines = [chunk("The old"), chunk(" mill stood", "length"), chunk(usage=usage), "data: [DONE]"]
    assert judge(streamed(CHAT_STREAM, lines), reference) == Verdict("complete", "exact")


@pytest.mark.parametrize(
    ("lines", "kind"),
    [
        ([*WHOLE[:3], chunk(usage=USAGE), "data: [DONE]"], "truncated_200"),  # no finish_reason
        (WHOLE[:4], "truncated_200"),  # no [DONE]
        ([chunk("The"), chunk(" mill"), chunk(" stood", "length"), chunk(usage=USAGE), "data: [DONE]"], "tokens_lost"),
        ([chunk("The"), chunk(" old"), chunk(" old"), chunk(" mill"), chunk(" stood", "length"), "data: [DONE]"],
         "tokens_duplicated"),
        ([chunk("The"), chunk(" old"), chunk(" mill"), chunk(" stoop", "length"), "data: [DONE]"], "tokens_spliced"),
        ([*WHOLE[:3], chunk(" stood", "stop"), chunk(usage=USAGE), "data: [DONE]"], "finish_mismatch"),
        ([*WHOLE[:4], chunk(usage={**USAGE, "prompt_tokens": 9}), "data: [DONE]"], "usage_mismatch"),
        ([*WHOLE[:4], 'data: {"error": {"code": 503}}', "data: [DONE]"], "finish_then_error"),
        ([chunk("The"), chunk(" mill"), 'data: {"error": {"code": 503}}', "data: [DONE]"], "error_not_prefix"),
        ([*WHOLE, "data: [DONE]"], "malformed"),
        ([chunk("The"), "data: {not json"], "malformed"),
    ],
)  # fmt: skip
def test_every_wrong_answer_is_a_violation_of_its_kind(reference: Answer, lines: list[str], kind: str) -> None:
    verdict = judge(streamed(CHAT_STREAM, lines), reference)
    assert (verdict.outcome, verdict.kind) == ("violation", kind), verdict


def test_an_error_after_a_prefix_is_clean_and_so_is_an_http_status(reference: Answer) -> None:
    lines = [chunk("The"), chunk(" old"), 'data: {"error": {"message": "gone", "code": 503}}', "data: [DONE]"]
    assert judge(streamed(CHAT_STREAM, lines), reference) == Verdict("clean_error", "sse 503")
    assert judge(streamed(CHAT_STREAM, ['{"message": "no"}'], status=503), reference).outcome == "clean_error"


def test_a_client_that_left_must_have_seen_a_prefix(reference: Answer) -> None:
    left = streamed(CHAT_STREAM, WHOLE[:2], disconnected=True)
    assert judge(left, reference) == Verdict("cancelled", "client_left")
    spliced = streamed(CHAT_STREAM, [chunk("The"), chunk(" mill")], disconnected=True)
    assert judge(spliced, reference).kind == "cancelled_not_prefix"


def test_a_hang_and_a_broken_stream_are_violations(reference: Answer) -> None:
    assert judge(streamed(CHAT_STREAM, WHOLE[:2], timed_out=True), reference).kind == "hang"
    broken = streamed(CHAT_STREAM, WHOLE[:2], transport_error="RemoteProtocolError: incomplete chunked read")
    assert judge(broken, reference).kind == "stream_broken"


def test_logprobs_and_n2_choices_are_compared_one_by_one() -> None:
    def event(index: int, text: str, logprob: float, finish: str | None = None) -> str:
        choice = {"index": index, "text": text, "logprobs": {"tokens": [text], "token_logprobs": [logprob],
                                                             "top_logprobs": [{text: logprob}]}}  # fmt: skip
        if finish:
            choice["finish_reason"] = finish
        return "data: " + json.dumps({"id": "cmpl-x", "choices": [choice]})

    usage = "data: " + json.dumps({"choices": [], "usage": USAGE})
    whole = [event(0, "A", -0.5), event(1, "B", -1.0), event(0, "C", -0.25, "length"), event(1, "D", -2.0, "length")]
    reference = parse(streamed(N2_STREAM, [*whole, usage, "data: [DONE]"]))
    assert reference_problems(N2_STREAM, reference) == []
    # The same choices, interleaved differently: exact.
    reordered = [whole[1], whole[0], whole[3], whole[2], usage, "data: [DONE]"]
    assert judge(streamed(N2_STREAM, reordered), reference).outcome == "complete"
    other_logprob = [*whole[:3], event(1, "D", -2.5, "length"), usage, "data: [DONE]"]
    assert judge(streamed(N2_STREAM, other_logprob), reference).kind == "logprobs_mismatch"
    # One choice ends, then the other fails: clean when the finished one is whole and exact.
    error = 'data: {"error": {"code": 503}}'
    assert judge(streamed(N2_STREAM, [*whole[:3], error, "data: [DONE]"]), reference).outcome == "clean_error"
    cut = [whole[0], event(1, "B", -1.0, "length"), error, "data: [DONE]"]
    assert judge(streamed(N2_STREAM, cut), reference).kind == "finish_then_error"
    one_choice_missing = [whole[0], whole[2], usage, "data: [DONE]"]
    assert judge(streamed(N2_STREAM, one_choice_missing), reference) == Verdict(
        "violation", "truncated_200", "choice(s) [1] without finish_reason"
    )


def test_a_non_streamed_answer_is_compared_the_same_way() -> None:
    body = {"id": "cmpl-y", "choices": [{"index": 0, "text": "The mill", "finish_reason": "length"}], "usage": USAGE}
    reference = parse(streamed(COMPLETION, [json.dumps(body)]))
    assert judge(streamed(COMPLETION, [json.dumps(body)]), reference).outcome == "complete"
    truncated = {**body, "choices": [{"index": 0, "text": "The mill", "finish_reason": None}]}
    assert judge(streamed(COMPLETION, [json.dumps(truncated)]), reference).kind == "truncated_200"


def test_the_schedule_and_the_templates_follow_the_seed_alone() -> None:
    assert plan(7, 180, "file") == plan(7, 180, "file")
    assert plan(7, 180, "file") != plan(8, 180, "file")
    faults = plan(1, 600, "file")
    assert all(5 <= f.at <= 600 - QUIET_S for f in faults)
    assert {f.kind for f in faults} == {k for k, w in FAULT_KINDS.items() if w[0]}
    assert {f.kind for f in plan(1, 600, "etcd")} >= {"etcd_pause", "nats_pause"}
    assert kv_faults(1, "w1", 2) == kv_faults(1, "w1", 2) != kv_faults(1, "w1", 3)
    templates = [t for seed in (1, 2, 3) for t in catalogue(seed)]
    assert [t.body for t in catalogue(3)] == [t.body for t in catalogue(3)]
    features: Counter[str] = Counter()
    for t in templates:
        features.update(
            {t.api, t.model_kind, "stream" if t.stream else "unary", f"n{t.n}", t.directive or "-"}
            | {k for k in ("stop", "logprobs", "seed") if k in t.body}
        )
        # Every template has a reference: greedy, or sampled with an explicit seed.
        assert t.body["temperature"] == 0 or "seed" in t.body
        if t.model_kind == "pd":
            assert t.n == 1, "a prefill leg serves one output"
            assert "logprobs" not in t.body, "the full engine carries no logprobs across the handoff"
    for feature in ("chat", "completions", "stream", "unary", "n2", "stop", "logprobs", "seed", "lora", "pd",
                    "error_retryable", "error_fatal"):  # fmt: skip
        assert features[feature], feature


def _life(worker: str, finished: list[str], metrics: tuple[int, dict[str, int]] | None = None) -> LifeCounts:
    return LifeCounts(worker, 1, "running", metrics, Counter({"finished": len(finished)}), finished)


def test_reconciliation_finds_an_answer_no_sidecar_finished_and_counters_that_do_not_add_up() -> None:
    transcript = streamed(CHAT_STREAM, WHOLE)
    answer = parse(transcript)
    verdicts = [(transcript, Verdict("complete", "exact"), answer)]
    good = reconcile([_life("w1", ["abc"])], verdicts, set())
    assert good.problems == []
    assert reconcile([_life("w2", [])], verdicts, set()).problems == ["request #1 (abc): complete, finished by none"]
    twice = reconcile([_life("w1", ["abc"]), _life("w2", ["abc"])], verdicts, set())
    assert "finished by ['w1#1', 'w2#1']" in twice.problems[0]
    ended = {"finished": 1, "cancelled": 0, "failed": 0, "rejected": 0}
    assert reconcile([_life("w1", ["abc"], (1, ended))], verdicts, set()).problems == []
    off = reconcile([_life("w1", ["abc"], (2, ended))], verdicts, set()).problems
    assert off == ["w1 run 1: received 2 != ended 1 {'finished': 1, 'cancelled': 0, 'failed': 0, 'rejected': 0}"]
    # A run SIGKILLed just after it logged the finish may not have sent the answer: another run finished it too.
    killed = LifeCounts("w1", 1, "sigkill", None, Counter(), ["abc"], [End("abc", "finished", "stop", 3, 1, 100.0)])
    killed.killed_at = 100.2
    assert reconcile([killed, _life("w2", ["abc"])], verdicts, set()).problems == []
    assert reconcile([killed], verdicts, set()).problems == [], "or it left just in time"
    killed.killed_at = 105.0
    assert "finished by ['w1#1', 'w2#1']" in reconcile([killed, _life("w2", ["abc"])], verdicts, set()).problems[0]
    stray = reconcile([_life("w1", ["abc", "zzz"])], verdicts, set()).problems
    assert "no client saw or left" in stray[0]
    assert reconcile([_life("w1", ["abc", "zzz"])], verdicts, {"zzz"}).problems == []


def test_metric_counts_reads_the_sidecar_series_under_dynamos_labels() -> None:
    labels = 'dynamo_component="backend",dynamo_endpoint="generate",dynamo_namespace="dynamo"'
    page = "\n".join(
        [
            f"openengine_sidecar_requests_received_total{{{labels}}} 7.0",
            f'openengine_sidecar_requests_ended_total{{{labels},outcome="finished"}} 5.0',
            f'openengine_sidecar_requests_ended_total{{outcome="failed",{labels}}} 2.0',
        ]
    )
    assert metric_counts(page) == (7, {"finished": 5, "cancelled": 0, "failed": 2, "rejected": 0})
    assert metric_counts("nothing here") is None


async def _echo_server(nursery: trio.Nursery) -> int:
    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            async for data in stream:
                await stream.send_all(data)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def _roundtrip(stream: trio.SocketStream, payload: bytes) -> bytes:
    await stream.send_all(payload)
    got = b""
    while len(got) < len(payload):
        got += await stream.receive_some(65536)
    return got


async def test_the_proxy_carries_bytes_in_order_and_its_faults_hold_and_release_them() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            upstream_port = await _echo_server(nursery)
            proxy = ProxyLink("127.0.0.1", 0, lambda: ("127.0.0.1", upstream_port))
            await nursery.start(proxy.run)
            stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
            payload = bytes(random.Random(1).randrange(256) for _ in range(200_000))
            assert await _roundtrip(stream, payload) == payload
            # Loss-like stalls and jitter reorder nothing.
            proxy.loss(50)
            proxy.delay(5, 5)
            for i in range(6):
                assert await _roundtrip(stream, b"x%d" % i) == b"x%d" % i
            proxy.clear()
            # A blackholed connection carries nothing until the fault is lifted, then everything it held.
            assert proxy.blackhole(random.Random(0)).startswith("connection #1")
            await stream.send_all(b"held")
            with trio.move_on_after(0.5) as waited:
                await stream.receive_some(10)
            assert waited.cancelled_caught
            proxy.clear()
            assert await stream.receive_some(10) == b"held"
            await stream.aclose()
            nursery.cancel_scope.cancel()


def test_a_prompt_counted_with_the_tokens_before_a_migration_is_accepted_only_when_the_sidecar_log_proves_it(
    reference: Answer,
) -> None:
    """Dynamo 1.6.1 takes ``prompt_tokens`` from the last attempt's worker, whose prompt holds the tokens generated
    before the migration: 5 + 3 here. Accepted as complete only when the attempt that finished received 8 tokens
    and generated the other 1."""
    lines = [*WHOLE[:4], chunk(usage={**USAGE, "prompt_tokens": 8, "total_tokens": 12}), "data: [DONE]"]
    answer = parse(streamed(CHAT_STREAM, lines))
    verdict = judge(streamed(CHAT_STREAM, lines), reference)
    assert verdict.kind == "usage_mismatch"
    first = End("abc", "failed", "engine lost", 5, 3)
    last = End("abc", "finished", "length", 8, 1)
    accepted = migrated_usage(verdict, answer, reference, [first, last])
    assert (accepted.outcome, accepted.kind) == ("complete", "migrated_prompt_tokens")
    assert migrated_usage(verdict, answer, reference, [first, End("abc", "finished", "length", 8, 4)]) == verdict
    assert migrated_usage(verdict, answer, reference, [End("abc", "finished", "length", 5, 4)]) == verdict
    wrong_completion = [*WHOLE[:4], chunk(usage={**USAGE, "prompt_tokens": 8, "completion_tokens": 5}), "data: [DONE]"]
    other = parse(streamed(CHAT_STREAM, wrong_completion))
    assert migrated_usage(
        judge(streamed(CHAT_STREAM, wrong_completion), reference), other, reference, [first, last]
    ).kind == ("usage_mismatch")


def test_the_request_end_lines_are_read_whatever_their_reason_holds(tmp_path: Path) -> None:
    log = tmp_path / "w1.log"
    log.write_text(
        "2026-01-01T10:00:00.000Z WARNING sidecar.requests [worker=serving req=a]: request a failed (engine sent "
        "nothing for 5s (request a)): 7 in / 18 out tokens, TTFT 174 ms, 5672 ms\n"
        "2026-01-01T10:00:01.000Z INFO sidecar.requests [worker=serving req=b]: request b finished (length): 25 in "
        "/ 2 out tokens, TTFT 5 ms, 30 ms\n"
        "2026-01-01T10:00:01.000Z INFO dynamo push_handler: request received request_id=c\n"
    )
    assert log_ends(log) == [
        End("a", "failed", "engine sent nothing for 5s (request a)", 7, 18, 1767261600.0),
        End("b", "finished", "length", 25, 2, 1767261601.0),
    ]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--minutes", "0.1"], "--minutes 0.1: must be between 0.5 and 120"),
        (["--minutes", "three"], "argument --minutes: invalid float value: 'three'"),
        (["--control-plane", "zookeeper"], "argument --control-plane: invalid choice: 'zookeeper'"),
        (["--report", "/nonexistent-dir/r.json"], "--report /nonexistent-dir/r.json: directory"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_status_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("bench.chaos: error: ")
    assert says in err
