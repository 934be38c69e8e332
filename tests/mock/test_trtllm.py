"""``--profile trtllm`` (the default) and ``trtllm-newer``: TensorRT-LLM's server as ``docs/mock.md``
describes it, one test per difference from the richer ``full`` engine (issue 22's list; the shutdown difference is in
``test_shutdown.py``). Where ``full`` differs, the same request against it is shown too."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from openengine.v1 import error_pb2, generation_pb2, kv_pb2, lifecycle_pb2, model_pb2, openengine_grpc, server_pb2
from sidecar.testing.mock.config import SCHEMA_RELEASE_FULL, SCHEMA_RELEASE_PREFIX
from sidecar.testing.mock.lm import TinyLM
from sidecar.testing.mock.structs import struct_to_dict

from ._client import Outcome, call, generate, get_load, make_request, status_of, wait_for_load
from .conftest import StartMock

#: A scripted output (``extra.mock.tokens``): " Alder carries leaves toward the coast." — fixed token ids, whatever
#: the model samples.
SENTENCE = " Alder carries leaves toward the coast."


@pytest.fixture(scope="module")
def lm() -> TinyLM:
    return TinyLM.load(None)


def control(ch: Channel) -> openengine_grpc.ControlStub:
    return openengine_grpc.ControlStub(ch)


def run(addr: str, req: generation_pb2.GenerateRequest, metadata: Sequence[tuple[str, str]] | None = None) -> Outcome:
    return call(addr, lambda ch: generate(ch, req, metadata=metadata))


def server_info(addr: str) -> server_pb2.ServerInfo:
    return call(addr, lambda ch: control(ch).GetServerInfo(server_pb2.GetServerInfoRequest()))


def model_info(addr: str, model: str = "tiny-oe") -> model_pb2.ModelInfo:
    return call(addr, lambda ch: control(ch).GetModelInfo(model_pb2.GetModelInfoRequest(model=model)))


def scripted(lm: TinyLM, text: str = SENTENCE, **kwargs: object) -> generation_pb2.GenerateRequest:
    ids = lm.encode(text)
    return make_request(max_tokens=len(ids) + 4, mock={"tokens": ids}, **kwargs)  # type: ignore[arg-type]


def set_fields(message: object) -> set[str]:
    return {field.name for field, _ in message.ListFields()}  # type: ignore[attr-defined]


# -- 2. GetLoad -----------------------------------------------------------------------------------------------------


def test_get_load_carries_only_running_requests_and_ignores_per_rank(trt_addr: str) -> None:
    async def run_load(ch: Channel) -> tuple[server_pb2.LoadInfo, server_pb2.LoadInfo]:
        hung = asyncio.create_task(generate(ch, make_request(max_tokens=40, mock={"hang_after_tokens": 1})))
        busy = await wait_for_load(ch, lambda load: load.running_requests == 1)
        per_rank = await get_load(ch, per_rank=True)
        hung.cancel()
        return busy, per_rank

    busy, per_rank = call(trt_addr, run_load)
    assert set_fields(busy) == {"instance_id", "timestamp_unix_nanos", "running_requests"}
    assert set_fields(per_rank) == {"instance_id", "timestamp_unix_nanos", "running_requests"}
    assert not per_rank.ranks


def test_newer_get_load_adds_kv_blocks_and_ranks(start_mock: StartMock) -> None:
    mock = start_mock("--profile", "trtllm-newer")
    load = call(mock.address, lambda ch: get_load(ch, per_rank=True))
    assert set_fields(load) == {
        "instance_id",
        "timestamp_unix_nanos",
        "running_requests",
        "used_kv_blocks",
        "total_kv_blocks",
        "ranks",
    }
    assert load.total_kv_blocks == 4096
    assert [r.data_parallel_rank for r in load.ranks] == [0]


# -- 3. KV events -----------------------------------------------------------------------------------------------------


async def _kv_rpcs(ch: Channel) -> tuple[tuple[Status, str | None], tuple[Status, str | None]]:
    stub = control(ch)
    sources = await status_of(stub.GetKvEventSources(kv_pb2.GetKvEventSourcesRequest()))

    async def subscribe() -> None:
        async with stub.SubscribeKvEvents.open() as stream:
            await stream.send_message(kv_pb2.SubscribeKvEventsRequest(), end=True)
            await stream.recv_message()

    return sources, await status_of(subscribe())


def test_kv_event_rpcs_are_unimplemented(trt_addr: str) -> None:
    sources, subscribe = call(trt_addr, _kv_rpcs)
    assert (sources[0], subscribe[0]) == (Status.UNIMPLEMENTED, Status.UNIMPLEMENTED)


def test_newer_lists_no_sources_until_configured_and_still_refuses_subscribe(start_mock: StartMock) -> None:
    """KV events are off unless TensorRT-LLM's kv_cache_config configures them: an empty list; configured (``--kv-events
    zmq``), one ZMQ/msgpack source per rank. ``SubscribeKvEvents`` is ``UNIMPLEMENTED`` either way."""
    unconfigured = start_mock("--profile", "trtllm-newer")
    sources, subscribe = call(unconfigured.address, _kv_rpcs)
    assert (sources[0], subscribe[0]) == (Status.OK, Status.UNIMPLEMENTED)
    empty = call(unconfigured.address, lambda ch: control(ch).GetKvEventSources(kv_pb2.GetKvEventSourcesRequest()))
    assert list(empty.sources) == []
    mock = start_mock("--profile", "trtllm-newer", "--kv-events", "zmq")
    subscribe = call(mock.address, _kv_rpcs)[1]
    assert subscribe[0] == Status.UNIMPLEMENTED
    sources = call(mock.address, lambda ch: control(ch).GetKvEventSources(kv_pb2.GetKvEventSourcesRequest()))
    assert [(s.transport, s.encoding, s.data_parallel_rank) for s in sources.sources] == [("zmq", "msgpack", 0)]


# -- 4, 12. Discovery -------------------------------------------------------------------------------------------------


def test_server_info_looks_like_tensorrt_llm(trt_addr: str) -> None:
    info = server_info(trt_addr)
    assert info.engine_name == "tensorrt_llm"
    assert info.engine_version.endswith("+openengine-mock"), "still says it is the mock"
    assert info.engine_role == server_pb2.ENGINE_ROLE_UNSPECIFIED
    assert info.schema_release == SCHEMA_RELEASE_PREFIX
    # tp, pp and TensorRT-LLM's context parallel size as decode_context_parallel_size (issue 27 item 5f); no dp.
    parallelism = info.parallelism
    assert (parallelism.tensor_parallel_size, parallelism.pipeline_parallel_size) == (1, 1)
    assert parallelism.decode_context_parallel_size == 1
    assert not info.parallelism.HasField("data_parallel_size")
    assert not info.capacity.HasField("total_kv_blocks")
    kvc = info.kv_connector
    assert (kvc.enabled, kvc.transfer_backend, kvc.supports_remote_prefill) == (True, "NIXL", True)
    assert (kvc.supports_decode_pull, kvc.supports_abort_cleanup, kvc.schema_version) == (False, False, 1)
    assert not kvc.local_endpoints
    assert not kvc.supported_protocols


def test_newer_discovery(start_mock: StartMock) -> None:
    mock = start_mock("--profile", "trtllm-newer")
    info = server_info(mock.address)
    assert info.schema_release == SCHEMA_RELEASE_FULL
    assert info.parallelism.data_parallel_size == 1
    assert info.capacity.total_kv_blocks == 4096
    assert struct_to_dict(info.extra)["trtllm_supports_dp_rank_targeting"] is True
    assert not model_info(mock.address).HasField("max_output_tokens")


def test_no_cache_transceiver_drops_the_connector_and_full_role_unspecified_drops_it_too(
    start_mock: StartMock,
) -> None:
    bare = start_mock("--no-cache-transceiver")
    assert not server_info(bare.address).HasField("kv_connector")
    full = start_mock("--profile", "full", "--role", "unspecified")
    assert not server_info(full.address).HasField("kv_connector")
    prefill = start_mock("--profile", "full", "--role", "prefill")
    info = server_info(prefill.address)
    assert (info.engine_role, info.kv_connector.transfer_backend) == (server_pb2.ENGINE_ROLE_PREFILL, "MOCK")


def test_any_model_name_is_served(trt_addr: str) -> None:
    info = model_info(trt_addr, "some/other-model")
    assert info.served_model_name == "tiny-oe"
    out = run(trt_addr, make_request(model="some/other-model", max_tokens=2))
    assert out.status == Status.OK
    assert out.events[-1] == "finished"


def test_model_info_has_no_max_num_sequences_and_the_window_as_max_output_tokens(trt_addr: str) -> None:
    info = model_info(trt_addr)
    assert not info.generation.HasField("max_num_sequences")
    assert info.max_output_tokens == info.max_context_length == 2048


def test_any_leg_on_any_engine_and_the_handoff_carries_first_token_logprobs(start_mock: StartMock) -> None:
    ctx, gen = start_mock(), start_mock()
    prompt = "The family arrived at the river"
    first = make_request(prompt=prompt, max_tokens=1, seed=3, logprobs_top_n=3, extra={"request_type": "context_only"})
    prefill = run(ctx.address, first)
    assert prefill.events == ["token", "prefill_ready"]
    session = prefill.final.prefill_ready.kv_session
    assert session.transfer_backend == "NIXL"
    attrs = struct_to_dict(session.attributes_struct)
    sampled = prefill.messages[0].token.tokens[0]
    positions = attrs["first_gen_log_probs"]
    assert isinstance(positions, list)
    assert len(positions) == 1, "one position: the first generated token"
    triples = positions[0]
    assert isinstance(triples, list)
    # [token_id, logprob, rank] for the top-3 candidates and the sampled token, as numbers (doubles).
    as_tuples = {(int(t[0]), round(t[1], 4), int(t[2])) for t in triples if isinstance(t, list)}  # type: ignore[arg-type]
    assert (sampled.token_id, round(sampled.logprob, 4), sampled.rank) in as_tuples
    assert {(c.token_id, c.rank) for c in sampled.candidates} <= {(t, r) for t, _, r in as_tuples}
    decode = make_request(prompt=prompt, max_tokens=4, ignore_eos=True, seed=3, logprobs_top_n=2)
    decode.kv.session.CopyFrom(session)
    out = run(gen.address, decode)
    assert out.status == Status.OK
    assert out.events[-1] == "finished"
    replayed = out.messages[0].token.tokens[0]
    assert replayed.token_id == sampled.token_id, "the decode leg replays the first token"
    assert (replayed.logprob, replayed.rank) == (pytest.approx(sampled.logprob), sampled.rank)
    assert [(c.token_id, c.rank) for c in replayed.candidates] == [
        (c.token_id, c.rank) for c in sampled.candidates[:2]
    ], "its candidates come from first_gen_log_probs, cut to the decode leg's top_n"


def test_full_handoff_carries_no_logprobs(addr: str) -> None:
    first = make_request(prompt="The river", max_tokens=1, logprobs_top_n=3, extra={"request_type": "context_only"})
    prefill = run(addr, first)
    assert "first_gen_log_probs" not in struct_to_dict(prefill.final.prefill_ready.kv_session.attributes_struct)


# -- 5. Guided decoding -----------------------------------------------------------------------------------------------


def test_guided_modes_are_xgrammars_and_choice_is_unimplemented(trt_addr: str) -> None:
    guided = model_info(trt_addr).generation.guided_decoding
    assert guided.supported
    assert list(guided.modes) == [
        model_pb2.GUIDED_DECODING_MODE_JSON_SCHEMA,
        model_pb2.GUIDED_DECODING_MODE_REGEX,
        model_pb2.GUIDED_DECODING_MODE_EBNF_GRAMMAR,
        model_pb2.GUIDED_DECODING_MODE_STRUCTURAL_TAG,
        model_pb2.GUIDED_DECODING_MODE_JSON_OBJECT,
    ]
    choice = make_request(max_tokens=8)
    choice.guided.choice.choices.extend(["yes", "no"])
    assert (run(trt_addr, choice).status, run(trt_addr, choice).messages) == (Status.UNIMPLEMENTED, [])
    schema = make_request(max_tokens=8)
    schema.guided.json_schema = '{"type": "object"}'
    assert run(trt_addr, schema).status == Status.OK
    backend = make_request(max_tokens=8)
    backend.guided.json_object.SetInParent()
    backend.guided.backend = "llguidance"
    assert run(trt_addr, backend).status == Status.UNIMPLEMENTED


def test_full_with_guided_accepts_choice(start_mock: StartMock) -> None:
    mock = start_mock("--profile", "full", "--capability", "guided=true")
    modes = model_info(mock.address).generation.guided_decoding.modes
    assert list(modes) == [model_pb2.GUIDED_DECODING_MODE_JSON_OBJECT, model_pb2.GUIDED_DECODING_MODE_CHOICE]
    choice = make_request(max_tokens=8)
    choice.guided.choice.choices.extend(["yes", "no"])
    assert run(mock.address, choice).status == Status.OK


# -- 6, 7. Stop words -------------------------------------------------------------------------------------------------


def test_a_stop_words_tokens_are_neither_streamed_nor_counted(trt_addr: str, addr: str, lm: TinyLM) -> None:
    stop = " toward the"
    assert len(lm.encode(stop)) == 2
    out = run(trt_addr, scripted(lm, stop_texts=[stop]))
    kept = lm.encode(" Alder carries leaves")
    assert out.tokens() == kept
    assert out.text() == " Alder carries leaves"
    (finished,) = out.finished()
    assert finished.reason == generation_pb2.FINISH_REASON_STOP
    assert finished.stop_match.stop_text == stop
    assert out.final.usage.completion_tokens == len(kept)
    # The full engine streams the stop word's tokens (with no text) and counts them.
    full = run(addr, scripted(lm, stop_texts=[stop]))
    assert full.tokens() == kept + lm.encode(stop)
    assert full.final.usage.completion_tokens == len(kept) + 2


def test_include_stop_in_output_keeps_and_counts_the_stop_word(trt_addr: str, lm: TinyLM) -> None:
    stop = " toward the"
    out = run(trt_addr, scripted(lm, stop_texts=[stop], include_stop=True))
    assert out.tokens() == lm.encode(" Alder carries leaves toward the")
    assert out.text() == " Alder carries leaves toward the"
    assert out.final.usage.completion_tokens == 5


def test_a_stop_on_the_first_token_sends_no_token_event(trt_addr: str, lm: TinyLM) -> None:
    first = lm.encode(SENTENCE)[0]
    by_id = run(trt_addr, scripted(lm, stop_ids=[first]))
    by_word = run(trt_addr, scripted(lm, stop_texts=[" Alder carries"]))
    for out in (by_id, by_word):
        assert out.events == ["finished"], out.events
        assert out.final.finished.reason == generation_pb2.FINISH_REASON_STOP
        assert out.final.usage.completion_tokens == 0
    assert by_id.final.finished.stop_match.stop_token_id == first


def test_a_stop_string_inside_a_token_does_not_stop(trt_addr: str, addr: str, lm: TinyLM) -> None:
    assert " coast" in [lm.token_text(t) for t in lm.encode(SENTENCE)]
    out = run(trt_addr, scripted(lm, stop_texts=["oas"]))
    assert out.text() == SENTENCE
    assert out.final.finished.reason == generation_pb2.FINISH_REASON_LENGTH, "the script ran out, no stop"
    # The full engine matches on text and stops mid-token.
    full = run(addr, scripted(lm, stop_texts=["oas"]))
    assert full.final.finished.stop_match.stop_text == "oas"
    assert full.text() == " Alder carries leaves toward the c"


def test_stop_text_is_held_back_until_it_stops_matching(trt_addr: str, lm: TinyLM) -> None:
    out = run(trt_addr, scripted(lm, stop_texts=[" toward the sea"]))
    assert out.text() == SENTENCE
    texts = [m.token.text for m in out.messages if m.WhichOneof("event") == "token"]
    assert any(t.startswith(" toward the") and len(t) > len(" toward") for t in texts), texts


# -- 8. Window ----------------------------------------------------------------------------------------------------


def test_max_tokens_above_the_window_is_served_to_the_window(start_mock: StartMock, lm: TinyLM) -> None:
    mock = start_mock("--max-context-length", "32")
    prompt = "The river"
    out = run(mock.address, make_request(prompt=prompt, max_tokens=500, ignore_eos=True))
    assert out.status == Status.OK
    assert out.final.finished.reason == generation_pb2.FINISH_REASON_LENGTH
    assert out.final.usage.completion_tokens == 32 - len(lm.encode(prompt))
    full = start_mock("--profile", "full", "--max-context-length", "32")
    assert run(full.address, make_request(prompt=prompt, max_tokens=500)).status == Status.INVALID_ARGUMENT


# -- 9. Greedy and n ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"top_k": 1}, {"top_p": 0.0}], ids=["temperature0", "top_k1", "top_p0"]
)
def test_greedy_in_any_form_refuses_n_above_one(trt_addr: str, sampling: dict[str, float]) -> None:
    req = make_request(n=2, max_tokens=4)
    for name, value in sampling.items():
        setattr(req.sampling, name, value)
    assert (run(trt_addr, req).status, run(trt_addr, req).messages) == (Status.INVALID_ARGUMENT, [])


def test_n5_is_served_and_full_allows_n2_with_top_k1(trt_addr: str, addr: str) -> None:
    out = run(trt_addr, make_request(n=5, max_tokens=3, ignore_eos=True, temperature=1.0))
    assert sorted(f.output_index for f in out.finished()) == [0, 1, 2, 3, 4]
    assert out.final.usage.completion_tokens == 15
    req = make_request(n=2, max_tokens=3)
    req.sampling.top_k = 1
    assert run(addr, req).status == Status.OK
    assert run(addr, make_request(n=5, max_tokens=3)).status == Status.INVALID_ARGUMENT


# -- 10. KV transfer failures -----------------------------------------------------------------------------------------


def test_kv_transfer_failures_are_engine_error_internal(trt_addr: str, start_mock: StartMock) -> None:
    prompt = "The family arrived"
    first = make_request(prompt=prompt, max_tokens=1, seed=1, extra={"request_type": "context_only"})
    session = run(trt_addr, first).final.prefill_ready.kv_session
    gen = start_mock()
    decode = make_request(prompt=prompt, max_tokens=4, seed=1)
    decode.kv.session.CopyFrom(session)
    assert run(gen.address, decode).events[-1] == "finished"
    again = run(gen.address, decode)  # the session was claimed: gone
    assert again.events == ["error"]
    assert again.final.error.code == error_pb2.ERROR_CODE_INTERNAL
    assert again.final.HasField("usage")
    unreachable = kv_pb2.KvSessionRef()
    unreachable.CopyFrom(session)
    unreachable.attributes_struct.fields["ctx_info_endpoint"].string_value = "tcp://127.0.0.1:1"
    decode.kv.session.CopyFrom(unreachable)
    assert run(gen.address, decode).final.error.code == error_pb2.ERROR_CODE_INTERNAL
    full = start_mock("--profile", "full")
    assert run(full.address, decode).final.error.code == error_pb2.ERROR_CODE_KV_TRANSFER_FAILED


# -- 13. From TensorRT-LLM's source -----------------------------------------------------------------------------------


def test_ignore_eos_drops_every_stop_word(trt_addr: str, lm: TinyLM) -> None:
    ids = lm.encode(SENTENCE)
    out = run(trt_addr, scripted(lm, stop_ids=[ids[1]], stop_texts=[" toward the"], ignore_eos=True))
    assert out.tokens() == ids
    assert out.final.finished.reason == generation_pb2.FINISH_REASON_LENGTH


def _sampling(**values: float) -> generation_pb2.GenerateRequest:
    req = make_request(max_tokens=4)
    for name, value in values.items():
        setattr(req.sampling, name, value)
    return req


def _max_tokens_zero() -> generation_pb2.GenerateRequest:
    return make_request(max_tokens=0)


@pytest.mark.parametrize(
    "request_",
    [_sampling(top_p=0.0), _sampling(min_p=2.0), _sampling(repetition_penalty=0.0), _max_tokens_zero()],
    ids=["top_p0", "min_p2", "repetition_penalty0", "max_tokens0"],
)
def test_values_the_executor_refuses_fail_after_submission(
    trt_addr: str, addr: str, request_: generation_pb2.GenerateRequest
) -> None:
    out = run(trt_addr, request_)
    assert (out.status, out.events) == (Status.OK, ["error"])
    assert out.final.error.code == error_pb2.ERROR_CODE_INTERNAL
    assert not out.final.error.retryable
    assert out.final.usage.completion_tokens == 0
    assert out.final.usage.prompt_tokens > 0
    assert run(addr, request_).status == Status.INVALID_ARGUMENT, "the full engine refuses it up front"


def test_context_only_without_a_cache_transceiver_is_internal(start_mock: StartMock) -> None:
    mock = start_mock("--no-cache-transceiver")
    out = run(mock.address, make_request(max_tokens=1, extra={"request_type": "context_only"}))
    assert (out.status, out.events) == (Status.OK, ["error"])
    assert out.final.error.code == error_pb2.ERROR_CODE_INTERNAL
    full = start_mock("--profile", "full", "--no-cache-transceiver")
    plain = run(full.address, make_request(max_tokens=1, extra={"request_type": "context_only"}))
    assert plain.final.finished.reason == generation_pb2.FINISH_REASON_LENGTH


# -- 14. Metadata, baseline and newer ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "baseline", "newer"),
    [
        ([("openengine-target-dp-rank", "0")], Status.UNIMPLEMENTED, Status.OK),
        ([("openengine-target-dp-rank", "1")], Status.UNIMPLEMENTED, Status.INVALID_ARGUMENT),
        ([("openengine-target-dp-rank", "x")], Status.UNIMPLEMENTED, Status.INVALID_ARGUMENT),
        ([("openengine-routing-key", "user-7")], Status.OK, Status.UNIMPLEMENTED),
        ([("openengine-something", "1")], Status.OK, Status.UNIMPLEMENTED),
        ([("openengine-priority", "1")], Status.UNIMPLEMENTED, Status.UNIMPLEMENTED),
        ([("openengine-routing-key", "a"), ("openengine-routing-key", "b")], Status.INVALID_ARGUMENT, None),
    ],
    ids=["dp-rank-0", "dp-rank-1", "dp-rank-x", "routing-key", "unknown-key", "priority", "repeated"],
)
def test_metadata_baseline_and_newer(
    trt_addr: str, start_mock: StartMock, metadata: list[tuple[str, str]], baseline: Status, newer: Status | None
) -> None:
    assert run(trt_addr, make_request(max_tokens=2), metadata).status == baseline
    if newer is not None:
        mock = start_mock("--profile", "trtllm-newer")
        assert run(mock.address, make_request(max_tokens=2), metadata).status == newer


def test_newer_refuses_a_dp_rank_with_n_above_one(start_mock: StartMock) -> None:
    mock = start_mock("--profile", "trtllm-newer")
    req = make_request(n=2, max_tokens=2, temperature=1.0)
    assert run(mock.address, req, [("openengine-target-dp-rank", "0")]).status == Status.INVALID_ARGUMENT


# -- Flags override the profile ---------------------------------------------------------------------------------------


def test_explicit_flags_override_the_profile(start_mock: StartMock) -> None:
    mock = start_mock(
        "--role",
        "aggregated",
        "--engine-name",
        "custom",
        "--schema-release",
        "full",
        "--kv-events",
        "grpc",
        "--capability",
        "guided=false",
        "--load-report",
        "full",
        "--max-num-sequences",
        "2",
    )
    info = server_info(mock.address)
    assert (info.engine_name, info.engine_role) == ("custom", server_pb2.ENGINE_ROLE_AGGREGATED)
    assert info.schema_release == SCHEMA_RELEASE_FULL
    generation = model_info(mock.address).generation
    assert not generation.guided_decoding.supported
    assert generation.max_num_sequences == 2
    assert call(mock.address, get_load).total_kv_blocks == 4096, "--load-report full"
    sources = call(mock.address, lambda ch: control(ch).GetKvEventSources(kv_pb2.GetKvEventSourcesRequest()))
    assert [s.transport for s in sources.sources] == ["grpc"]


def test_startup_delay_keeps_the_port_closed(start_mock: StartMock) -> None:
    started = time.monotonic()
    mock = start_mock("--startup-delay", "2", wait=False)
    address = mock.wait_listening()
    assert time.monotonic() - started >= 2.0, "the port opens only once the model is 'loaded'"
    # TensorRT-LLM has no STARTING state: once the port answers, the engine is ready.
    health = call(address, lambda ch: control(ch).Health(lifecycle_pb2.HealthRequest()))
    assert health.state == lifecycle_pb2.HEALTH_STATE_READY
    assert run(address, make_request(max_tokens=2)).status == Status.OK


# -- 15. Against TensorRT-LLM on the wire (issue 27 item 5) -----------------------------------------------------------


def _prompt_logprobs_over_the_limit() -> generation_pb2.GenerateRequest:
    """1100 prompt tokens x 1000 candidates: above TensorRT-LLM's 1,000,000 prompt-logprob entries."""
    req = make_request(token_ids=[5] * 1100, max_tokens=4, ignore_eos=True, temperature=1.0, seed=2)
    req.response.return_prompt_logprobs = True
    req.response.prompt_candidates.top_n = 1000
    return req


