"""The sidecar against TensorRT-LLM's wire behaviour (``openengine-mock``'s default ``trtllm`` profile; issue 27 item
5): the request task (``sidecar.requests``) over the real engine client, where the sidecar reacts to what
TensorRT-LLM's server does and a scripted fake would only repeat our own reading of it.

* (a) After the prompt-logprob limit's in-band ``EngineError`` TensorRT-LLM keeps streaming tokens and a ``finished``:
  the client gets the error, nothing after it becomes a success, and the engine is left with no request.
* (b) A multi-token stop string held back makes TensorRT-LLM send token events with ``tokens=[]`` and only text: they
  add nothing to the client's chunks, and the answer is whole.
* (c) TensorRT-LLM neither streams nor counts the EOS that ends an output: the client's tokens and usage agree.
* (f) A stream cut at the end of the engine's stop grace ends with grpc-core's trailers (``UNAVAILABLE``, "Cancelling
  all calls"): the request fails as a migratable disconnect after the tokens that came before.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from openengine.v1 import generation_pb2
from sidecar.convert.capabilities import Capabilities
from sidecar.dynamo import RequestContext
from sidecar.edge import Edge
from sidecar.engine import EngineClient
from sidecar.errors import DynamoErrorKind, EngineFailure, EngineRpcError, SidecarError
from sidecar.requests import RequestServer, ServingContext
from sidecar.testing.mock.lm import TinyLM
from tests.helpers.scripted_engine import serve

from .conftest import MockEngine, connected_client, start_mock

MODEL = "tiny-oe"
#: A scripted output (``extra.mock.tokens``): seven tokens.
SENTENCE = " Alder carries leaves toward the coast."


@pytest.fixture(scope="module")
def lm() -> TinyLM:
    return TinyLM.load(None)


@asynccontextmanager
async def trtllm_worker(edge: Edge, *flags: str) -> AsyncIterator[tuple[MockEngine, EngineClient, RequestServer]]:
    """A ``--profile trtllm`` mock, a client connected to it, and a request server on that client's discovery."""
    async with start_mock("--profile", "trtllm", *flags) as engine, connected_client(edge, engine.endpoint) as client:
        server_info = await client.get_server_info()
        assert server_info.engine_name == "tensorrt_llm"
        caps = Capabilities.from_discovery(server_info, await client.get_model_info(MODEL))
        server = RequestServer()
        server.attach(
            ServingContext(
                client=client,
                caps=caps,
                model=MODEL,
                context_length=2048,
                abort_timeout_s=5.0,
                inactivity_timeout_s=30.0,
            )
        )
        yield engine, client, server


def body(token_ids: list[int], *, max_tokens: int, script: list[int] | None = None, **more: Any) -> dict[str, Any]:
    """A Dynamo ``PreprocessedRequest``; ``script`` = the engine's output ids (``openengine-extra`` annotation)."""
    request: dict[str, Any] = {
        "token_ids": token_ids,
        "stop_conditions": {"max_tokens": max_tokens, **more.pop("stop_conditions", {})},
        "sampling_options": {"temperature": 0.0, **more.pop("sampling_options", {})},
        **more,
    }
    if script is not None:
        request["annotations"] = [f"openengine-extra:{json.dumps({'mock': {'tokens': script}})}"]
    return request


async def run(
    edge: Edge, server: RequestServer, request: dict[str, Any], rid: str
) -> tuple[list[dict[str, Any]], BaseException | None]:
    """The chunks a client got, and the error that ended the request (None when it completed)."""
    chunks: list[dict[str, Any]] = []
    try:
        async for batch in serve(server, request, RequestContext(request_id=rid), edge=edge):
            chunks.extend(batch)
    except SidecarError as exc:
        return chunks, exc
    return chunks, None


async def engine_events(
    client: EngineClient, request: generation_pb2.GenerateRequest
) -> list[generation_pb2.GenerateResponse]:
    """Everything the engine streams for ``request``, as the sidecar's client receives it."""
    events: list[generation_pb2.GenerateResponse] = []
    async with client.generate(request) as batches:
        async for batch in batches:
            events.extend(batch)
    return events


async def idle(client: EngineClient) -> None:
    """Wait until the engine runs no request (bounded: every request here ends within seconds)."""
    with trio.fail_after(10):
        while (await client.get_load()).running_requests:
            await trio.sleep(0.02)


def token_ids(chunks: list[dict[str, Any]]) -> list[int]:
    return [t for chunk in chunks for t in chunk["token_ids"]]


# ---------------------------------------------------------------------------------- (a) events after an error


