"""The chaos soak's own parts, without processes: the checker catches every kind of wrong answer, the schedule and the
templates follow the seed alone, the reconciliation catches a lost answer, the proxy's faults do what they say."""

from __future__ import annotations

import functools
import json
import random
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest
import trio

from bench._chaos_check import (
    Answer,
    End,
    LifeCounts,
    Reconciliation,
    Verdict,
    frontend_abandoned,
    frontend_lost,
    frontend_migrations,
    judge,
    log_ends,
    log_instances,
    metric_counts,
    migrated_usage,
    parse,
    reconcile,
    reference_problems,
    request_ids,
)
from bench._chaos_discovery import problems, sets
from bench._chaos_faults import (
    CP_REST_S,
    FAULT_KINDS,
    QUIET_S,
    WITNESSES,
    ChaosState,
    FaultRecord,
    PlannedFault,
    _cp_resting,
    kv_faults,
    observed_kv_faults,
    plan,
)
from bench._chaos_load import Template, Transcript, catalogue
from bench._chaos_logs import Tally
from bench._chaos_net import ProxyLink
from bench._chaos_report import Report, markers, write_docs
from bench._chaos_resources import HARNESS, Resources, Sample, Watched, fit, task_gauges
from bench._chaos_topology import Life, Topology, build
from bench.chaos import parse_args
from tests.cluster.network import Network
from tests.helpers.processes import Process

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


def test_a_prompt_counted_with_the_tokens_before_a_migration_is_accepted_only_when_the_frontend_moved_them(
    reference: Answer,
) -> None:
    """Dynamo 1.6.1 takes ``prompt_tokens`` from the last attempt's worker, whose prompt holds the tokens generated
    before the migration: 5 + 3 here. Accepted as complete only when the frontend's own record of the migration
    says it appended exactly those 3 tokens, and everything else (text, completion, total) is exact."""
    lines = [*WHOLE[:4], chunk(usage={**USAGE, "prompt_tokens": 8, "total_tokens": 12}), "data: [DONE]"]
    answer = parse(streamed(CHAT_STREAM, lines))
    verdict = judge(streamed(CHAT_STREAM, lines), reference)
    assert verdict.kind == "usage_mismatch"
    accepted = migrated_usage(verdict, answer, reference, 3)
    assert (accepted.outcome, accepted.kind) == ("complete", "migrated_prompt_tokens")
    assert migrated_usage(verdict, answer, reference, 2) == verdict, "the frontend moved other tokens"
    assert migrated_usage(verdict, answer, reference, None) == verdict, "no migration in the frontend's log"
    wrong_completion = [*WHOLE[:4], chunk(usage={**USAGE, "prompt_tokens": 8, "completion_tokens": 5}), "data: [DONE]"]
    other = parse(streamed(CHAT_STREAM, wrong_completion))
    assert migrated_usage(judge(streamed(CHAT_STREAM, wrong_completion), reference), other, reference, 3).kind == (
        "usage_mismatch"
    )
    more_than_generated = [*WHOLE[:4], chunk(usage={**USAGE, "prompt_tokens": 10, "total_tokens": 14}), "data: [DONE]"]
    beyond = parse(streamed(CHAT_STREAM, more_than_generated))
    assert migrated_usage(judge(streamed(CHAT_STREAM, more_than_generated), reference), beyond, reference, 5) == (
        judge(streamed(CHAT_STREAM, more_than_generated), reference)
    ), "5 tokens cannot have been generated before a migration of a 4-token answer"


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


# Dynamo's exception line, written in pieces with PYTHONUNBUFFERED=1: another thread's whole line can land inside it.
BARE = "dynamo._core.EngineShutdown: worker is not serving (starting, degraded or draining); retry on another worker"


def _topology_with_logs(tmp_path: Path, sidecar_log: str, engine_log: str) -> Topology:
    """The chaos topology, not started, with one finished life of w1's sidecar and engine writing the given logs."""
    topo = build(tmp_path, "file", Network("loopback", {}), "proxy")
    for managed, text in ((topo.workers["w1"].sidecar, sidecar_log), (topo.workers["w1"].engine.managed, engine_log)):
        path = tmp_path / f"{managed.name}.log"
        path.write_text(text)
        managed.lives.append(Life(1, Process([], path, cast("trio.Process", None)), 0.0, end="stopped"))
    return topo


