"""The request task's disaggregated flows (``sidecar.requests``) in virtual time against a scripted engine.

The deferral: a decode leg carrying a handoff ignores the client's stop until the engine's first response (the KV
transfer landed), then aborts; the worker's own cancellation ("engine shutdown") is never deferred.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from openengine.v1 import error_pb2
from openengine.v1 import generation_pb2 as pb
from openengine_bp.openengine.v1 import EngineRole, KvConnectorInfo
from sidecar.convert import Capabilities
from sidecar.convert.capabilities import KvConnector
from sidecar.convert.handoff import session_to_handoff
from sidecar.dynamo import RequestContext
from sidecar.errors import DynamoErrorKind, EngineFailure, HandoffMissing, WorkerDraining
from sidecar.requests import HungEngine, RequestServer, ServingContext
from tests.disagg.test_handoff import engine_session
from tests.helpers.scripted_engine import RID, Recorder, ScriptedEngine, Step, caps, collect, finished, serve, token

Clock = trio.testing.MockClock


def server(
    engine: ScriptedEngine, role: Any, *, inactivity: float = 30.0, capabilities: Capabilities | None = None
) -> RequestServer:
    srv = RequestServer()
    srv.attach(
        ServingContext(
            client=engine,  # type: ignore[arg-type]
            caps=capabilities if capabilities is not None else caps(),
            model="tiny",
            context_length=256,
            abort_timeout_s=1.0,
            inactivity_timeout_s=inactivity,
            role=role,
        )
    )
    return srv


def decode_body(with_handoff: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 4}}
    if with_handoff:
        body["prefill_result"] = {
            "disaggregated_params": json.loads(json.dumps(session_to_handoff(engine_session()))),
            "prompt_tokens_details": {"cached_tokens": 1},
        }
    return body


def transfer_then_tokens(transfer_s: float) -> list[Step]:
    """The KV transfer takes ``transfer_s``; then the replayed first token, then more, slowly."""
    return [(transfer_s, [token(0, 1234)]), (60.0, [token(0, 11), finished(0)])]


async def stopped_client(srv: RequestServer, body: dict[str, Any], stop_after: float) -> tuple[list[Any], float]:
    """Run the request as a client that goes away after ``stop_after`` s; returns (chunks seen, end time)."""
    out: list[Any] = []
    with trio.move_on_after(stop_after):
        async for batch in serve(srv, body, RequestContext(request_id=RID)):
            out.extend(batch)
    return out, trio.current_time()


async def test_a_decode_with_a_handoff_ignores_a_client_stop_until_its_first_token_then_aborts(
    autojump_clock: Clock, recorder: Recorder
) -> None:
    engine = ScriptedEngine(transfer_then_tokens(5.0))
    srv = server(engine, "decode")
    start = trio.current_time()
    out, end = await stopped_client(srv, decode_body(), stop_after=1.0)
    assert out == [], "the client is gone: nothing is yielded"
    assert end - start == pytest.approx(5.0), "held until the KV transfer landed, not dropped at the stop"
    assert recorder.events == [
        ("submit_decode", "decoding"),
        ("defer", "cancel_deferred"),
        ("first_token", "cancelled"),
    ]
    assert engine.aborts == [RID], "then aborted on the engine"
    assert engine.stream_closed_early == 1
    assert engine.opened[0].kv.session == engine_session()
    assert srv.in_flight == 0


async def test_a_decode_without_a_stop_streams_normally_with_the_prefill_cache_hits(
    autojump_clock: Clock, recorder: Recorder
) -> None:
    engine = ScriptedEngine([(2.0, [token(0, 1234)]), (0.1, [token(0, 11), finished(0, usage=(3, 2))])])
    chunks = await collect(server(engine, "decode"), decode_body())
    assert [c["token_ids"] for c in chunks] == [[1234], [11]]
    assert chunks[-1]["completion_usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    assert recorder.events == [("submit_decode", "decoding"), ("first_token", "streaming"), ("finish", "finished")]
    assert engine.aborts == []


async def test_engine_shutdown_still_wins_over_the_deferral(autojump_clock: Clock, recorder: Recorder) -> None:
    engine = ScriptedEngine(transfer_then_tokens(30.0))
    srv = server(engine, "decode")
    caught: list[WorkerDraining] = []

    async def client() -> None:
        try:
            await collect(srv, decode_body())
        except WorkerDraining as exc:
            caught.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client)
        # Virtual time (autojump_clock): one second into the transfer, deterministically.
        await trio.sleep(1.0)
        assert srv.cancel_all(WorkerDraining("drain deadline")) == 1
    assert trio.current_time() == pytest.approx(1.0), "not deferred"
    assert len(caught) == 1
    assert caught[0].migratable
    assert recorder.events == [("submit_decode", "decoding"), ("cancel", "cancelled")]
    assert engine.aborts == [RID]


async def test_a_worker_cancel_ends_a_deferred_stop_at_once(autojump_clock: Clock, recorder: Recorder) -> None:
    engine = ScriptedEngine(transfer_then_tokens(30.0))
    srv = server(engine, "decode")

    async def client() -> None:
        with trio.move_on_after(1.0), pytest.raises(WorkerDraining):
            await collect(srv, decode_body())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client)
        # Virtual time (autojump_clock): past the client's 1 s, deterministically.
        await trio.sleep(2.0)
        assert recorder.final == "cancel_deferred"
        srv.cancel_all(WorkerDraining("engine lost"))
    assert trio.current_time() == pytest.approx(2.0)
    assert recorder.events[-1] == ("cancel", "cancelled")
    assert engine.aborts == [RID]


async def test_after_the_first_token_a_client_stop_aborts_at_once(autojump_clock: Clock, recorder: Recorder) -> None:
    engine = ScriptedEngine(transfer_then_tokens(0.5))
    out, end = await stopped_client(server(engine, "decode"), decode_body(), stop_after=1.0)
    assert [c["token_ids"] for c in out] == [[1234]]
    assert end == pytest.approx(1.0)
    assert recorder.events[-1] == ("cancel", "cancelled")
    assert engine.aborts == [RID]


async def test_a_decode_worker_request_without_a_handoff_is_not_deferred(
    autojump_clock: Clock, recorder: Recorder
) -> None:
    engine = ScriptedEngine(transfer_then_tokens(5.0))
    out, end = await stopped_client(server(engine, "decode"), decode_body(with_handoff=False), stop_after=1.0)
    assert out == []
    assert end == pytest.approx(1.0)
    assert recorder.events == [("submit", "submitted"), ("cancel", "cancelled")]
    assert not engine.opened[0].HasField("kv")
    assert engine.aborts == [RID]


async def test_the_deferral_is_bounded_by_the_inactivity_timeout(autojump_clock: Clock, recorder: Recorder) -> None:
    engine = ScriptedEngine([(0.0, None)])  # the transfer never lands
    srv = server(engine, "decode", inactivity=3.0)
    with trio.move_on_after(1.0), pytest.raises(HungEngine):
        await collect(srv, decode_body())
    assert trio.current_time() == pytest.approx(3.0)
    assert recorder.events == [("submit_decode", "decoding"), ("defer", "cancel_deferred"), ("fail", "failed")]
    assert engine.aborts == [RID]


async def test_an_engine_error_as_the_first_response_still_ends_a_deferred_stop(
    autojump_clock: Clock, recorder: Recorder
) -> None:
    error = pb.GenerateResponse(request_id=RID)
    error.error.code = error_pb2.ERROR_CODE_KV_TRANSFER_FAILED
    error.error.message = "transceiver down"
    error.usage.prompt_tokens = 3
    engine = ScriptedEngine([(2.0, [error])])
    out, _ = await stopped_client(server(engine, "decode"), decode_body(), stop_after=1.0)
    assert out == []
    # The first batch arrived (the deferred stop took effect) and the terminal error is not read after the stop.
    assert recorder.events[:2] == [("submit_decode", "decoding"), ("defer", "cancel_deferred")]
    assert recorder.final == "cancelled"


async def test_a_prefill_leg_hands_off_through_prefill_ready(autojump_clock: Clock, recorder: Recorder) -> None:
    ready = pb.GenerateResponse(request_id=RID)
    ready.prefill_ready.kv_session.CopyFrom(engine_session())
    ready.usage.prompt_tokens = 3
    ready.usage.completion_tokens = 1
    engine = ScriptedEngine([(0.1, [token(0, 1234)]), (0.0, [ready])])
    chunks = await collect(server(engine, "prefill"), {"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 1}})
    assert len(chunks) == 1
    assert chunks[0]["finish_reason"] == "length"
    assert chunks[0]["token_ids"] == []
    assert chunks[0]["disaggregated_params"]["session_id"] == "12"
    assert recorder.events == [
        ("submit", "submitted"),
        ("first_token", "streaming"),
        ("handoff", "prefill_ready"),
        ("finish", "finished"),
    ]
    assert engine.opened[0].extra.fields["request_type"].string_value == "context_only"
    assert engine.aborts == []


async def test_a_prefill_leg_without_a_handoff_fails_saying_why(autojump_clock: Clock, recorder: Recorder) -> None:
    engine = ScriptedEngine([(0.1, [token(0, 7), finished(0, reason=pb.FINISH_REASON_LENGTH)])])
    with pytest.raises(HandoffMissing, match="cache_transceiver_config"):
        await collect(server(engine, "prefill"), {"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 1}})
    assert recorder.final == "failed"


async def test_a_prefill_legitimate_early_stop_returns_its_tokens(autojump_clock: Clock, recorder: Recorder) -> None:
    engine = ScriptedEngine([(0.1, [token(0, 2), finished(0, reason=pb.FINISH_REASON_STOP, usage=(3, 1))])])
    chunks = await collect(server(engine, "prefill"), {"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 1}})
    assert [c["token_ids"] for c in chunks] == [[2]]
    assert chunks[-1]["finish_reason"] == "stop"
    assert "disaggregated_params" not in chunks[-1]
    assert recorder.final == "finished"


async def test_role_mismatch_from_the_engine_is_a_400_with_a_hint(autojump_clock: Clock) -> None:
    error = pb.GenerateResponse(request_id=RID)
    error.error.code = error_pb2.ERROR_CODE_ROLE_MISMATCH
    error.error.message = "this engine serves the decode role"
    error.usage.prompt_tokens = 3
    engine = ScriptedEngine([(0.0, [error])])
    with pytest.raises(EngineFailure) as caught:
        await collect(server(engine, "prefill"), {"token_ids": [5, 6, 7]})
    assert caught.value.kind is DynamoErrorKind.INVALID_ARGUMENT
    assert "check --disaggregation-mode against the engine's role" in caught.value.message


def test_the_role_defaults_to_what_the_engine_reports() -> None:
    engine = ScriptedEngine([])
    base = ServingContext(
        client=engine,  # type: ignore[arg-type]
        caps=caps(),
        model="tiny",
        context_length=256,
        abort_timeout_s=1.0,
        inactivity_timeout_s=5.0,
    )
    assert base.worker_role == "aggregated"  # the fake engine reports UNSPECIFIED (TensorRT-LLM does)
    assert dataclasses.replace(base, caps=dataclasses.replace(caps(), engine_role=EngineRole.DECODE)).worker_role == (
        "decode"
    )
    assert dataclasses.replace(base, role="prefill").worker_role == "prefill"


def caps_with_abort_cleanup() -> Capabilities:
    """The fake engine's capabilities with a KV connector that supports abort cleanup."""
    connector = KvConnectorInfo(
        enabled=True,
        transfer_backend="NIXL",
        supports_remote_prefill=True,
        supports_decode_pull=False,
        supports_abort_cleanup=True,
        schema_version=1,
    )
    base = caps()
    return dataclasses.replace(base, kv_connector=KvConnector.from_message(connector))


