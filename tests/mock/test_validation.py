"""Every pre-acceptance rule answers its status, with a message and zero stream messages (TensorRT-LLM's split)."""

from __future__ import annotations

import re
from collections.abc import Callable

import grpclib.metadata
import pytest
from grpclib.client import Channel
from grpclib.const import Status

from openengine.v1 import generation_pb2

from ._client import Outcome, call, generate, make_request, new_id
from .conftest import StartMock

Mutate = Callable[[generation_pb2.GenerateRequest], None]


def _set(path: str, value: object) -> Mutate:
    def mutate(req: generation_pb2.GenerateRequest) -> None:
        *parents, leaf = path.split(".")
        target: object = req
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)

    return mutate


def _clear_input(req: generation_pb2.GenerateRequest) -> None:
    req.ClearField("prompt")


def _many_stops(req: generation_pb2.GenerateRequest) -> None:
    for i in range(65):
        req.stopping.conditions.add(stop_text=f"s{i}")


def _empty_stop(req: generation_pb2.GenerateRequest) -> None:
    req.stopping.conditions.add()


def _media(req: generation_pb2.GenerateRequest) -> None:
    req.media.add(url="http://example.invalid/cat.png")


def _token_id_candidates(req: generation_pb2.GenerateRequest) -> None:
    req.response.return_output_logprobs = True
    req.response.output_candidates.token_ids.ids.append(5)


def _all_candidates(req: generation_pb2.GenerateRequest) -> None:
    req.response.return_prompt_logprobs = True
    req.response.prompt_candidates.all.SetInParent()


def _guided_backend(req: generation_pb2.GenerateRequest) -> None:
    req.guided.backend = "xgrammar"
    req.guided.json_object.SetInParent()


def _guided_regex(req: generation_pb2.GenerateRequest) -> None:
    req.guided.regex = "[a-z]+"


def _extra(**values: object) -> Mutate:
    def mutate(req: generation_pb2.GenerateRequest) -> None:
        req.extra.update(values)

    return mutate


def _session_without_endpoint(req: generation_pb2.GenerateRequest) -> None:
    req.kv.session.session_id = "7"


CASES: list[tuple[str, Mutate, Status]] = [
    ("empty request_id", _set("request_id", ""), Status.INVALID_ARGUMENT),
    ("empty model", _set("model", ""), Status.INVALID_ARGUMENT),
    ("unknown model", _set("model", "other-model"), Status.NOT_FOUND),
    ("no input", _clear_input, Status.INVALID_ARGUMENT),
    ("empty prompt", _set("prompt", ""), Status.INVALID_ARGUMENT),
    ("num_sequences=0", _set("sampling.num_sequences", 0), Status.INVALID_ARGUMENT),
    ("num_sequences over max", _set("sampling.num_sequences", 5), Status.INVALID_ARGUMENT),
    ("negative temperature", _set("sampling.temperature", -0.5), Status.INVALID_ARGUMENT),
    ("top_p out of range", _set("sampling.top_p", 1.5), Status.INVALID_ARGUMENT),
    ("top_k negative", _set("sampling.top_k", -1), Status.INVALID_ARGUMENT),
    ("65 stop conditions", _many_stops, Status.INVALID_ARGUMENT),
    ("empty stop condition", _empty_stop, Status.INVALID_ARGUMENT),
    ("max_tokens=0", _set("stopping.max_tokens", 0), Status.INVALID_ARGUMENT),
    ("max_tokens past the window", _set("stopping.max_tokens", 2047), Status.INVALID_ARGUMENT),
    ("top_n over max_top_n", _set("response.output_candidates.top_n", 21), Status.INVALID_ARGUMENT),
    ("token_ids candidates", _token_id_candidates, Status.UNIMPLEMENTED),
    ("all candidates", _all_candidates, Status.UNIMPLEMENTED),
    ("prompt_logprob_start", _set("response.prompt_logprob_start", 2), Status.UNIMPLEMENTED),
    ("media", _media, Status.UNIMPLEMENTED),
    ("lora_name without LoRA", _set("lora_name", "adapter"), Status.UNIMPLEMENTED),
    ("bypass_prefix_cache", _set("kv.bypass_prefix_cache", True), Status.UNIMPLEMENTED),
    ("guided backend", _guided_backend, Status.UNIMPLEMENTED),
    ("guided without support", _guided_regex, Status.UNIMPLEMENTED),
    ("request_type generation_only", _extra(request_type="generation_only"), Status.INVALID_ARGUMENT),
    ("request_type not a string", _extra(request_type=3), Status.INVALID_ARGUMENT),
    ("detokenize as string", _extra(detokenize="false"), Status.INVALID_ARGUMENT),
    ("conversation_id not a string", _extra(conversation_id=1), Status.INVALID_ARGUMENT),
    ("malformed extra.mock", _extra(mock="boom"), Status.INVALID_ARGUMENT),
    ("unknown extra.mock key", _extra(mock={"no_such_fault": 1}), Status.INVALID_ARGUMENT),
    ("kv.session without endpoint or opaque_state", _session_without_endpoint, Status.INVALID_ARGUMENT),
]