def test_the_log_reader_counts_lines_it_does_not_know_and_reads_on(tmp_path: Path) -> None:
    """Bare lines (no timestamp) and a record that starts in the middle of one are counted, never fatal: the KV
    fault is still found and recovered, the request end still read."""
    resync = (
        "2026-01-01T10:00:01.000Z WARNING sidecar.kv [worker=serving req=-]: KV events rank 0: resynchronising (gap)"
    )
    end = (
        "2026-01-01T10:00:02.000Z INFO sidecar.requests [worker=serving req=a]: request a finished (length): "
        "5 in / 2 out tokens"
    )
    sidecar_log = "\n".join([BARE, "dynamo._core.EngineShutdown: " + resync, "worker is not serving", end, ""])
    injected = datetime(2026, 1, 1, 10, 0, 0, 900000).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    engine_log = (
        f"openengine-mock listening on 127.0.0.1:1\n"
        f"{injected} openengine-mock WARNING KV events: injecting 'gap' at batch #9\n"
    )
    topo = _topology_with_logs(tmp_path, sidecar_log, engine_log)
    tally = Tally()
    found = observed_kv_faults(topo, lambda unix: unix, tally)
    assert [(r.kind, r.note) for r in found] == [("kv_gap", "batch #9")]
    assert found[0].recovered == pytest.approx(datetime(2026, 1, 1, 10, 0, 1, tzinfo=UTC).timestamp())
    assert tally.unknown == {"sidecar": 3, "engine": 1}
    assert tally.examples[0] == BARE
    ends = log_ends(tmp_path / "w1.log", tally)
    assert ends == [End("a", "finished", "length", 5, 2, datetime(2026, 1, 1, 10, 0, 2, tzinfo=UTC).timestamp())]
    assert tally.unknown["sidecar"] == 6


def test_the_schedule_never_restarts_its_witnesses_and_draws_the_new_kinds() -> None:
    """One sidecar, one engine and one frontend live through the whole run (the resource slopes need one long
    life of each); the restarts, frontend restarts and partitions go to the others."""
    faults = plan(5, 3600, "etcd")
    restarts = {
        "engine_kill": "engine",
        "engine_goaway": "engine",
        "sidecar_term": "sidecar",
        "sidecar_kill": "sidecar",
    }
    for fault in faults:
        if fault.kind in restarts:
            assert fault.target != WITNESSES[restarts[fault.kind]], fault
        if fault.kind == "frontend_restart":
            assert fault.target != WITNESSES["frontend"]
    kinds = Counter(f.kind for f in faults)
    assert all(kinds[k] for k in ("frontend_restart", "partition_cp", "partition_engine")), kinds
    assert not {f.kind for f in plan(5, 3600, "file")} & {"partition_cp", "partition_engine"}


def test_a_stream_broken_by_its_frontends_stop_is_a_clean_error_only_then_and_only_as_a_prefix(
    reference: Answer,
) -> None:
    broken = streamed(CHAT_STREAM, WHOLE[:2], transport_error="RemoteProtocolError: incomplete chunked read")
    broken.started, broken.ended = 10.0, 12.0
    verdict = judge(broken, reference)
    assert verdict.kind == "stream_broken"
    lost = frontend_lost(verdict, broken, reference, [11.0])
    assert (lost.outcome, lost.kind) == ("clean_error", "frontend_lost")
    assert frontend_lost(verdict, broken, reference, [9.0, 12.5]) == verdict, "no stop while it was in flight"
    spliced = streamed(CHAT_STREAM, [chunk("The"), chunk(" mill")], transport_error="RemoteProtocolError: x")
    spliced.started, spliced.ended = 10.0, 12.0
    assert frontend_lost(judge(spliced, reference), spliced, reference, [11.0]).outcome == "violation"
    truncated = streamed(CHAT_STREAM, WHOLE[:4])  # no [DONE], yet no transport error: not the frontend's death
    truncated.started, truncated.ended = 10.0, 12.0
    assert frontend_lost(judge(truncated, reference), truncated, reference, [11.0]).kind == "truncated_200"


def _series(values: list[float], *, life: int = 1, start: float = 0.0, step: float = 30.0) -> list[Sample]:
    return [Sample(start + i * step, life, "load", (v, 10.0, 5.0, 50.0, 20.0)) for i, v in enumerate(values)]