async def test_the_prompt_logprob_error_reaches_the_client_and_nothing_after_it_does(edge: Edge) -> None:
    """TensorRT-LLM streams on after the error (tokens, a finished with usage); the client gets the error alone,
    no chunk and no finish, and the engine has no request left."""
    prompt = [5] * 1100  # x 1000 candidates: over TensorRT-LLM's 1,000,000 prompt-logprob entries
    request = body(prompt, max_tokens=4, output_options={"prompt_logprobs": 1000}, sampling_options={"seed": 2})
    with trio.fail_after(60):
        async with trtllm_worker(edge, "--max-top-n", "1000") as (_, client, server):
            raw = generation_pb2.GenerateRequest(request_id="raw", model=MODEL)
            raw.token_ids.ids.extend(prompt)
            raw.stopping.max_tokens = 4
            raw.response.return_prompt_logprobs = True
            raw.response.prompt_candidates.top_n = 1000
            seen = [e.WhichOneof("event") for e in await engine_events(client, raw)]
            assert seen[0] == "error"
            assert seen[-1] == "finished", f"the engine streams on after its error: {seen}"
            chunks, error = await run(edge, server, request, "after-error")
            assert chunks == [], "nothing after the error reaches the client"
            assert isinstance(error, EngineFailure), error
            assert error.code.name == "INVALID_ARGUMENT"
            assert "prompt logprobs" in str(error)
            assert error.kind == DynamoErrorKind.INVALID_ARGUMENT
            assert server.in_flight == 0
            await idle(client)


# -------------------------------------------------------------------------------- (b) text-only token events


@pytest.mark.parametrize(
    ("stop", "kept", "finish"),
    [(" toward the sea", 7, "length"), (" toward the coast", 3, "stop")],
    ids=["held-then-released", "stopped-and-trimmed"],
)
async def test_text_only_token_events_add_nothing_and_the_answer_is_whole(
    edge: Edge, lm: TinyLM, stop: str, kept: int, finish: str
) -> None:
    script = lm.encode(SENTENCE)
    assert len(script) == 7
    assert len(lm.encode(stop)) == 3, "a three-token stop word: two ids held back, the text one step behind"
    request = body([5, 6, 7], max_tokens=16, script=script, stop_conditions={"stop": [stop]})
    with trio.fail_after(60):
        async with trtllm_worker(edge) as (_, client, server):
            raw = generation_pb2.GenerateRequest(request_id="raw", model=MODEL)
            raw.token_ids.ids.extend([5, 6, 7])
            raw.stopping.max_tokens = 16
            raw.stopping.conditions.add(stop_text=stop)
            raw.extra.update({"mock": {"tokens": script}})
            events = await engine_events(client, raw)
            text_only = [e for e in events if e.WhichOneof("event") == "token" and not e.token.tokens]
            assert text_only, "the engine sent token events with only text"
            assert all(e.token.text for e in text_only)
            chunks, error = await run(edge, server, request, f"text-only-{finish}")
            assert error is None, error
            assert token_ids(chunks) == script[:kept]
            assert all(chunk["token_ids"] or "finish_reason" in chunk for chunk in chunks), "an empty chunk"
            assert chunks[-1]["finish_reason"] == finish
            assert chunks[-1]["completion_usage"]["completion_tokens"] == kept
            if finish == "stop":
                assert chunks[-1]["stop_reason"] == stop
            assert server.in_flight == 0


# --------------------------------------------------------------------------------------------- (c) EOS


async def test_an_output_ended_by_eos_gives_the_client_the_visible_tokens_and_their_count(
    edge: Edge, lm: TinyLM
) -> None:
    script = lm.encode(SENTENCE)
    eos = lm.eos_token_ids[0]
    request = body([5, 6, 7], max_tokens=16, script=[*script, eos])
    with trio.fail_after(60):
        async with trtllm_worker(edge) as (_, _client, server):
            chunks, error = await run(edge, server, request, "eos")
    assert error is None, error
    assert token_ids(chunks) == script, "no EOS id among the client's tokens"
    final = chunks[-1]
    assert (final["finish_reason"], final["stop_reason"]) == ("stop", eos)
    assert final["completion_usage"]["completion_tokens"] == len(script), "the EOS is not counted"


# ------------------------------------------------------------------------------------- (f) the grace cut


async def test_a_stream_cut_at_the_end_of_the_grace_fails_as_a_migratable_disconnect(edge: Edge) -> None:
    """The engine stops (SIGTERM, 1 s of grace) while a request hangs after two tokens: grpc-core's trailers
    (``UNAVAILABLE`` "Cancelling all calls") end it; the client has the two tokens and a migratable error."""
    request = body(
        [5, 6, 7],
        max_tokens=16,
        annotations=[f"openengine-extra:{json.dumps({'mock': {'hang_after_tokens': 2}})}"],
        stop_conditions={"ignore_eos": True},
    )
    chunks: list[dict[str, Any]] = []
    outcome: list[BaseException | None] = []

    async def client(server: RequestServer) -> None:
        try:
            async for batch in serve(server, request, RequestContext(request_id="cut"), edge=edge):
                chunks.extend(batch)
        except SidecarError as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    with trio.fail_after(60):
        async with (
            trtllm_worker(edge, "--stop-grace-secs", "1") as (engine, _client, server),
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(client, server)
            while len(token_ids(chunks)) < 2:
                await trio.sleep(0.02)
            os.kill(engine.process.pid, signal.SIGTERM)
    (error,) = outcome
    assert len(token_ids(chunks)) == 2, "the tokens before the cut reached the client"
    assert not any("finish_reason" in chunk for chunk in chunks)
    assert isinstance(error, EngineRpcError), error
    assert "Cancelling all calls" in str(error), error
    assert error.kind == DynamoErrorKind.DISCONNECTED
    assert server.in_flight == 0
