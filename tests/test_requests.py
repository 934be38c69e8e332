"""The request task (sidecar.requests) against an in-memory fake engine client, in virtual time.

Rules: every test uses ``autojump_clock`` (timeouts elapse instantly and deterministically); the fake client records
what the engine would have seen (opened streams, stream closes, aborts); each test asserts the request's terminal state.
"""

from __future__ import annotations

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
from sidecar.requests import CANARY_PAYLOAD, HungEngine, RequestServer, ServingContext
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
    token,
)

__all__ = ["recorder"]  # the fixture, imported for this module's tests


def serving(engine: ScriptedEngine, *, inactivity: float = 5.0) -> ServingContext:
    return ServingContext(
        client=engine,  # type: ignore[arg-type]
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
        async for batch in make_server(engine).handle(request(), RequestContext(request_id=RID)):
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


async def test_the_health_canary_is_answered_without_a_generation(autojump_clock: trio.testing.MockClock) -> None:
    engine = ScriptedEngine([])
    chunks = await collect(make_server(engine), dict(CANARY_PAYLOAD))
    assert chunks == [
        {
            "token_ids": [],
            "finish_reason": "stop",
            "completion_usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1},
        }
    ]
    assert engine.opened == []


async def test_trace_headers_reach_the_engine_metadata(autojump_clock: trio.testing.MockClock) -> None:
    engine = ScriptedEngine([(0.0, [token(0, 1), finished(0)])])
    server = make_server(engine)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ctx = RequestContext(request_id=RID, trace_headers={"traceparent": parent})
    async for _ in server.handle(request(), ctx):
        pass
    assert ("traceparent", parent) in engine.metadata[0]