def test_a_figure_grows_only_when_its_rise_within_a_life_beats_its_noise_and_the_floor() -> None:
    rng = random.Random(3)
    noisy_flat = [110 + rng.gauss(0, 1.5) for _ in range(100)]
    flat = fit(_series(noisy_flat), "rss_mb", {1: 0.0}, warmup_s=300)
    assert not flat.grew, flat
    assert flat.noise is not None
    assert 0.8 < flat.noise < 2.5
    # 12 MB an hour on top of the same noise: over 47 minutes a rise of ~9 MB, three times the noise and the floor.
    leaking = [v + 12 * i * 30 / 3600 for i, v in enumerate(noisy_flat)]
    grew = fit(_series(leaking), "rss_mb", {1: 0.0}, warmup_s=300)
    assert grew.grew, grew
    assert grew.slope_h == pytest.approx(12, abs=2)
    # A restart is not a shrink and a fresh life's climb during its warm-up is not a leak: the slope is within lives.
    restarted = _series([110.0] * 40) + _series([80 + i for i in range(5)] + [85.0] * 40, life=2, start=1200)
    across = fit(restarted, "rss_mb", {1: 0.0, 2: 1200.0}, warmup_s=300)
    assert across.lives == 2
    assert across.slope_h == pytest.approx(0, abs=0.01)
    assert not across.grew
    assert fit(_series([1.0, 2.0]), "rss_mb", {1: 0.0}, warmup_s=0).slope_h is None, "too few samples to fit"


def test_the_resources_verdict_names_what_grew_and_judges_idle_tasks_before_and_after() -> None:
    def process(name: str, tasks_after: float, leak_mb_h: float = 0.0) -> Watched:
        watched = Watched(name, "sidecar", lambda: None)
        watched.life_starts[1] = -60.0
        watched.samples = [Sample(-1.0, 1, "idle-start", (100.0, 10.0, 5.0, 40.0, 20.0))]
        watched.samples += [
            Sample(i * 30.0, 1, "load", (100 + leak_mb_h * i * 30 / 3600 + (i % 3) * 0.2, 12.0, 6.0, 60.0, 30.0))
            for i in range(100)
        ]
        watched.samples.append(Sample(3001.0, 1, "idle-end", (101.0, 10.0, 5.0, tasks_after, 20.0)))
        return watched

    flat = Resources([process("sidecar w3", 41.0)], 30.0, 300.0)
    flat.analyse()
    assert flat.verdict() == "resources: flat (1 of 1 processes measured)"
    leaky = Resources([process("sidecar w3", 60.0, leak_mb_h=20.0), process(HARNESS, 40.0, leak_mb_h=50.0)], 30, 300)
    leaky.analyse()
    verdict = leaky.verdict()
    assert verdict.startswith("resources: GREW — sidecar w3 rss_mb +20.0 MB/h"), verdict
    assert "sidecar w3 trio_tasks idle 40 before the load, 60 after" in verdict
    assert HARNESS not in verdict, "this program's own memory is shown, never judged"
    assert any(line.startswith("| sidecar w3 | 1 |") and "↑" in line for line in leaky.table())


def test_the_task_gauges_are_read_under_dynamos_labels() -> None:
    page = (
        'openengine_sidecar_trio_tasks{dynamo_namespace="dynamo",dynamo_component="backend"} 57.0\n'
        "openengine_sidecar_asyncio_tasks 21.0\nopenengine_sidecar_trio_tasks_other 3\n"
    )
    assert task_gauges(page) == (57.0, 21.0)
    assert task_gauges("") == (None, None)


def test_discovery_entries_are_one_set_per_live_worker_and_none_of_a_dead_instance() -> None:
    def entries(instance: int, publisher: str) -> list[tuple[str, int]]:
        return [
            (f"v1/instances/dynamo/backend/generate/{instance:x}", instance),
            (f"v1/mdc/dynamo/backend/generate/{instance:x}", instance),
            (f"v1/event_channels/namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/{publisher}",
             instance),
            (f"v1/instances/dynamo/backend/worker_kv_query_source_{publisher}/{instance:x}", instance),
        ]  # fmt: skip

    first = 0x6A6CA244C0023D09
    expected = {"w1": sets(entries(first, "ccee601779503"))[first]}
    # The same worker restarted: a new instance, new publisher ids, the same shape.
    second = 0x6A6CA244C0023D2D
    assert problems(entries(second, "33337fe116200"), {"w1": second}, expected) == []
    # The dead instance's entries are left until its lease expires.
    left = problems(entries(first, "ccee601779503") + entries(second, "33337fe116200"), {"w1": second}, expected)
    assert left == [f"lease {first:x} of no live worker holds 4 entries, e.g. {sorted(expected['w1'])[:2]}"]
    lost = problems(entries(second, "33337fe116200")[1:], {"w1": second}, expected)
    assert lost == [f"w1 ({second:x}) lacks ['v1/instances/dynamo/backend/generate/<id>']"]