class CleanupPrefillEngine(ScriptedEngine):
    """A prefill engine with abort cleanup (``kv_connector.supports_abort_cleanup``): the KV session of a
    ``PrefillReady`` it sent stays held until a decode engine claims it or an ``Abort`` of its request frees it."""

    def __init__(self, script: list[Step]) -> None:
        super().__init__(script)
        #: Requests whose PrefillReady left this engine and whose KV session it still holds.
        self.sessions: set[str] = set()
        #: Every request whose PrefillReady left this engine, in order.
        self.handoffs: list[str] = []

    def start_generate(self, request: pb.GenerateRequest, sink: Any, *, metadata: Any = ()) -> None:
        def handed_off() -> None:
            self.handoffs.append(request.request_id)
            self.sessions.add(request.request_id)

        super().start_generate(request, _HandoffTap(sink, handed_off), metadata=metadata)

    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> Any:
        response = await super().abort(request_id, timeout_s=timeout_s)
        self.sessions.discard(request_id)  # the cleanup: the aborted request's KV session is released
        return response


class _HandoffTap:
    """The data path as the engine's stream sees it, noting when a ``PrefillReady`` goes out."""

    def __init__(self, sink: Any, on_handoff: Callable[[], None]) -> None:
        self._sink = sink
        self._on_handoff = on_handoff

    @property
    def on_cancel(self) -> Any:
        return self._sink.on_cancel

    @on_cancel.setter
    def on_cancel(self, value: Any) -> None:
        self._sink.on_cancel = value

    def push(self, items: list[pb.GenerateResponse]) -> bool:
        if any(item.WhichOneof("event") == "prefill_ready" for item in items):
            self._on_handoff()
        return bool(self._sink.push(items))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)