def test_after_the_prompt_logprob_error_the_stream_goes_on(start_mock: StartMock) -> None:
    """(a) TensorRT-LLM's formatter turns the first result into the EngineError and formats the later ones as usual:
    the tokens (the first step's with the second's) and a finished with usage follow, status OK."""
    out = run(start_mock("--max-top-n", "1000").address, _prompt_logprobs_over_the_limit())
    assert out.status == Status.OK
    assert out.events == ["error", "token", "token", "token", "finished"], out.events
    error = out.messages[0]
    assert error.error.code == error_pb2.ERROR_CODE_INVALID_ARGUMENT
    assert "prompt logprobs" in error.error.message
    assert (error.usage.prompt_tokens, error.usage.completion_tokens) == (1100, 1), "usage of the first step"
    assert len(out.messages[1].token.tokens) == 2, "the first step's token goes out with the second's"
    assert len(out.tokens()) == 4
    assert out.final.usage.completion_tokens == 4
    full = run(start_mock("--profile", "full", "--max-top-n", "1000").address, _prompt_logprobs_over_the_limit())
    assert (full.status, full.events) == (Status.OK, ["error"]), "the full engine ends there"


def test_a_multi_token_stop_word_held_back_sends_text_only_token_events(trt_addr: str, lm: TinyLM) -> None:
    """(b) Token ids wait for (longest stop tokenization - 1) more tokens; the text, one step behind, does not:
    while the ids are still held, a step sends ``tokens=[]`` with text."""
    stop = " toward the sea"
    assert len(lm.encode(stop)) == 3, "two ids held back"
    out = run(trt_addr, scripted(lm, stop_texts=[stop]))
    tokens = [m.token for m in out.messages if m.WhichOneof("event") == "token"]
    assert (list(tokens[0].tokens), tokens[0].text) == ([], " Alder"), "the first step's text, no ids yet"
    assert all(t.tokens for t in tokens[1:])
    assert out.tokens() == lm.encode(SENTENCE)
    assert out.text() == SENTENCE