@pytest.mark.parametrize(("mutate", "status"), [pytest.param(m, s, id=name) for name, m, s in CASES])
def test_rejections_before_acceptance(addr: str, mutate: Mutate, status: Status) -> None:
    req = make_request(max_tokens=4)
    mutate(req)
    out = call(addr, lambda ch: generate(ch, req))
    assert out.status == status, out
    assert out.details, "a rejection carries a message"
    assert out.messages == []


def test_greedy_with_n_greater_than_one_is_invalid(addr: str) -> None:
    out = call(addr, lambda ch: generate(ch, make_request(temperature=0.0, n=2)))
    assert (out.status, out.messages) == (Status.INVALID_ARGUMENT, [])
    assert "greedy" in (out.details or "")


def test_prompt_longer_than_the_window(addr: str) -> None:
    out = call(addr, lambda ch: generate(ch, make_request(token_ids=[5] * 2048, max_tokens=None)))
    assert (out.status, out.messages) == (Status.INVALID_ARGUMENT, [])


def test_token_id_out_of_vocabulary(addr: str) -> None:
    out = call(addr, lambda ch: generate(ch, make_request(token_ids=[10**6])))
    assert (out.status, out.messages) == (Status.INVALID_ARGUMENT, [])


def test_empty_token_ids(addr: str) -> None:
    req = make_request(prompt=None)
    req.token_ids.SetInParent()
    out = call(addr, lambda ch: generate(ch, req))
    assert (out.status, out.messages) == (Status.INVALID_ARGUMENT, [])


@pytest.mark.parametrize(
    ("metadata", "status"),
    [
        pytest.param(
            [("openengine-routing-key", "a"), ("openengine-routing-key", "b")],
            Status.INVALID_ARGUMENT,
            id="repeated key",
        ),
        pytest.param([("openengine-priority", "5")], Status.UNIMPLEMENTED, id="priority unsupported"),
        pytest.param([("openengine-target-dp-rank", "0")], Status.UNIMPLEMENTED, id="dp rank unsupported"),
        pytest.param(
            [("openengine-routing-key", "tenant-1"), ("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")],
            Status.OK,
            id="routing key and trace context accepted",
        ),
    ],
)
def test_metadata_rules(addr: str, metadata: list[tuple[str, str]], status: Status) -> None:
    out = call(addr, lambda ch: generate(ch, make_request(max_tokens=2), metadata=metadata))
    assert out.status == status, out
    if status != Status.OK:
        assert out.messages == []


def test_empty_routing_key(addr: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # grpclib's client refuses empty metadata values; a raw HTTP/2 client could send one.
    monkeypatch.setattr(grpclib.metadata, "_VALUE_RE", re.compile(r"^[ !-~]*$"))
    out = call(addr, lambda ch: generate(ch, make_request(max_tokens=2), metadata=[("openengine-routing-key", "")]))
    assert (out.status, out.messages) == (Status.INVALID_ARGUMENT, [])
    assert "routing-key" in (out.details or "")


def test_priority_metadata_when_supported(start_mock: StartMock) -> None:
    mock = start_mock("--profile", "full", "--capability", "priority=true")
    addr = mock.address

    async def run(ch: Channel) -> tuple[Outcome, Outcome]:
        good = await generate(ch, make_request(max_tokens=2), metadata=[("openengine-priority", "-3")])
        bad = await generate(ch, make_request(max_tokens=2), metadata=[("openengine-priority", "high")])
        return good, bad

    good, bad = call(addr, run)
    assert good.status == Status.OK
    assert (bad.status, bad.messages) == (Status.INVALID_ARGUMENT, [])


def test_duplicate_live_request_id(addr: str) -> None:
    rid = new_id("dup")

    async def run(ch: Channel) -> tuple[Outcome, Outcome, Outcome]:
        import asyncio

        from ._client import abort, wait_for_load

        first = asyncio.create_task(generate(ch, make_request(rid, mock={"hang_after_tokens": 1})))
        await wait_for_load(ch, lambda load: load.running_requests >= 1)
        second = await generate(ch, make_request(rid))
        await abort(ch, rid)
        first_out = await first
        again = await generate(ch, make_request(rid, max_tokens=2))  # the id is free once the stream ended
        return first_out, second, again

    first, second, again = call(addr, run)
    assert (second.status, second.messages) == (Status.ALREADY_EXISTS, [])
    assert first.status == Status.OK
    assert first.finished()[-1].reason == generation_pb2.FINISH_REASON_CANCELLED
    assert again.status == Status.OK
