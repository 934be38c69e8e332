"""``openengine-mock``'s disaggregation across two processes: held KV sessions, claims, timeouts, refusals — the
``full`` engine (roles, MOCK connector with its endpoint, KV error codes, KV sessions in GetLoad); TensorRT-LLM's
behaviour is pinned in ``tests/mock/test_trtllm.py``."""

from __future__ import annotations

import asyncio

from grpclib.client import Channel

from openengine.v1 import error_pb2, generation_pb2, kv_pb2, openengine_grpc, server_pb2
from sidecar.testing.mock.structs import struct_to_dict
from tests.mock._client import Outcome, call, generate, get_load, make_request, split_address, wait_for_load
from tests.mock.conftest import StartMock

PROMPT = "The family arrived at the river"


def context_only(**kwargs: object) -> generation_pb2.GenerateRequest:
    return make_request(prompt=PROMPT, max_tokens=1, extra={"request_type": "context_only"}, seed=1, **kwargs)  # type: ignore[arg-type]


def decode_of(
    session: kv_pb2.KvSessionRef, prompt: str = PROMPT, max_tokens: int = 6
) -> generation_pb2.GenerateRequest:
    request = make_request(prompt=prompt, max_tokens=max_tokens, ignore_eos=True, seed=1)
    request.kv.session.CopyFrom(session)
    return request


def prefill(address: str) -> Outcome:
    outcome = call(address, lambda ch: generate(ch, context_only()))
    assert outcome.events == ["token", "prefill_ready"], outcome
    return outcome


def load(address: str) -> server_pb2.LoadInfo:
    return call(address, get_load)


def stats(address: str) -> dict[str, float]:
    info = call(address, lambda ch: openengine_grpc.ControlStub(ch).GetServerInfo(server_pb2.GetServerInfoRequest()))
    value = struct_to_dict(info.extra).get("mock_stats") or {}
    assert isinstance(value, dict)
    return {k: v for k, v in value.items() if isinstance(v, float)}


def error_of(outcome: Outcome) -> generation_pb2.GenerateResponse:
    assert outcome.events[-1] == "error", outcome
    return outcome.final


def test_a_prefill_holds_its_blocks_until_the_decode_engine_claims_them(start_mock: StartMock) -> None:
    ctx = start_mock("--profile", "full", "--role", "prefill")
    gen = start_mock("--profile", "full", "--role", "decode")
    out = prefill(ctx.address)
    held = load(ctx.address)
    assert held.active_kv_sessions == 1
    assert held.used_kv_blocks > 0, "the session pins the prompt's blocks"
    assert held.running_requests == 0
    session = out.final.prefill_ready.kv_session
    kv_port = session.endpoints[0].port
    assert kv_port != split_address(ctx.address)[1], "the transfer channel is the mock's own listener"
    assert struct_to_dict(session.attributes_struct)["ctx_info_endpoint"] == f"tcp://127.0.0.1:{kv_port}"

    decoded = call(gen.address, lambda ch: generate(ch, decode_of(session)))
    assert decoded.events[-1] == "finished"
    assert decoded.tokens()[0] == out.tokens()[0], "the decode leg replays the first token"
    assert len(decoded.tokens()) == 6
    after = load(ctx.address)
    assert after.active_kv_sessions == 0
    assert after.used_kv_blocks == 0
    assert load(gen.address).active_kv_sessions == 0
    assert stats(ctx.address)["kv_sessions_claimed"] == 1
    assert stats(ctx.address)["prefill_legs"] == 1
    assert stats(gen.address)["decode_legs"] == 1


def test_a_claimed_session_cannot_be_claimed_again(start_mock: StartMock) -> None:
    ctx = start_mock("--profile", "full", "--role", "prefill")
    gen = start_mock("--profile", "full", "--role", "decode")
    session = prefill(ctx.address).final.prefill_ready.kv_session
    assert call(gen.address, lambda ch: generate(ch, decode_of(session))).events[-1] == "finished"
    again = error_of(call(gen.address, lambda ch: generate(ch, decode_of(session))))
    assert again.error.code == error_pb2.ERROR_CODE_KV_SESSION_NOT_FOUND
    assert "already claimed" in again.error.message
    assert again.HasField("usage")
    assert load(gen.address).running_requests == 0


def test_an_unknown_session_is_not_found(start_mock: StartMock) -> None:
    ctx = start_mock("--profile", "full", "--role", "prefill")
    gen = start_mock("--profile", "full", "--role", "decode")
    session = kv_pb2.KvSessionRef()
    session.CopyFrom(prefill(ctx.address).final.prefill_ready.kv_session)
    session.session_id = "999"
    failed = error_of(call(gen.address, lambda ch: generate(ch, decode_of(session))))
    assert failed.error.code == error_pb2.ERROR_CODE_KV_SESSION_NOT_FOUND
    assert "unknown" in failed.error.message
    assert load(ctx.address).active_kv_sessions == 1, "the real session is still held"