def test_eos_is_neither_streamed_nor_counted(trt_addr: str, addr: str, lm: TinyLM) -> None:
    """(c) An output that ends at EOS: TensorRT-LLM's tokens stop before it, its usage does not count it."""
    ids = lm.encode(SENTENCE)
    eos = lm.eos_token_ids[0]
    request = make_request(max_tokens=len(ids) + 4, mock={"tokens": [*ids, eos]})
    out = run(trt_addr, request)
    assert out.tokens() == ids
    assert out.text() == SENTENCE
    (finished,) = out.finished()
    assert (finished.reason, finished.stop_match.eos_token_id) == (generation_pb2.FINISH_REASON_STOP, eos)
    assert out.final.usage.completion_tokens == len(ids)
    full = run(addr, make_request(max_tokens=len(ids) + 4, mock={"tokens": [*ids, eos]}))
    assert full.tokens() == [*ids, eos], "the full engine streams the EOS id"
    assert full.final.usage.completion_tokens == len(ids) + 1


def test_first_gen_log_probs_only_when_logprobs_were_asked(trt_addr: str) -> None:
    """(d) Without output logprobs the handoff carries none."""
    first = make_request(prompt="The river", max_tokens=1, seed=3, extra={"request_type": "context_only"})
    attrs = struct_to_dict(run(trt_addr, first).final.prefill_ready.kv_session.attributes_struct)
    assert "first_gen_tokens" in attrs
    assert "first_gen_log_probs" not in attrs


