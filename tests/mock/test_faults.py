"""Fault injection as ``docs/mock.md`` specifies: per request via ``extra["mock"]`` and engine-wide via flags."""

from __future__ import annotations

import asyncio

import pytest
from grpclib.client import Channel
from grpclib.const import Status

from openengine.v1 import error_pb2, generation_pb2, lifecycle_pb2, openengine_grpc
from sidecar.testing.mock.lm import TinyLM
from tests.helpers.waits import wait_until

from ._client import Outcome, call, generate, make_request, new_id, wait_for_load
from .conftest import StartMock


def test_reject_status(addr: str) -> None:
    req = make_request(mock={"reject_status": "RESOURCE_EXHAUSTED", "reject_message": "busy, try later"})
    out = call(addr, lambda ch: generate(ch, req))
    assert (out.status, out.details, out.messages) == (Status.RESOURCE_EXHAUSTED, "busy, try later", [])


@pytest.mark.parametrize("bad", ["OK", "NOT_A_STATUS", 3])
def test_reject_status_must_be_a_non_ok_status_name(addr: str, bad: object) -> None:
    out = call(addr, lambda ch: generate(ch, make_request(mock={"reject_status": bad})))
    assert (out.status, out.messages) == (Status.INVALID_ARGUMENT, [])


def test_error_after_tokens(addr: str) -> None:
    req = make_request(
        max_tokens=20, mock={"error_after_tokens": 3, "error_code": "OVERLOADED", "error_retryable": True}
    )
    out = call(addr, lambda ch: generate(ch, req))
    assert out.status == Status.OK
    assert out.events == ["token", "token", "token", "error"]
    err = out.final.error
    assert err.code == error_pb2.ERROR_CODE_OVERLOADED
    assert err.retryable
    assert err.message
    assert out.final.usage.completion_tokens == 3
    assert all(not m.HasField("usage") for m in out.messages[:-1])


def test_error_before_any_token_defaults_to_internal(addr: str) -> None:
    out = call(addr, lambda ch: generate(ch, make_request(mock={"error_after_tokens": 0})))
    assert out.events == ["error"]
    assert out.final.error.code == error_pb2.ERROR_CODE_INTERNAL
    assert not out.final.error.retryable
    assert out.final.usage.completion_tokens == 0
    assert out.status == Status.OK


def test_drop_after_tokens_loses_the_connection(addr: str) -> None:
    async def run(ch: Channel) -> tuple[Outcome, Outcome]:
        dropped = await generate(ch, make_request(max_tokens=20, ignore_eos=True, mock={"drop_after_tokens": 2}))
        await wait_for_load(ch, lambda load: load.running_requests == 0)  # the channel reconnects
        after = await generate(ch, make_request(max_tokens=2))
        return dropped, after

    dropped, after = call(addr, run)
    assert dropped.events == ["token", "token"]
    assert dropped.transport_error is not None or dropped.status not in (Status.OK,), dropped
    assert not any(m.WhichOneof("event") in ("finished", "error") for m in dropped.messages)
    assert after.status == Status.OK


def test_hang_before_first_message_counts_as_running_until_cancelled(addr: str) -> None:
    async def run(ch: Channel) -> tuple[int, int]:
        task = asyncio.create_task(generate(ch, make_request(mock={"hang_after_tokens": 0})))
        busy = await wait_for_load(ch, lambda load: load.running_requests >= 1)
        await asyncio.sleep(0.3)  # not a synchronisation: a negative check, the hung request does not end
        assert not task.done()
        task.cancel()
        idle = await wait_for_load(ch, lambda load: load.running_requests == 0)
        return busy.running_requests, idle.used_kv_blocks

    running, used = call(addr, run)
    assert running >= 1
    assert used == 0


def test_hang_after_tokens_then_abort(addr: str) -> None:
    rid = new_id("hang")

    async def run(ch: Channel) -> Outcome:
        from ._client import abort

        task = asyncio.create_task(generate(ch, make_request(rid, max_tokens=50, mock={"hang_after_tokens": 4})))
        await wait_for_load(ch, lambda load: load.running_requests >= 1)
        # The four tokens are out and the request hangs. Still a synchronisation by time: generate() returns only
        # at the stream's end and GetLoad does not count tokens (at the mock's default pace they take ~0.1 s).
        await asyncio.sleep(0.2)
        await abort(ch, rid)
        return await task

    out = call(addr, run)
    assert out.events == ["token"] * 4 + ["finished"]
    assert out.final.finished.reason == generation_pb2.FINISH_REASON_CANCELLED
    assert out.final.usage.completion_tokens == 4


