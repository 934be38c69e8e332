"""A request racing an engine's graceful stop moves to another worker, through the real frontend.

Between its two GOAWAYs grpc-core (TensorRT-LLM's server) answers a new stream trailers-only ``CANCELLED`` plus
``RST_STREAM NO_ERROR``; ``openengine-mock`` answers the same (``tests/mock/test_between_goaways.py``). Such a
stream was sent before the worker heard the first GOAWAY -- the race of a request with an engine restart. The
sidecar reports it as the engine going away (migratable), not as a client's cancel (HTTP 499).

Two workers, each with its own engine; worker A reaches engine A through a TCP proxy that holds every byte 400 ms,
so the window in which a request crosses the GOAWAY on the wire -- a network delay wide on a real deployment, a
few microseconds on loopback -- is wide enough to hit on purpose. Engine A keeps one stream of its own open, so
that it stays up through its grace (an idle engine closes its connections at once).
"""

from __future__ import annotations

import signal
from functools import partial

import pytest
import trio

from bench._chaos_net import ProxyLink
from openengine.v1 import generation_pb2
from sidecar.edge import open_edge
from sidecar.engine import EngineClientConfig, open_engine_client, parse_endpoint
from tests.helpers.processes import DynamoEnv, Frontend
from tests.helpers.stack import dump_logs, start_engine, start_sidecar, wait_routable

from ._client import Outcome, stream_completion

pytestmark = pytest.mark.e2e

#: The mock's pace (20 ms per token), without KV events: the frontend routes round-robin over the two workers.
ENGINE = ("--speedup", "1", "--decode-ms-per-token", "20", "--kv-events", "disabled")
RACING = 6
TOKENS = 8
#: What the proxy adds to every byte, each way, once the race begins (the mock sends its second GOAWAY after 1 s at
#: the latest: 2 x 400 ms keeps the whole race before it).
DELAY_MS = 400


async def _hold_a_stream(address: str, started: trio.Event, done: trio.Event) -> None:
    """One long generation on ``address``, straight from the test (no proxy, no worker)."""
    request = generation_pb2.GenerateRequest(request_id="held-open", model="tiny-oe")
    request.token_ids.ids.extend([1, 2, 3])
    request.stopping.max_tokens = 150  # 3 s at 20 ms per token: inside the engine's 5 s grace
    request.stopping.ignore_eos = True
    config = EngineClientConfig(endpoint=parse_endpoint(address), connections=1)
    async with open_edge() as edge, open_engine_client(edge, config) as client:
        async with client.generate(request) as batches:
            async for _ in batches:
                started.set()
        done.set()


@pytest.mark.parametrize("frontend", [3], indirect=True)
async def test_a_request_racing_the_engines_graceful_stop_completes_on_the_other_worker(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    outcomes = [Outcome(status=0) for _ in range(RACING)]
    with trio.fail_after(180):
        async with (
            start_engine(dynamo_env, *ENGINE, name="engine-a") as engine_a,
            start_engine(dynamo_env, *ENGINE, name="engine-b") as engine_b,
            trio.open_nursery() as nursery,
        ):
            link = ProxyLink("127.0.0.1", 0, lambda: ("127.0.0.1", engine_a.port))
            await nursery.start(link.run)
            async with (
                start_sidecar(dynamo_env, f"127.0.0.1:{link.port}", name="sidecar-a") as worker_a,
                start_sidecar(dynamo_env, engine_b.address, name="sidecar-b"),
            ):
                try:
                    await wait_routable(frontend.url, workers=2)
                    held, held_done = trio.Event(), trio.Event()
                    nursery.start_soon(_hold_a_stream, engine_a.address, held, held_done)
                    await held.wait()
                    link.delay(DELAY_MS, 0)
                    engine_a.process.signal(signal.SIGTERM)  # GOAWAY, held 400 ms on its way to worker A
                    async with trio.open_nursery() as racing:
                        for i, outcome in enumerate(outcomes):
                            racing.start_soon(
                                partial(stream_completion, frontend.url, f"race {i}", max_tokens=TOKENS, into=outcome)
                            )
                    await held_done.wait()
                    assert await engine_a.process.wait(15) == 0
                except BaseException:
                    dump_logs(dynamo_env)
                    raise
                log_a = worker_a.process.log()
            nursery.cancel_scope.cancel()
    assert all(o.succeeded and o.completion_tokens == TOKENS for o in outcomes), outcomes
    # The race happened: worker A sent requests that reached engine A between its GOAWAYs, and moved them on.
    assert "CANCELLED (after the engine's GOAWAY: it is going away)" in log_a, log_a[-4000:]