def _abort(addr: str, request_id: str) -> tuple[Status, str | None, int]:
    async def go(ch: Channel) -> tuple[Status, str | None, int]:
        try:
            answer = await control(ch).Abort(lifecycle_pb2.AbortRequest(request_id=request_id))
        except GRPCError as exc:
            return exc.status, exc.message, -1
        return Status.OK, None, answer.status

    return call(addr, go)


def test_an_empty_abort_id_is_an_unknown_request(trt_addr: str, addr: str) -> None:
    """(e) Abort{request_id: ""}: TensorRT-LLM looks it up like any id and finds nothing."""
    assert _abort(trt_addr, "") == (Status.OK, None, lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED)
    assert _abort(addr, "")[0] == Status.INVALID_ARGUMENT


def _refusals(lm: TinyLM) -> dict[str, generation_pb2.GenerateRequest]:
    empty_stop = make_request(max_tokens=4, ignore_eos=True)
    empty_stop.stopping.conditions.add(stop_text="")
    tag = make_request(max_tokens=60)
    tag.guided.structural_tag = json.dumps(
        {"type": "structural_tag", "format": {"type": "const_string", "value": " Alder carries leaves"}}
    )
    return {
        "empty stop text": empty_stop,
        "detokenize not a bool": make_request(max_tokens=4, ignore_eos=True, extra={"detokenize": "false"}),
        "conversation_id not a string": make_request(max_tokens=4, ignore_eos=True, extra={"conversation_id": 7}),
        "structural_tag format form": tag,
    }