def _frontend_line(stamp: str, text: str) -> str:
    """A line of Dynamo's frontend log as it writes them off a terminal (ANSI colour codes included)."""
    return f"\x1b[2m2026-01-01T10:00:{stamp}Z\x1b[0m \x1b[32m INFO\x1b[0m \x1b[1mhttp-request\x1b[0m: {text}"


def test_the_frontends_migrations_are_read_by_the_worker_side_request_id(tmp_path: Path) -> None:
    """The frontend names a retry by its own span id; a route line pairs that id with the worker-side one (the id
    of the client's answer and of the sidecars' end lines)."""
    span, worker_id = "3ee6c78d-de13-4371-a99f-2be22adc03ce", "2b5155b6-8cac-450c-8199-988b8d852db8"
    route = (
        f'request_span: route request completed request.outcome="success" method=POST request_id={span} '
        f'otel.kind="client" request_id={worker_id} phase=Decode request.attempt={{}} migration.tokens_completed={{}}'
    )
    retry = (
        "request_span: migration retry scheduled request.attempt={} migration.is_retry=true "
        'migration.reason="stream_disconnected" migration.tokens_completed={} method=POST request_id=' + span
    )
    log = tmp_path / "fe1.log"
    log.write_text(
        "\n".join(
            [
                _frontend_line("00.000", route.format(0, 0)),
                _frontend_line("01.000", retry.format(1, 9)),
                "Stack backtrace:",  # a multi-line ERROR's continuation: counted, not read
                _frontend_line("01.100", retry.format(2, 15)),
                _frontend_line("01.200", route.format(2, 15)),
                _frontend_line("02.000", retry.format(1, 4).replace(span, "other-span")),
                "",
            ]
        )
    )
    tally = Tally()
    assert frontend_migrations([log], {worker_id}, tally) == {worker_id: 15}
    assert tally.unknown == {"frontend": 1}
    assert frontend_migrations([log], {"someone-else"}, Tally()) == {}


PD_STREAM = Template("t09-chat-s-pd-n1-r-stop", "chat", True, "pd", 1, {"max_tokens": 40, "stop": [","], "seed": 5})


def test_the_soaks_usage_mismatch_on_a_migrated_disaggregated_answer_is_excused_by_the_frontends_record(
    tmp_path: Path,
) -> None:
    """The shape of the full run's failure: a pair's streamed answer, its decode engine killed after 15 tokens, the
    frontend migrated it (prompt 22 + 15) and it completed exactly; the client's ``prompt_tokens`` is 37, the
    reference's 22. The decode sidecar's last attempt has no "finished" line with 22 − 15 out tokens (it ended at
    the stop string the frontend applies itself: ``cancelled``, one token past it), which the old excuse required;
    the frontend's own migration line says it appended 15 tokens, which is what the checker now asks."""
    usage = {"prompt_tokens": 22, "completion_tokens": 20, "total_tokens": 42}
    body = [chunk(" ".join(["word"] * 10)), chunk(" more words,", "stop"), chunk(usage=usage), "data: [DONE]"]
    reference = parse(streamed(PD_STREAM, body))
    migrated = [*body[:2], chunk(usage={**usage, "prompt_tokens": 37, "total_tokens": 57}), "data: [DONE]"]
    answer = parse(streamed(PD_STREAM, migrated))
    verdict = judge(streamed(PD_STREAM, migrated), reference)
    assert (verdict.kind, verdict.detail) == ("usage_mismatch", "usage (37, 20, 57) vs (22, 20, 42)")
    # What the decode sidecar logged: the attempt that lost its engine, and the one the frontend cut at the stop.
    sidecar_attempts = [End("abc", "failed", "Generate: UNAVAILABLE", 22, 15), End("abc", "cancelled", "-", 37, 6)]
    assert not [a for a in sidecar_attempts if a.outcome == "finished"], "nothing the old excuse could accept"
    span = "3ee6c78d-de13-4371-a99f-2be22adc03ce"
    log = tmp_path / "fe2.log"
    log.write_text(
        _frontend_line(
            "00.000",
            f"request_span: route request completed request_id={span} request_id=abc phase=Decode "
            'request.attempt=0 migration.tokens_completed=0 request.outcome="worker_disconnected"',
        )
        + "\n"
        + _frontend_line(
            "00.500",
            "request_span: migration retry scheduled request.attempt=1 migration.is_retry=true "
            f'migration.reason="backend_disconnected" migration.tokens_completed=15 request_id={span}',
        )
        + "\n"
    )
    moved = frontend_migrations([log], request_ids(answer), Tally())
    assert moved == {"abc": 15}
    excused = migrated_usage(verdict, answer, reference, moved["abc"])
    assert (excused.outcome, excused.kind) == ("complete", "migrated_prompt_tokens")


