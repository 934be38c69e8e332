"""The request task (sidecar.requests) against an in-memory fake engine client, in virtual time.

Rules: every test uses ``autojump_clock`` (timeouts elapse instantly and deterministically); the fake client records
what the engine would have seen (opened streams, stream closes, aborts); each test asserts the request's terminal state.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from contextlib import suppress
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from openengine.v1 import error_pb2
from openengine.v1 import generation_pb2 as pb
from sidecar.dynamo import RequestContext
from sidecar.errors import (
    DynamoErrorKind,
    EngineFailure,
    EngineRpcError,
    GrpcCode,
    ProtocolViolation,
    RequestRejected,
    Violation,
    WorkerDraining,
)
from sidecar.requests import HungEngine, RequestServer, ServingContext
from tests.helpers.scripted_engine import (
    RID,
    Recorder,
    ScriptedEngine,
    Step,
    caps,
    collect,
    error,
    finished,
    recorder,
    serve,
    token,
)

__all__ = ["recorder"]  # the fixture, imported for this module's tests


def serving(engine: Any, *, inactivity: float = 5.0) -> ServingContext:
    return ServingContext(
        client=engine,
        caps=caps(),
        model="tiny",
        context_length=256,
        abort_timeout_s=1.0,
        inactivity_timeout_s=inactivity,
    )


def request(**stop: Any) -> dict[str, Any]:
    return {
        "token_ids": [5, 6, 7],
        "stop_conditions": {"max_tokens": 4, **stop},
        "sampling_options": {"temperature": 0.0},
    }


def make_server(engine: ScriptedEngine, **kw: float) -> RequestServer:
    server = RequestServer()
    server.attach(serving(engine, **kw))
    return server


async def test_a_complete_stream_ends_finished_without_abort(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    engine = ScriptedEngine([(0.01, [token(0, 10)]), (0.01, [token(0, 11), finished(0)])])
    chunks = await collect(make_server(engine), request())
    assert [c["token_ids"] for c in chunks] == [[10], [11]]
    assert chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["completion_usage"]["completion_tokens"] == 2
    assert recorder.events == [("submit", "submitted"), ("first_token", "streaming"), ("finish", "finished")]
    assert engine.aborts == []
    assert engine.stream_closed_early == 0


async def test_an_unsupported_option_is_rejected_before_any_rpc(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    engine = ScriptedEngine([])
    body = request()
    body["sampling_options"]["guided_decoding"] = {"json": {"type": "object"}}
    with pytest.raises(RequestRejected) as caught:
        await collect(make_server(engine), body)
    assert "guided_decoding" in str(caught.value)
    assert caught.value.kind is DynamoErrorKind.INVALID_ARGUMENT
    assert engine.opened == []
    assert recorder.events == [("reject", "rejected")]


async def test_a_client_stop_mid_stream_cancels_the_stream_and_aborts(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    engine = ScriptedEngine([(0.01, [token(0, 10)]), (60.0, [finished(0)])])
    server = make_server(engine)
    with trio.move_on_after(1.0):
        await collect(server, request())
    assert recorder.final == "cancelled"
    assert engine.aborts == [RID]
    assert engine.stream_closed_early == 1
    assert server.in_flight == 0


async def test_a_hung_engine_fails_the_request_after_the_inactivity_timeout(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    engine = ScriptedEngine([(0.01, [token(0, 10)]), (0.0, None)])
    start = trio.current_time()
    with pytest.raises(HungEngine) as caught:
        await collect(make_server(engine, inactivity=3.0), request())
    assert trio.current_time() - start == pytest.approx(3.01)
    assert caught.value.migratable
    assert recorder.final == "failed"
    assert engine.aborts == [RID]


async def test_a_terminal_engine_error_is_raised_with_its_retryable_flag(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    engine = ScriptedEngine([(0.01, [token(0, 10)]), (0.01, [error(error_pb2.ERROR_CODE_OVERLOADED, retryable=True)])])
    with pytest.raises(EngineFailure) as caught:
        await collect(make_server(engine), request())
    assert caught.value.kind is DynamoErrorKind.DISCONNECTED  # retryable → migratable, unlike the Rust sidecars
    assert recorder.final == "failed"


async def test_a_non_retryable_engine_error_is_not_migrated(autojump_clock: trio.testing.MockClock) -> None:
    engine = ScriptedEngine([(0.01, [error(error_pb2.ERROR_CODE_INTERNAL, retryable=False)])])
    with pytest.raises(EngineFailure) as caught:
        await collect(make_server(engine), request())
    assert caught.value.kind is DynamoErrorKind.UNKNOWN


async def test_an_event_after_the_terminal_fails_the_request_instead_of_succeeding(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    engine = ScriptedEngine([(0.01, [token(0, 10), finished(0)]), (0.01, [token(0, 11)])])
    out: list[dict[str, Any]] = []

    async def consume() -> None:
        async for batch in serve(make_server(engine), request(), RequestContext(request_id=RID)):
            out.extend(batch)

    with pytest.raises(ProtocolViolation) as caught:
        await consume()
    assert caught.value.violation is Violation.EVENT_AFTER_TERMINAL
    assert all("finish_reason" not in c for c in out), "the success must not reach the client first"
    assert recorder.final == "failed"


@pytest.mark.parametrize(
    ("script", "violation"),
    [
        ([(0.01, [token(0, 10)])], Violation.EOF_BEFORE_TERMINAL),
        ([(0.01, [token(1, 10)])], Violation.OUTPUT_INDEX_OUT_OF_RANGE),
        ([(0.01, [finished(0, reason=pb.FINISH_REASON_UNSPECIFIED)])], Violation.UNSPECIFIED_FINISH_REASON),
        ([(0.01, [pb.GenerateResponse(request_id="other")])], Violation.WRONG_REQUEST_ID),
    ],
)
async def test_protocol_violations_fail_only_that_request(
    autojump_clock: trio.testing.MockClock, script: list[Step], violation: Violation
) -> None:
    engine = ScriptedEngine(script)
    server = make_server(engine)
    with pytest.raises(ProtocolViolation) as caught:
        await collect(server, request())
    assert caught.value.violation is violation
    assert caught.value.kind is DynamoErrorKind.UNKNOWN
    # The worker keeps serving: the next request goes through.
    engine.script = [(0.01, [token(0, 1), finished(0)])]
    assert (await collect(server, request()))[-1]["finish_reason"] == "length"


async def test_transport_loss_is_migratable_and_needs_no_abort(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    lost = EngineRpcError("Generate", GrpcCode.UNAVAILABLE, "connection reset")
    engine = ScriptedEngine([(0.01, [token(0, 10)]), (0.01, lost)])
    with pytest.raises(EngineRpcError) as caught:
        await collect(make_server(engine), request())
    assert caught.value.migratable
    assert recorder.final == "failed"
    assert engine.aborts == []


async def test_a_worker_cancel_ends_the_request_with_a_migratable_error(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    engine = ScriptedEngine([(0.01, [token(0, 10)]), (60.0, [finished(0)])])
    server = make_server(engine)
    outcome: list[WorkerDraining] = []

    async def run() -> None:
        try:
            await collect(server, request())
        except WorkerDraining as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        # Virtual time (autojump_clock): the request is a second into its stream, deterministically.
        await trio.sleep(1.0)
        assert server.cancel_all(WorkerDraining("drain deadline")) == 1
    assert len(outcome) == 1
    assert outcome[0].migratable
    assert recorder.final == "cancelled"
    assert engine.aborts == [RID]
    await server.wait_idle()


async def test_a_worker_that_is_not_serving_sends_requests_elsewhere(autojump_clock: trio.testing.MockClock) -> None:
    server = RequestServer()
    with pytest.raises(WorkerDraining):
        await collect(server, request())


async def test_the_debug_line_of_a_request_shows_its_shape_never_its_prompt(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Failed before: the whole request was dumped at debug, prompt token ids included (ids decode back to the
    prompt); stop strings and guides are client text too."""
    engine = ScriptedEngine([(0.0, [token(0, 1), finished(0)])])
    prompt = [90210 + i for i in range(7)]
    body = {
        "token_ids": prompt,
        "stop_conditions": {"max_tokens": 4, "min_tokens": 1, "ignore_eos": False, "stop": ["a secret stop"]},
        "sampling_options": {"temperature": 0.5, "seed": 11, "guided_decoding": {"json": {"secret_key": "x"}}},
    }
    # This engine advertises no guided decoding: the request is refused, after its debug line.
    with caplog.at_level(logging.DEBUG, logger="sidecar.requests"), pytest.raises(RequestRejected):
        await collect(make_server(engine), body)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"request {RID}: ")]
    assert line == (
        f"request {RID}: prompt 7 tokens; sampling {{temperature=0.5, seed=11, guided json}}; "
        "stop {max_tokens=4, min_tokens=1, ignore_eos=False, stop ×1}"
    )
    for secret in ("90210", "secret"):
        assert all(secret not in r.getMessage() for r in caplog.records), secret