@pytest.mark.parametrize(
    ("case", "newer"),
    [
        ("empty stop text", Status.OK),
        ("detokenize not a bool", Status.INVALID_ARGUMENT),
        ("conversation_id not a string", Status.INVALID_ARGUMENT),
        ("structural_tag format form", Status.OK),
    ],
)
def test_requests_tensorrt_llm_does_not_refuse(
    trt_addr: str, start_mock: StartMock, lm: TinyLM, case: str, newer: Status
) -> None:
    """(e) What the merged server accepts: an empty stop text (it never matches), ``extra`` keys it never reads, and
    xgrammar's structural-tag ``format`` form; its newer revisions check the ``extra`` types."""
    request = _refusals(lm)[case]
    out = run(trt_addr, request)
    assert (out.status, out.events[-1]) == (Status.OK, "finished"), (case, out.details)
    if case == "structural_tag format form":
        assert out.text() == " Alder carries leaves", "the output is the format's text, then EOS"
        assert out.final.finished.stop_match.HasField("eos_token_id")
    elif case == "detokenize not a bool":
        assert out.text(), "ignored: the text is sent"
    mock = start_mock("--profile", "trtllm-newer")
    assert run(mock.address, request).status == newer


def test_a_session_makes_a_decode_leg_whatever_the_request_type(start_mock: StartMock, addr: str) -> None:
    """(e) ``kv.session`` with ``extra.request_type=context_only``: TensorRT-LLM never reads the request type when a
    session is there, so it is a decode leg."""
    ctx, gen = start_mock(), start_mock()
    prompt = "The family arrived"
    prefill = run(
        ctx.address, make_request(prompt=prompt, max_tokens=1, seed=1, extra={"request_type": "context_only"})
    )
    session = prefill.final.prefill_ready.kv_session
    decode = make_request(prompt=prompt, max_tokens=4, seed=1, ignore_eos=True, extra={"request_type": "context_only"})
    decode.kv.session.CopyFrom(session)
    out = run(gen.address, decode)
    assert (out.status, out.events[-1]) == (Status.OK, "finished")
    assert out.tokens()[0] == prefill.messages[0].token.tokens[0].token_id, "the first token replayed"
    assert len(out.tokens()) == 4
    full = run(addr, decode)
    assert (full.status, full.messages) == (Status.INVALID_ARGUMENT, [])