def test_one_level_shift_per_life_is_set_aside_and_a_second_one_is_growth() -> None:
    """Every Dynamo process (sidecar or frontend) once allocates ~53 MB it keeps (measured: one shift per life, at a
    random moment, flat before and after): not a leak. Two shifts in one life are growth in steps."""
    once = [110.0] * 50 + [163.0] * 50
    trend = fit(_series(once), "rss_mb", {1: 0.0}, warmup_s=0)
    assert not trend.grew, trend
    assert trend.steps == ((1, 1500.0, 53.0),)
    assert trend.slope_h == pytest.approx(0, abs=0.01)
    twice = [110.0] * 34 + [163.0] * 33 + [216.0] * 33
    assert fit(_series(twice), "rss_mb", {1: 0.0}, warmup_s=0).grew
    jitter = [48.0 + (i % 4) for i in range(100)]  # fds that come and go: no shift
    assert fit(_series(jitter), "rss_mb", {1: 0.0}, warmup_s=0).steps == ()


def test_control_plane_outages_of_a_host_are_a_lease_apart(tmp_path: Path) -> None:
    """Outages in quick succession add up on the lease's clock (Dynamo's keep-alive backs off): a partition of a
    host, or an etcd pause (every host), waits until that host has had the control plane for ``CP_REST_S``."""
    now = [100.0]
    state = ChaosState(build(tmp_path, "etcd", Network("loopback", {}), "proxy"), lambda: now[0])

    def fault(kind: str, target: str) -> PlannedFault:
        return PlannedFault(now[0], kind, target, 5.0, 0)

    assert _cp_resting(state, fault("partition_cp", "w1")) is None
    state.busy.add("w1-cp")
    assert _cp_resting(state, fault("partition_cp", "w2")) is None, "another host's partition is independent"
    assert _cp_resting(state, fault("etcd_pause", "etcd")) == "another control-plane outage is on (w1-cp)"
    state.busy.discard("w1-cp")
    state.cp_rest_until["w1"] = 100.0 + CP_REST_S
    assert _cp_resting(state, fault("partition_cp", "w1")) == "control plane of w1 out of reach less than 30 s ago"
    assert _cp_resting(state, fault("etcd_pause", "etcd")) is not None
    assert _cp_resting(state, fault("partition_cp", "pd-decode")) is None
    assert _cp_resting(state, fault("nats_pause", "nats")) is None, "NATS holds no lease"
    now[0] += CP_REST_S
    assert _cp_resting(state, fault("etcd_pause", "etcd")) is None


