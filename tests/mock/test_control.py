"""Control RPCs: discovery, load, health, abort, client cancellation, LoRA and the unimplemented KV-event RPCs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from grpclib.client import Channel
from grpclib.const import Status

from openengine.v1 import (
    generation_pb2,
    kv_pb2,
    lifecycle_pb2,
    lora_pb2,
    model_pb2,
    openengine_grpc,
    server_pb2,
)
from sidecar.testing.mock.config import SCHEMA_RELEASE_FULL, SCHEMA_RELEASE_PREFIX

from ._client import Outcome, abort, call, generate, get_load, make_request, new_id, status_of, wait_for_load
from .conftest import StartMock


def control(ch: Channel) -> openengine_grpc.ControlStub:
    return openengine_grpc.ControlStub(ch)


def test_server_info_defaults(addr: str) -> None:
    info = call(addr, lambda ch: control(ch).GetServerInfo(server_pb2.GetServerInfoRequest()))
    assert info.engine_name == "openengine-mock"
    assert info.engine_version
    assert info.engine_role == server_pb2.ENGINE_ROLE_AGGREGATED
    assert info.instance_id.startswith("openengine-mock-")
    assert list(info.supported_models) == ["tiny-oe"]
    assert (info.schema_revision, info.minimum_client_revision) == (1, 1)
    assert info.schema_release == SCHEMA_RELEASE_FULL
    p = info.parallelism
    assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.data_parallel_size) == (1, 1, 1)
    c = info.capacity
    assert (c.kv_block_size, c.total_kv_blocks, c.max_running_requests, c.max_batched_tokens) == (16, 4096, 256, 8192)
    assert not c.HasField("max_loras")
    assert not info.HasField("kv_connector")


@pytest.mark.parametrize(
    ("flag", "expected"),
    [("prefix", SCHEMA_RELEASE_PREFIX), ("empty", ""), ("b5f2bd9", "b5f2bd9")],
)
def test_schema_release_forms_and_role(start_mock: StartMock, flag: str, expected: str) -> None:
    mock = start_mock(
        "--schema-release",
        flag,
        "--role",
        "unspecified",
        "--served-model-name",
        "m",
        "--model-alias",
        "m2",
        "--instance-id",
        "inst-1",
    )
    info = call(mock.address, lambda ch: control(ch).GetServerInfo(server_pb2.GetServerInfoRequest()))
    assert info.schema_release == expected
    assert info.engine_role == server_pb2.ENGINE_ROLE_UNSPECIFIED
    assert list(info.supported_models) == ["m", "m2"]
    assert info.instance_id == "inst-1"


def test_model_info_defaults_and_not_found(addr: str) -> None:
    async def run(ch: Channel) -> tuple[model_pb2.ModelInfo, model_pb2.ModelInfo, tuple[Status, str | None]]:
        named = await control(ch).GetModelInfo(model_pb2.GetModelInfoRequest(model="tiny-oe"))
        default = await control(ch).GetModelInfo(model_pb2.GetModelInfoRequest())
        missing = await status_of(control(ch).GetModelInfo(model_pb2.GetModelInfoRequest(model="nope")))
        return named, default, missing

    info, default, missing = call(addr, run)
    assert info == default, "an empty model name means the served model (as TensorRT-LLM)"
    assert missing[0] == Status.NOT_FOUND
    assert (info.model_id, info.served_model_name) == ("tiny-oe", "tiny-oe")
    assert info.max_context_length == 2048
    assert not info.HasField("max_output_tokens")
    assert info.supports_text_input
    assert info.supports_token_ids_input
    assert info.HasField("supports_lora")
    assert not info.supports_lora
    assert not info.supports_multimodal
    g = info.generation
    for caps in (g.prompt_logprobs, g.output_logprobs):
        assert caps.supported
        assert list(caps.candidate_selection_modes) == [model_pb2.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N]
        assert caps.max_top_n == 20
    assert g.guided_decoding.HasField("supported")
    assert not g.guided_decoding.supported
    assert g.max_num_sequences == 4
    assert (g.supports_priority, g.supports_stop_in_output, g.supports_cache_salt) == (False, True, True)
    assert g.HasField("supports_prefix_cache_bypass")
    assert not g.supports_prefix_cache_bypass


def test_capability_flags_change_model_info(start_mock: StartMock) -> None:
    mock = start_mock(
        "--capability",
        "priority=true",
        "--capability",
        "lora=true",
        "--capability",
        "text_input=false",
        "--capability",
        "output_logprobs=false",
        "--max-output-tokens",
        "100",
        "--max-top-n",
        "5",
    )
    info = call(mock.address, lambda ch: control(ch).GetModelInfo(model_pb2.GetModelInfoRequest(model="tiny-oe")))
    assert info.generation.supports_priority
    assert info.supports_lora
    assert not info.supports_text_input
    assert not info.generation.output_logprobs.supported
    assert info.generation.prompt_logprobs.max_top_n == 5
    assert info.max_output_tokens == 100
    out = call(mock.address, lambda ch: generate(ch, make_request(prompt="The river")))
    assert (out.status, out.messages) == (Status.UNIMPLEMENTED, [])


def test_get_load_reports_running_work_and_kv(addr: str) -> None:
    rid = new_id("load")

    async def run(ch: Channel) -> tuple[server_pb2.LoadInfo, server_pb2.LoadInfo]:
        task = asyncio.create_task(generate(ch, make_request(rid, mock={"hang_after_tokens": 3})))
        busy = await wait_for_load(ch, lambda load: load.running_requests >= 1)
        per_rank = await get_load(ch, per_rank=True)
        await abort(ch, rid)
        await task
        idle = await wait_for_load(ch, lambda load: load.running_requests == 0)
        assert per_rank.ranks[0].data_parallel_rank == 0
        assert per_rank.ranks[0].running_requests >= 1
        return busy, idle

    busy, idle = call(addr, run)
    assert busy.instance_id.startswith("openengine-mock-")
    assert busy.timestamp_unix_nanos > 0
    assert busy.used_kv_blocks >= 1
    assert busy.total_kv_blocks == 4096
    assert busy.running_tokens >= 3
    assert busy.HasField("queued_requests")
    assert busy.HasField("active_kv_sessions")
    assert idle.used_kv_blocks == 0
    assert idle.running_requests == 0


def test_health_ready_with_probe(addr: str) -> None:
    resp = call(addr, lambda ch: control(ch).Health(lifecycle_pb2.HealthRequest(include_inference_probe=True)))
    assert resp.state == lifecycle_pb2.HEALTH_STATE_READY
    assert [c.name for c in resp.checks] == ["grpc", "model", "inference_probe"]
    assert all(c.state == lifecycle_pb2.HEALTH_STATE_READY for c in resp.checks)


@pytest.mark.parametrize(
    ("flag", "state"),
    [("not_ready", lifecycle_pb2.HEALTH_STATE_NOT_READY), ("degraded", lifecycle_pb2.HEALTH_STATE_DEGRADED)],
)
def test_forced_health(start_mock: StartMock, flag: str, state: int) -> None:
    mock = start_mock("--profile", "full", "--health", flag)
    resp = call(mock.address, lambda ch: control(ch).Health(lifecycle_pb2.HealthRequest()))
    assert resp.state == state
    assert {c.name: c.state for c in resp.checks} == {"grpc": lifecycle_pb2.HEALTH_STATE_READY, "model": state}


def test_abort_targets(addr: str) -> None:
    async def run(ch: Channel) -> list[tuple[Status, str | None]]:
        stub = control(ch)
        none = await status_of(stub.Abort(lifecycle_pb2.AbortRequest()))
        session = lifecycle_pb2.AbortRequest()
        session.kv_session.session_id = "1"
        kv = await status_of(stub.Abort(session))
        empty = await status_of(stub.Abort(lifecycle_pb2.AbortRequest(request_id="")))
        return [none, kv, empty]

    none, kv, empty = call(addr, run)
    assert none[0] == Status.INVALID_ARGUMENT
    assert kv[0] == Status.UNIMPLEMENTED
    assert empty[0] == Status.INVALID_ARGUMENT
    unknown = call(addr, lambda ch: abort(ch, "never-seen"))
    assert unknown.status == lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED


def test_abort_all_requests(addr: str) -> None:
    async def run(ch: Channel) -> tuple[lifecycle_pb2.AbortResponse, lifecycle_pb2.AbortResponse, list[int]]:
        tasks = [
            asyncio.create_task(generate(ch, make_request(mock={"hang_after_tokens": 0}, max_tokens=4)))
            for _ in range(3)
        ]
        await wait_for_load(ch, lambda load: load.running_requests >= 3)
        first = await abort(ch, all_requests=True)
        outs = await asyncio.gather(*tasks)
        second = await abort(ch, all_requests=True)
        return first, second, [len(o.finished()) for o in outs]

    first, second, finished = call(addr, run)
    assert first.status == lifecycle_pb2.ABORT_STATUS_ABORTED
    assert first.message == "aborted 3 request(s)"
    assert second.status == lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED
    assert finished == [1, 1, 1]


def test_client_cancel_frees_the_request(addr: str) -> None:
    rid = new_id("cancel")

    async def run(ch: Channel) -> tuple[server_pb2.LoadInfo, float]:
        stub = openengine_grpc.InferenceStub(ch)
        async with stub.Generate.open() as stream:
            await stream.send_message(
                make_request(rid, max_tokens=1000, ignore_eos=True, mock={"hang_after_tokens": 5}), end=True
            )
            for _ in range(5):
                await stream.recv_message()
            await stream.cancel()
        loop = asyncio.get_running_loop()
        started = loop.time()
        load = await wait_for_load(ch, lambda load: load.running_requests == 0, timeout=5.0)
        return load, loop.time() - started

    load, elapsed = call(addr, run)
    assert load.used_kv_blocks == 0
    assert elapsed < 2.0
    # The id is free again.
    out = call(addr, lambda ch: generate(ch, make_request(rid, max_tokens=2)))
    assert out.status == Status.OK


_HANGING_CLIENT = """
import sys
from tests.mock._client import call, generate, make_request
call(sys.argv[1], lambda ch: generate(ch, make_request(max_tokens=100, mock={"hang_after_tokens": 3})), timeout=60)
"""


def test_client_disconnect_frees_the_request(addr: str) -> None:
    client = subprocess.Popen([sys.executable, "-c", _HANGING_CLIENT, addr], cwd=Path(__file__).parents[2])
    try:
        call(addr, lambda ch: wait_for_load(ch, lambda load: load.running_requests >= 1, timeout=20), timeout=30)
    finally:
        client.kill()
        client.wait(10)
    load = call(addr, lambda ch: wait_for_load(ch, lambda load: load.running_requests == 0, timeout=5))
    assert load.used_kv_blocks == 0


def test_kv_event_rpcs_are_unimplemented_as_trt_baseline(start_mock: StartMock) -> None:
    addr = start_mock("--kv-events", "unimplemented").address

    async def run(ch: Channel) -> list[tuple[Status, str | None]]:
        stub = control(ch)
        sources = await status_of(stub.GetKvEventSources(kv_pb2.GetKvEventSourcesRequest()))

        async def subscribe() -> None:
            async with stub.SubscribeKvEvents.open() as stream:
                await stream.send_message(kv_pb2.SubscribeKvEventsRequest(), end=True)
                async for _ in stream:
                    pass

        return [sources, await status_of(subscribe())]

    assert [s for s, _ in call(addr, run)] == [Status.UNIMPLEMENTED, Status.UNIMPLEMENTED]


def test_lora_rpcs_unimplemented_by_default(addr: str) -> None:
    async def run(ch: Channel) -> list[Status]:
        stub = control(ch)
        return [
            (await status_of(stub.ListLoras(lora_pb2.ListLorasRequest())))[0],
            (await status_of(stub.LoadLora(lora_pb2.LoadLoraRequest())))[0],
            (await status_of(stub.UnloadLora(lora_pb2.UnloadLoraRequest(lora_name="x"))))[0],
        ]

    assert call(addr, run) == [Status.UNIMPLEMENTED] * 3


def test_lora_lifecycle(start_mock: StartMock, tmp_path: os.PathLike[str]) -> None:
    mock = start_mock("--profile", "full", "--capability", "lora=true", "--max-loras", "1")
    path = os.fspath(tmp_path)

    async def run(ch: Channel) -> None:
        stub = control(ch)
        adapter = lora_pb2.LoraAdapter(lora_id=1, lora_name="poet", source_path=path)
        first = await stub.LoadLora(lora_pb2.LoadLoraRequest(adapter=adapter))
        assert not first.already_loaded
        again = await stub.LoadLora(lora_pb2.LoadLoraRequest(adapter=adapter))
        assert again.already_loaded
        clash = lora_pb2.LoraAdapter(lora_id=2, lora_name="poet", source_path=path)
        assert (await status_of(stub.LoadLora(lora_pb2.LoadLoraRequest(adapter=clash))))[0] == Status.ALREADY_EXISTS
        other = lora_pb2.LoraAdapter(lora_id=3, lora_name="other", source_path="/")
        assert (await status_of(stub.LoadLora(lora_pb2.LoadLoraRequest(adapter=other))))[0] == (
            Status.RESOURCE_EXHAUSTED
        )
        bad = lora_pb2.LoraAdapter(lora_id=0, lora_name="zero", source_path=path)
        assert (await status_of(stub.LoadLora(lora_pb2.LoadLoraRequest(adapter=bad))))[0] == Status.INVALID_ARGUMENT
        relative = lora_pb2.LoraAdapter(lora_id=4, lora_name="rel", source_path="adapters/x")
        assert (await status_of(stub.LoadLora(lora_pb2.LoadLoraRequest(adapter=relative))))[0] == (
            Status.INVALID_ARGUMENT
        )
        listed = await stub.ListLoras(lora_pb2.ListLorasRequest())
        assert [a.lora_name for a in listed.adapters] == ["poet"]

        base = await generate(ch, make_request(temperature=0.0, max_tokens=30, ignore_eos=True))
        lora_req = make_request(temperature=0.0, max_tokens=30, ignore_eos=True)
        lora_req.lora_name = "poet"
        with_lora = await generate(ch, lora_req)
        assert with_lora.status == Status.OK
        assert with_lora.tokens() != base.tokens(), "an adapter changes the text"
        unknown = make_request(max_tokens=2)
        unknown.lora_name = "missing"
        assert (await generate(ch, unknown)).status == Status.NOT_FOUND

        unloaded = await stub.UnloadLora(lora_pb2.UnloadLoraRequest(lora_name="poet"))
        assert unloaded.adapter.lora_id == 1
        assert (await status_of(stub.UnloadLora(lora_pb2.UnloadLoraRequest(lora_name="poet"))))[0] == Status.NOT_FOUND
        assert not (await stub.ListLoras(lora_pb2.ListLorasRequest())).adapters

    call(mock.address, run)
    info = call(mock.address, lambda ch: control(ch).GetServerInfo(server_pb2.GetServerInfoRequest()))
    assert info.capacity.max_loras == 1


def test_disaggregated_roles(start_mock: StartMock) -> None:
    prefill = start_mock("--profile", "full", "--role", "prefill")
    decode = start_mock("--profile", "full", "--role", "decode")

    async def on_prefill(ch: Channel) -> tuple[Outcome, Outcome, server_pb2.ServerInfo]:
        plain = await generate(ch, make_request(max_tokens=4))
        ctx = await generate(ch, make_request(max_tokens=1, extra={"request_type": "context_only"}))
        info = await control(ch).GetServerInfo(server_pb2.GetServerInfoRequest())
        return plain, ctx, info

    plain, ctx, info = call(prefill.address, on_prefill)
    assert plain.status == Status.FAILED_PRECONDITION
    assert ctx.events == ["token", "prefill_ready"]
    assert info.engine_role == server_pb2.ENGINE_ROLE_PREFILL
    assert info.kv_connector.enabled
    assert info.kv_connector.transfer_backend == "MOCK"
    assert not info.kv_connector.supports_abort_cleanup
    session = ctx.final.prefill_ready.kv_session

    async def on_decode(ch: Channel) -> tuple[Outcome, Outcome]:
        plain = await generate(ch, make_request(max_tokens=4))
        req = make_request(max_tokens=4)
        req.kv.session.CopyFrom(session)
        return plain, await generate(ch, req)

    plain, dec = call(decode.address, on_decode)
    assert plain.status == Status.FAILED_PRECONDITION
    assert dec.status == Status.OK
    assert dec.finished()[0].reason in (
        generation_pb2.FINISH_REASON_STOP,
        generation_pb2.FINISH_REASON_LENGTH,
    )


def test_mock_stats_count_request_features(start_mock: StartMock) -> None:
    from sidecar.testing.mock.structs import struct_to_dict

    mock = start_mock("--profile", "full", "--capability", "priority=true", "--capability", "guided=true")
    salted = make_request(max_tokens=2)
    salted.kv.cache_salt = "tenant-a"
    guided = make_request(max_tokens=8)
    guided.guided.choice.choices.extend(["yes", "no"])
    prompt_lp = make_request(max_tokens=2)
    prompt_lp.response.return_prompt_logprobs = True
    prompt_lp.response.prompt_candidates.top_n = 1

    async def run(ch: Channel) -> list[Outcome]:
        return [
            await generate(ch, make_request(max_tokens=2), metadata=[("openengine-priority", "-3")]),
            await generate(ch, salted),
            await generate(ch, guided),
            await generate(ch, prompt_lp),
        ]

    outcomes = call(mock.address, run)
    assert [o.status for o in outcomes] == [Status.OK] * 4
    assert outcomes[2].text() in ("yes", "no")
    info = call(mock.address, lambda ch: control(ch).GetServerInfo(server_pb2.GetServerInfoRequest()))
    stats = struct_to_dict(info.extra)["mock_stats"]
    assert isinstance(stats, dict)
    assert (stats["priority_requests"], stats["last_priority"]) == (1, -3)
    assert (stats["cache_salt_requests"], stats["guided_requests"], stats["prompt_logprobs_requests"]) == (1, 1, 1)