def test_scripted_tokens(addr: str) -> None:
    lm = TinyLM.load()
    script = lm.encode(" hello there friend")
    out = call(addr, lambda ch: generate(ch, make_request(max_tokens=50, mock={"tokens": script})))
    assert out.tokens() == script
    assert out.text() == " hello there friend"
    assert out.final.finished.reason == generation_pb2.FINISH_REASON_LENGTH
    capped = call(addr, lambda ch: generate(ch, make_request(max_tokens=2, mock={"tokens": script})))
    assert capped.tokens() == script[:2]
    eos = call(addr, lambda ch: generate(ch, make_request(max_tokens=50, mock={"tokens": [*script[:1], 1, 5]})))
    assert eos.tokens() == [script[0], 1]
    assert eos.final.finished.stop_match.eos_token_id == 1


@pytest.mark.parametrize("bad", [[], [-1], [1.5], "1,2", [10**7]])
def test_scripted_tokens_validation(addr: str, bad: object) -> None:
    out = call(addr, lambda ch: generate(ch, make_request(mock={"tokens": bad})))
    assert (out.status, out.messages) == (Status.INVALID_ARGUMENT, [])


def _violation(addr: str, kind: str) -> Outcome:
    rid = new_id(kind)
    req = make_request(rid, max_tokens=3, ignore_eos=True, seed=1, mock={"violation": kind})
    out = call(addr, lambda ch: generate(ch, req))
    assert out.status == Status.OK
    return out


def test_violation_wrong_request_id(addr: str) -> None:
    out = _violation(addr, "wrong_request_id")
    assert out.messages[0].request_id != out.messages[1].request_id
    assert out.messages[1].request_id == out.final.request_id


def test_violation_event_after_terminal(addr: str) -> None:
    out = _violation(addr, "event_after_terminal")
    assert out.events == ["token"] * 3 + ["finished", "token"]
    assert out.messages[-2].HasField("usage")


def test_violation_missing_output_index(addr: str) -> None:
    out = _violation(addr, "missing_output_index")
    assert not any(m.token.HasField("output_index") for m in out.messages if m.WhichOneof("event") == "token")
    assert not out.final.finished.HasField("output_index")


def test_violation_usage_on_non_final(addr: str) -> None:
    out = _violation(addr, "usage_on_non_final")
    assert out.messages[0].HasField("usage")
    assert out.final.HasField("usage")


def test_violation_eof_before_terminal(addr: str) -> None:
    out = _violation(addr, "eof_before_terminal")
    assert out.events == ["token"] * 3
    assert not any(m.HasField("usage") for m in out.messages)


def test_violation_unspecified_finish(addr: str) -> None:
    out = _violation(addr, "unspecified_finish")
    assert out.final.finished.reason == generation_pb2.FINISH_REASON_UNSPECIFIED
    assert not out.final.finished.HasField("stop_match")


def test_unknown_violation_is_invalid(addr: str) -> None:
    out = call(addr, lambda ch: generate(ch, make_request(mock={"violation": "bogus"})))
    assert (out.status, out.messages) == (Status.INVALID_ARGUMENT, [])


def test_startup_delay_reports_starting_then_ready(start_mock: StartMock) -> None:
    mock = start_mock("--profile", "full", "--startup-delay", "3")

    async def run(ch: Channel) -> None:
        stub = openengine_grpc.ControlStub(ch)
        early = await stub.Health(lifecycle_pb2.HealthRequest())
        assert early.state == lifecycle_pb2.HEALTH_STATE_STARTING
        refused = await generate(ch, make_request(max_tokens=2))
        assert (refused.status, refused.messages) == (Status.UNAVAILABLE, [])

        async def ready() -> bool:
            return (await stub.Health(lifecycle_pb2.HealthRequest())).state == lifecycle_pb2.HEALTH_STATE_READY

        await wait_until(ready, timeout=10, interval=0.05)
        assert (await generate(ch, make_request(max_tokens=2))).status == Status.OK

    call(mock.address, run)


def test_fault_exit_after_requests(start_mock: StartMock) -> None:
    mock = start_mock("--fault-exit-after-requests", "2")
    first = call(mock.address, lambda ch: generate(ch, make_request(max_tokens=2)))
    assert first.status == Status.OK
    second = call(mock.address, lambda ch: generate(ch, make_request(max_tokens=2)))
    assert second.status != Status.OK
    assert second.messages == []
    assert mock.proc.wait(timeout=10) == 1