async def test_trace_headers_reach_the_engine_metadata(autojump_clock: trio.testing.MockClock) -> None:
    engine = ScriptedEngine([(0.0, [token(0, 1), finished(0)])])
    server = make_server(engine)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ctx = RequestContext(request_id=RID, trace_headers={"traceparent": parent})
    async for _ in serve(server, request(), ctx):
        pass
    assert ("traceparent", parent) in engine.metadata[0]


# ------------------------------------------------------------ issue 14: a complete answer is a finish, never a cancel

EOS = 2
STOP_TOKEN = 9


def natural(**stop: Any) -> dict[str, Any]:
    """A request that ends naturally: the engine stops at EOS (or a stop condition) before max_tokens."""
    return {
        "token_ids": [5, 6, 7],
        "eos_token_ids": [EOS],
        "stop_conditions": {"max_tokens": 40, "stop_token_ids_hidden": [EOS], **stop},
        "sampling_options": {"temperature": 0.0},
    }


def split_finish(gap_s: float, *last: int, reason: int = pb.FINISH_REASON_STOP) -> list[Step]:
    """Tokens at 10 ms intervals; the engine's message with the last token(s) arrives alone, its finish ``gap_s``
    later (what the issue measured: ``[{"token_ids":[18,1]},{"token_ids":[],"finish_reason":"stop",...}]``)."""
    return [
        (0.01, [token(0, 10)]),
        (0.01, [token(0, 11, *last)]),
        (gap_s, [finished(0, reason, usage=(3, 2 + len(last)), cached=2)]),
    ]