def test_an_unclaimed_session_expires_and_then_is_not_found(start_mock: StartMock) -> None:
    ctx = start_mock("--profile", "full", "--role", "prefill", "--kv-session-timeout", "0.3")
    gen = start_mock("--profile", "full", "--role", "decode")
    session = prefill(ctx.address).final.prefill_ready.kv_session
    call(
        ctx.address,
        lambda ch: wait_for_load(ch, lambda load: load.active_kv_sessions == 0 and load.used_kv_blocks == 0),
    )
    assert stats(ctx.address)["kv_sessions_expired"] == 1
    failed = error_of(call(gen.address, lambda ch: generate(ch, decode_of(session))))
    assert failed.error.code == error_pb2.ERROR_CODE_KV_SESSION_NOT_FOUND
    assert "expired" in failed.error.message


def test_a_decode_with_another_prompt_fails_the_transfer(start_mock: StartMock) -> None:
    ctx = start_mock("--profile", "full", "--role", "prefill")
    gen = start_mock("--profile", "full", "--role", "decode")
    session = prefill(ctx.address).final.prefill_ready.kv_session
    failed = error_of(call(gen.address, lambda ch: generate(ch, decode_of(session, prompt="Something else"))))
    assert failed.error.code == error_pb2.ERROR_CODE_KV_TRANSFER_FAILED
    assert "full prompt" in failed.error.message
    assert load(ctx.address).active_kv_sessions == 1


def test_an_unreachable_context_engine_fails_the_transfer(start_mock: StartMock) -> None:
    ctx = start_mock("--profile", "full", "--role", "prefill")
    gen = start_mock("--profile", "full", "--role", "decode")
    session = prefill(ctx.address).final.prefill_ready.kv_session
    ctx.stop()
    failed = error_of(call(gen.address, lambda ch: generate(ch, decode_of(session))))
    assert failed.error.code == error_pb2.ERROR_CODE_KV_TRANSFER_FAILED
    assert "cannot reach" in failed.error.message


def test_a_decode_dropped_mid_transfer_leaves_the_session_held(start_mock: StartMock) -> None:
    ctx = start_mock("--profile", "full", "--role", "prefill", "--speedup", "1", "--kv-transfer-ms", "1500")
    gen = start_mock("--profile", "full", "--role", "decode")
    session = prefill(ctx.address).final.prefill_ready.kv_session
    request = decode_of(session)

    async def dropped(ch: Channel) -> server_pb2.LoadInfo:
        task = asyncio.create_task(generate(ch, request))
        await wait_for_load(ch, lambda load: load.active_kv_sessions == 1)  # the decode engine is pulling
        await asyncio.sleep(0.2)  # not a synchronisation: the transfer runs a while (pulling is waited for above)
        task.cancel()  # the client goes away: the RPC is cancelled, the decode engine drops the transfer
        return await wait_for_load(ch, lambda load: load.running_requests == 0 and load.active_kv_sessions == 0)

    call(gen.address, dropped)
    assert load(ctx.address).active_kv_sessions == 1, "stranded: nobody will claim it (the sidecar defers for this)"
    # It can still be claimed by a decode leg that waits for the transfer.
    assert call(gen.address, lambda ch: generate(ch, decode_of(session))).events[-1] == "finished"
    assert load(ctx.address).active_kv_sessions == 0


def test_a_first_token_that_stops_is_the_whole_answer_without_a_handoff(start_mock: StartMock) -> None:
    ctx = start_mock("--profile", "full", "--role", "prefill")
    out = call(ctx.address, lambda ch: generate(ch, context_only(mock={"tokens": [4]})))  # 4 is an EOS id
    assert out.events == ["token", "finished"]
    assert out.finished()[0].reason == generation_pb2.FINISH_REASON_STOP
    assert load(ctx.address).active_kv_sessions == 0


def test_without_a_cache_transceiver_a_context_only_request_is_a_plain_generation(start_mock: StartMock) -> None:
    ctx = start_mock("--profile", "full", "--role", "prefill", "--no-cache-transceiver")
    out = call(ctx.address, lambda ch: generate(ch, context_only()))
    assert out.events == ["token", "finished"]
    assert out.finished()[0].reason == generation_pb2.FINISH_REASON_LENGTH
    info = call(
        ctx.address, lambda ch: openengine_grpc.ControlStub(ch).GetServerInfo(server_pb2.GetServerInfoRequest())
    )
    assert not info.HasField("kv_connector")


def test_the_connector_reports_the_transfer_endpoint(start_mock: StartMock) -> None:
    ctx = start_mock("--profile", "full", "--role", "prefill")
    info = call(
        ctx.address, lambda ch: openengine_grpc.ControlStub(ch).GetServerInfo(server_pb2.GetServerInfoRequest())
    )
    connector = info.kv_connector
    assert list(connector.supported_protocols) == ["tcp"]
    assert [(e.host, e.protocol) for e in connector.local_endpoints] == [("127.0.0.1", "tcp")]
    assert connector.local_endpoints[0].port > 0