def test_write_docs_puts_the_whole_report_with_both_verdicts_into_its_control_planes_section(tmp_path: Path) -> None:
    """``--write-docs`` (the hour's run on etcd): requests, faults by kind, violations by kind, the resources table
    and both verdict lines replace the etcd section of docs/faults.md, and nothing else of the file changes."""
    docs = tmp_path / "faults.md"
    original = (Path(__file__).resolve().parents[2] / "docs" / "faults.md").read_text()
    docs.write_text(original)
    transcript = streamed(CHAT_STREAM, [])
    witness = Watched("sidecar w3", "sidecar", lambda: None)
    witness.life_starts[1] = -60.0
    witness.samples = [Sample(i * 30.0, 1, "load", (112.0, 48.0, 16.0, 22.0, 5.0)) for i in range(100)]
    resources = Resources([witness], 30.0, 600.0)
    resources.analyse()
    faults = [FaultRecord(PlannedFault(10.0, "partition_cp", "w1", 5.0, 0), injected=10.0, lifted=15.0, recovered=15.2)]
    report = Report(
        seed=1, minutes=60, control_plane="etcd", network="proxy", network_note="test", faults=faults,
        verdicts=[(transcript, Verdict("complete", "exact"), None)],
        reconciliation=Reconciliation([], [], Counter(), Counter(), {"own": 0, "client_left": 0, "complete": 0}),
        postconditions=[], anomalies=[], lora_reloads=0, elapsed_s=3700.0, resources=resources,
    )  # fmt: skip
    write_docs(docs, "etcd", report.docs_section("python -m bench.chaos --minutes 60 --control-plane etcd"))
    text = docs.read_text()
    begin, end = markers("etcd")
    section = text[text.index(begin) : text.index(end)]
    assert "$ python -m bench.chaos --minutes 60 --control-plane etcd" in section
    assert "| 1 | 1 | 0 | 0 | 0 |" in section, "requests, exact, clean errors, client left, violations"
    assert "| partition_cp | 1 | 0 | 0.2 s | 0.2 s | 0 |" in section
    assert "| sidecar w3 | 1 | 40 min | 112.0 ± 0.0, +0.0/h |" in section
    assert section.rstrip().endswith("violations: none\nresources: flat (1 of 1 processes measured)")
    file_begin, file_end = markers("file")
    assert (
        text[text.index(file_begin) : text.index(file_end)]
        == original[original.index(file_begin) : original.index(file_end)]
    )


def test_a_second_finish_is_excused_only_by_the_frontends_record_of_the_attempt_it_gave_up_on(tmp_path: Path) -> None:
    """Dynamo's request plane delivers an attempt the frontend gave up on (its NATS request timed out after a
    partition, or the connect-back broke) and re-routed: that run may finish the request for nobody. Seen six times
    in the second etcd hour, each a reconcile violation before. Only the frontend's record of the abandoned
    instance excuses the second finish; two finishes the frontend never gave up on stay a violation."""
    rid, late, live = "abc", 7668682685329807756, 7668682685329802558
    frontend = tmp_path / "fe1.log"
    frontend.write_text(
        "\n".join(
            [
                _frontend_line(
                    "51.693",
                    'request_span: route request failed request.outcome="connection_failed" '
                    f'error.type="cannot_connect" request_id=span-1 otel.kind="client" request_id={rid} '
                    f"phase=Aggregated worker_id={late} request.attempt=0",
                ),
                _frontend_line("51.694", f'Selected worker router_mode="kv" request_id="{rid}" worker_id={live}'),
                "",
            ]
        )
    )
    worker_log = tmp_path / "w1.log"
    worker_log.write_text(
        "2026-01-01T10:00:47.509126Z  INFO handle_payload: dynamo_runtime::pipeline::network::ingress::push_handler: "
        f'request received request_id={rid} otel.kind="server" instance_id={late}\n'
    )
    assert log_instances(worker_log, Tally()) == {late}
    abandoned = frontend_abandoned([frontend], Tally())
    assert abandoned[rid] == {late}
    transcript = streamed(CHAT_STREAM, WHOLE)
    verdicts = [(transcript, Verdict("complete", "exact"), parse(transcript))]
    gave_up = _life("w1", [rid])
    gave_up.instances = frozenset({late})
    served = _life("w3", [rid])
    served.instances = frozenset({live})
    excused = reconcile([gave_up, served], verdicts, set(), abandoned)
    assert excused.problems == []
    assert excused.explained["rerouted"] == 1
    # Without the frontend's record, or when the run that finished it too is not the one it gave up on: a violation.
    assert "finished by ['w1#1', 'w3#1']" in reconcile([gave_up, served], verdicts, set()).problems[0]
    other = _life("w2", [rid])
    other.instances = frozenset({1})
    assert "finished by ['w2#1', 'w3#1']" in reconcile([other, served], verdicts, set(), abandoned).problems[0]
    # Both finishers abandoned: one of them must have been the answer, yet the frontend says it gave up on both.
    served.instances = frozenset({late})
    assert reconcile([gave_up, served], verdicts, set(), abandoned).problems