class Frontend:
    """Reads the request like Dynamo's frontend: it applies EOS / stop tokens (and, through ``ends_at``, stop
    strings) itself; at such a token in a chunk *without* ``finish_reason`` it stops the request (the worker sees its
    task cancelled) and drops whatever follows."""

    def __init__(self, stop_ids: set[int], ends_at: set[int] | None = None) -> None:
        self.stop_ids = stop_ids | (ends_at or set())
        self.chunks: list[dict[str, Any]] = []
        self.stopped_at: float | None = None

    async def run(self, server: RequestServer, body: dict[str, Any]) -> None:
        with trio.CancelScope() as scope:
            async for batch in serve(server, body, RequestContext(request_id=RID)):
                for chunk in batch:
                    self.chunks.append(chunk)
                    if "finish_reason" not in chunk and self.stop_ids.intersection(chunk["token_ids"]):
                        self.stopped_at = trio.current_time()
                        scope.cancel()  # stop_generating(); the chunks after this one are dropped

    @property
    def usage(self) -> dict[str, Any] | None:
        return next((c["completion_usage"] for c in self.chunks if "completion_usage" in c), None)


async def test_the_eos_token_and_the_finish_that_follows_it_reach_the_frontend_in_one_chunk(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    """Failed before: the EOS chunk went alone, the frontend stopped there -> `cancelled`, an Abort, no usage."""
    engine = ScriptedEngine(split_finish(0.003, EOS))
    frontend = Frontend({EOS})
    start = trio.current_time()
    await frontend.run(make_server(engine), natural())
    assert frontend.stopped_at is None, "the frontend saw the EOS with its finish_reason: no stop of its own"
    assert [c["token_ids"] for c in frontend.chunks] == [[10], [11, EOS]]
    assert frontend.chunks[-1]["finish_reason"] == "stop"
    assert frontend.usage is not None
    assert frontend.usage["prompt_tokens_details"] == {"cached_tokens": 2}
    assert recorder.final == "finished"
    assert engine.aborts == []
    # The hold cost exactly the engine's gap between the token and its finish (virtual time).
    assert trio.current_time() - start == pytest.approx(0.023)


@pytest.mark.parametrize(
    ("body", "last"),
    [
        (natural(stop_token_ids=[STOP_TOKEN]), STOP_TOKEN),
        ({"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 3}}, 12),
    ],
    ids=["stop token id", "max_tokens-th token"],
)
async def test_a_stop_token_or_the_last_allowed_token_waits_for_its_finish_too(
    autojump_clock: trio.testing.MockClock, recorder: Recorder, body: dict[str, Any], last: int
) -> None:
    engine = ScriptedEngine(split_finish(0.004, last))
    frontend = Frontend({STOP_TOKEN})
    await frontend.run(make_server(engine), body)
    assert frontend.chunks[-1]["token_ids"][-1] == last
    assert "finish_reason" in frontend.chunks[-1]
    assert recorder.final == "finished"
    assert engine.aborts == []


async def test_the_hold_never_delays_other_tokens(autojump_clock: trio.testing.MockClock) -> None:
    engine = ScriptedEngine([(0.01, [token(0, 10)]), (0.01, [token(0, 11)]), (0.01, [token(0, 12)]), (0.5, None)])
    arrivals: list[float] = []
    with trio.move_on_after(0.2):
        async for _ in serve(make_server(engine), natural(), RequestContext(request_id=RID)):
            arrivals.append(trio.current_time())
    assert arrivals == pytest.approx([0.01, 0.02, 0.03])


async def test_an_engine_that_stalls_after_an_eos_token_costs_the_bound_only(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    engine = ScriptedEngine(split_finish(10.0, EOS))
    out: list[tuple[float, dict[str, Any]]] = []
    async for batch in serve(make_server(engine, inactivity=30.0), natural(), RequestContext(request_id=RID)):
        out.extend((trio.current_time(), chunk) for chunk in batch)
    (t_eos, eos_chunk), (_, fin_chunk) = out[1], out[2]
    assert eos_chunk["token_ids"] == [11, EOS]
    assert "finish_reason" not in eos_chunk
    assert t_eos == pytest.approx(0.02 + 0.25), "released after the hold bound"
    assert fin_chunk["finish_reason"] == "stop"
    assert recorder.final == "finished"


async def test_a_frontend_stop_at_a_stop_string_followed_by_the_engines_finish_is_a_finish_without_abort(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    """Token 11 completes a stop string (the sidecar cannot tell: the frontend matches stop strings on its own
    text). The frontend ends the stream there; the engine's finish follows 3 ms later. Failed before: `cancelled`
    and an Abort for an answer the client received whole."""
    engine = ScriptedEngine(split_finish(0.003))
    frontend = Frontend({EOS}, ends_at={11})
    await frontend.run(make_server(engine), natural(stop=["river"]))
    assert frontend.stopped_at is not None
    assert recorder.final == "finished"
    assert engine.aborts == []
    assert ("finish", "finished") in recorder.events


async def test_a_stop_string_completing_token_waits_for_its_finish_when_the_engine_sends_text(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    """The engine cut the stop string from the text of the token that completed it: that token event has no text,
    so the chunk waits for the next event and the finish joins it -- the frontend never sees the stop string alone,
    and the usage (cached tokens) reaches the client. Failed before: the chunk went alone, the frontend ended the
    stream at the stop string, the request was `cancelled` with an Abort."""
    engine = ScriptedEngine(
        [
            (0.01, [token(0, 10, text="The")]),
            (0.01, [token(0, 11, text="")]),
            (0.005, [finished(0, pb.FINISH_REASON_STOP, usage=(3, 2), cached=2)]),
        ]
    )
    frontend = Frontend({EOS}, ends_at={11})
    await frontend.run(make_server(engine), natural(stop=[" the"]))
    assert frontend.stopped_at is None
    assert frontend.chunks[-1]["token_ids"] == [11]
    assert frontend.usage is not None
    assert frontend.usage["prompt_tokens_details"] == {"cached_tokens": 2}
    assert recorder.final == "finished"
    assert engine.aborts == []


async def test_a_stop_string_inside_a_token_ends_the_answer_there_with_the_engines_usage(
    autojump_clock: trio.testing.MockClock, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 27 item 4(c): the frontend matches the stop string " th" inside the token " the"; an engine that matches
    stop strings as token sequences (TensorRT-LLM) goes on. The sidecar sees the match in the engine's text: it holds
    that chunk, aborts the engine once its next event shows it going on, and closes the answer with the engine's
    terminal -- ``stop``, the stop string, the client's tokens and the engine's cached tokens. Failed before: the
    chunk went out alone, the frontend ended the stream there, and the request was ``cancelled`` ("stopped by the
    client"), with usage the frontend made up without ``cached_tokens``."""
    engine = ScriptedEngine(
        [
            (0.01, [token(0, 10, text=" The")]),
            (0.01, [token(0, 11, text=" the")]),  # " th" completes inside this token
            (0.01, [token(0, 12, text=" river")]),  # the engine goes on
            (0.01, [token(0, 13, text=" ran")]),
            (0.005, [finished(0, pb.FINISH_REASON_CANCELLED, usage=(3, 4), cached=2)]),  # after the Abort
        ]
    )
    frontend = Frontend({EOS}, ends_at={11})
    with caplog.at_level(logging.INFO, logger="sidecar.requests"):
        await frontend.run(make_server(engine), natural(stop=[" th"]))
    assert frontend.stopped_at is None, "the frontend got the stop string's chunk with its finish"
    last = frontend.chunks[-1]
    assert last["token_ids"] == [11]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", " th")
    assert last["completion_usage"]["completion_tokens"] == 2, "the tokens the client got"
    assert last["completion_usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert [t for c in frontend.chunks for t in c["token_ids"]] == [10, 11]
    assert recorder.final == "finished"
    assert engine.aborts == [RID], "the engine went on: it is aborted"
    [line] = [r.getMessage() for r in caplog.records if r.name == "sidecar.requests"]
    assert line.startswith("request req-1 finished (stop string ' th'"), line


async def test_a_client_leaving_a_stop_string_request_mid_stream_is_still_a_cancel_with_abort(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    """The engine's next event after the close is a token: the answer was not complete. The Abort waits for that
    event at most, i.e. one inter-token interval (10 ms here)."""
    engine = ScriptedEngine([(0.01 * (i + 1) if i == 0 else 0.01, [token(0, 10 + i)]) for i in range(40)])
    with trio.move_on_after(0.105):
        await collect(make_server(engine), natural(stop=["river"]))
    assert recorder.final == "cancelled"
    assert engine.aborts == [RID]
    assert engine.abort_times[0] == pytest.approx(0.11)


async def test_a_client_leaving_a_stop_string_request_before_the_engine_stalls_is_aborted_one_hold_later(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    """Issue 29 item 4(a): after the frontend closed a stop-string stream, the wait for the engine's next event is
    bounded by one hold. The client leaves 5 ms after a token and the engine then sends nothing: the Abort comes one
    hold (0.25 s) after the close, not at the inactivity timeout."""
    engine = ScriptedEngine([(0.01, [token(0, 10 + i)]) for i in range(10)] + [(0.0, None)])
    with trio.fail_after(60):
        with trio.move_on_after(0.105):
            await collect(make_server(engine, inactivity=30.0), natural(stop=["river"]))
        while not engine.aborts:
            await trio.sleep(0.01)
    assert ("close", "stopping") in recorder.events
    assert recorder.final == "cancelled"
    assert engine.abort_times == [pytest.approx(0.105 + 0.25)]


async def test_a_client_leaving_a_plain_request_is_aborted_at_once(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    engine = ScriptedEngine([(0.01, [token(0, 10 + i)]) for i in range(40)])
    with trio.move_on_after(0.105):
        await collect(make_server(engine), natural())
    assert recorder.final == "cancelled"
    assert engine.abort_times == [pytest.approx(0.105)]


# ---------------------------------------------------- issue 14 item 2: tokens sent before a terminal error arrive


async def test_tokens_in_the_batch_of_a_terminal_error_reach_the_client_before_the_error(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    """Failed before: the error discarded the 4 tokens mapped from its own batch; the client saw no text."""
    batch = [token(0, 10), token(0, 11), token(0, 12), token(0, 13), error(error_pb2.ERROR_CODE_INTERNAL, False)]
    engine = ScriptedEngine([(0.0, batch)])
    seen: list[dict[str, Any]] = []

    async def client() -> None:
        async for chunks in serve(make_server(engine), natural(), RequestContext(request_id=RID)):
            seen.extend(chunks)

    with pytest.raises(EngineFailure):
        await client()
    assert [c["token_ids"] for c in seen] == [[10, 11, 12, 13]]
    assert recorder.events == [("submit", "submitted"), ("first_token", "streaming"), ("fail", "failed")]
    assert engine.aborts == []


# ------------------------------------------------------------- issue 15 item 3: one line per request at its end


async def test_each_request_ends_with_one_info_line(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    engine = ScriptedEngine([(0.01, [token(0, 10)]), (0.01, [token(0, 11), finished(0)])])
    with caplog.at_level(logging.INFO, logger="sidecar.requests"):
        await collect(make_server(engine), request())
    lines = [r for r in caplog.records if r.name == "sidecar.requests"]
    assert [r.levelno for r in lines] == [logging.INFO]
    assert re.fullmatch(
        r"request req-1 finished \(length\): 3 in / 2 out tokens, TTFT \d+ ms, \d+ ms", lines[0].getMessage()
    )


@pytest.mark.parametrize(
    ("script", "outcome", "level"),
    [
        ([(0.01, [token(0, 10)]), (60.0, [finished(0)])], "cancelled (stopped by the client)", logging.INFO),
        (
            [(0.01, [token(0, 10)]), (0.01, EngineRpcError("Generate", GrpcCode.UNAVAILABLE, "connection reset"))],
            "failed (Generate: UNAVAILABLE",
            logging.WARNING,
        ),
    ],
    ids=["client gone", "engine lost"],
)
async def test_an_expected_failure_is_one_line_without_a_traceback(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    script: list[Step],
    outcome: str,
    level: int,
) -> None:
    with caplog.at_level(logging.INFO, logger="sidecar.requests"), trio.move_on_after(1.0), suppress(EngineRpcError):
        await collect(make_server(ScriptedEngine(script)), request())
    lines = [r for r in caplog.records if r.name == "sidecar.requests"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].getMessage().startswith(f"request req-1 {outcome}")
    assert lines[0].levelno == level
    assert lines[0].exc_info is None


async def test_a_drain_deadline_is_one_line(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    engine = ScriptedEngine([(0.01, [token(0, 10)]), (60.0, [finished(0)])])
    server = make_server(engine)
    with caplog.at_level(logging.INFO, logger="sidecar.requests"):
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                with suppress(WorkerDraining):
                    await collect(server, request())

            nursery.start_soon(run)
            # Virtual time (autojump_clock): the request is a second into its stream, deterministically.
            await trio.sleep(1.0)
            server.cancel_all(WorkerDraining("drain deadline: retry on another worker"))
    [line] = [r for r in caplog.records if r.name == "sidecar.requests"]
    assert line.getMessage().startswith("request req-1 cancelled (drain deadline: retry on another worker)")
    assert line.exc_info is None


# ------------------------------------------------------ issue 14 item 4: a hung engine costs one timeout, not four


async def test_an_engine_not_producing_makes_the_worker_withdraw_before_the_error_is_raised(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine([(0.01, [token(0, 10)]), (0.0, None)])
    server = make_server(engine, inactivity=3.0)
    order: list[str] = []

    async def withdraw(reason: str) -> None:
        await trio.sleep(0.1)  # virtual time: the withdrawal takes a moment, the error must still wait for it
        order.append(f"withdrawn: {reason}")

    server.on_stall = withdraw

    async def client() -> None:
        try:
            await collect(server, request())
        finally:
            order.append("error raised")

    with pytest.raises(HungEngine):
        await client()
    assert order[1] == "error raised"
    assert order[0].startswith("withdrawn: engine not producing: nothing from the engine for 3s")


async def test_an_engine_that_never_sent_a_token_is_reported_as_such_not_as_silent_for_infs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 27 item 9: before the first token ever, the silence has no start; the report said "for infs"."""
    engine = ScriptedEngine([(0.0, None)])
    server = make_server(engine, inactivity=3.0)
    reasons: list[str] = []

    async def withdraw(reason: str) -> None:
        reasons.append(reason)

    server.on_stall = withdraw
    with pytest.raises(HungEngine):
        await collect(server, request())
    (reason,) = reasons
    assert reason.startswith("engine not producing: no token ever received from the engine ("), reason
    assert "inf" not in reason.split("(")[0]


class ByRequest:
    """One engine client whose requests each play their own script (chosen by request id)."""

    def __init__(self, engines: dict[str, ScriptedEngine]) -> None:
        self.engines = engines

    @property
    def edge(self) -> Any:
        return next(iter(self.engines.values())).edge

    def start_generate(
        self, request: pb.GenerateRequest, sink: Any, *, metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        self.engines[request.request_id].start_generate(request, sink, metadata=metadata)

    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> Any:
        return await self.engines[request_id].abort(request_id)


async def test_a_stuck_request_while_others_get_tokens_does_not_withdraw_the_worker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stuck = ScriptedEngine([(0.01, [token(0, 10)]), (0.0, None)])
    flowing = ScriptedEngine([(0.5, [token(0, 1)]) for _ in range(20)] + [(0.5, [finished(0, usage=(3, 20))])])
    server = RequestServer()
    server.attach(serving(ByRequest({RID: stuck, "req-2": flowing}), inactivity=3.0))
    calls: list[str] = []

    async def withdraw(reason: str) -> None:
        calls.append(reason)

    server.on_stall = withdraw
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(collect, server, request(max_tokens=40), request_id="req-2"))
        with pytest.raises(HungEngine):
            await collect(server, request())
    assert calls == [], "the engine produced for the other request: only this one is stuck"