async def test_a_prefill_leg_stopped_after_its_prefill_ready_is_aborted_and_its_kv_session_freed(
    autojump_clock: Clock, recorder: Recorder
) -> None:
    """Rule: a prefill leg whose stream the frontend stops after the engine's ``PrefillReady`` arrived, but before the
    engine closed the stream (the handoff chunk waits for that end, so the frontend never got it), is cancelled and
    aborted like any stopped request: nobody will claim that KV session, and an engine with abort cleanup frees it
    on the Abort. A handed-off leg is not complete until its handoff reached the frontend."""
    ready = pb.GenerateResponse(request_id=RID)
    ready.prefill_ready.kv_session.CopyFrom(engine_session())
    ready.usage.prompt_tokens = 3
    ready.usage.completion_tokens = 1
    # The engine has not closed the stream yet after its terminal when the stop comes (1 s: within the path's 2 s EOF
    # grace, after which a lingering stream counts as ended).
    engine = CleanupPrefillEngine([(0.1, [token(0, 1234)]), (0.0, [ready]), (0.0, None)])
    srv = server(engine, "prefill", capabilities=caps_with_abort_cleanup())
    out, end = await stopped_client(srv, {"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 1}}, 1.0)
    assert out == [], "the handoff chunk never reached the frontend"
    assert end == pytest.approx(1.0)
    assert recorder.events == [("submit", "submitted"), ("first_token", "streaming"), ("cancel", "cancelled")]
    assert engine.handoffs == [RID], "precondition: the engine handed the leg off (its PrefillReady went out)"
    assert engine.aborts == [RID], "the handed-off leg is aborted after the stop"
    assert engine.stream_closed_early == 1
    assert engine.sessions == set(), "the engine holds no KV session afterwards"
    assert srv.in_flight == 0
