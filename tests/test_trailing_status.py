"""A status after the engine's terminal event (issue 36 §2): TensorRT-LLM's multi-frontend server can end a stream that
delivered every response with ``UNAVAILABLE`` (its coordinator failed during the request's final cleanup). The answer
is complete: finished, never failed, retried or migrated. In virtual time against the scripted engine (rules of
``tests/test_requests.py``); the same through the real frontend is ``tests/e2e/test_trtllm_newer.py``.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from openengine.v1 import generation_pb2 as pb
from sidecar.errors import EngineRpcError, GrpcCode
from tests.helpers.scripted_engine import Recorder, ScriptedEngine, collect, finished, recorder, token
from tests.test_requests import make_server, request

__all__ = ["recorder"]  # the fixture, imported for this module's tests

_TRAILING = EngineRpcError(
    "Generate", GrpcCode.UNAVAILABLE, "OpenEngine coordinator unavailable during request cleanup"
)


async def test_a_status_after_the_terminal_leaves_the_answer_finished(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    engine = ScriptedEngine([(0.01, [token(0, 10)]), (0.01, [token(0, 11), finished(0)]), (0.01, _TRAILING)])
    chunks = await collect(make_server(engine), request())
    assert [c["token_ids"] for c in chunks] == [[10], [11]]
    assert chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["completion_usage"]["completion_tokens"] == 2
    assert recorder.final == "finished"
    assert engine.aborts == [], "a finished request needs no Abort"


@pytest.mark.parametrize("code", [GrpcCode.UNAVAILABLE, GrpcCode.INTERNAL, GrpcCode.CANCELLED])
async def test_any_status_after_a_stop_terminal_is_still_the_complete_answer(
    autojump_clock: trio.testing.MockClock, recorder: Recorder, code: GrpcCode
) -> None:
    after = EngineRpcError("Generate", code, "after the terminal")
    engine = ScriptedEngine([(0.01, [token(0, 10), finished(0, pb.FINISH_REASON_STOP, (3, 1))]), (0.01, after)])
    chunks = await collect(make_server(engine), request())
    assert chunks[-1]["finish_reason"] == "stop"
    assert recorder.final == "finished"


async def test_the_same_status_before_the_terminal_still_fails_the_request(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    engine = ScriptedEngine([(0.01, [token(0, 10)]), (0.01, _TRAILING)])
    with pytest.raises(EngineRpcError) as caught:
        await collect(make_server(engine), request())
    assert caught.value.migratable, "an incomplete answer is the frontend's to migrate"
    assert recorder.final == "failed"
