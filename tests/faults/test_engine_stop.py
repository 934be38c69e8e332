"""An engine stopping gracefully, as TensorRT-LLM does on SIGTERM (``server.stop(grace=5)``): GOAWAY, the open streams
run to their end within the grace, new streams are refused. Requests in flight must complete; nothing is lost.
"""

from __future__ import annotations

import signal
from functools import partial

import pytest
import trio

from tests.helpers.processes import DynamoEnv, Frontend
from tests.helpers.stack import dump_logs, engine_load, mock_stats, start_engine, start_sidecar, wait_routable
from tests.helpers.waits import wait_until

from ._client import Outcome, stream_many

pytestmark = pytest.mark.e2e

STREAMS = 4
TOKENS = 40


async def test_requests_in_flight_complete_when_the_engine_stops_gracefully(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    outcomes: list[Outcome] = []
    with trio.fail_after(120):
        async with (
            start_engine(dynamo_env, "--decode-ms-per-token", "20") as engine,
            start_sidecar(dynamo_env, engine.address),
        ):
            await wait_routable(frontend.url, workers=1)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(stream_many, frontend.url, STREAMS, outcomes, max_tokens=TOKENS))
                    await wait_until(lambda: _all_running(engine.address), timeout=20)
                    # Not a synchronisation: the stop is placed ~10 tokens into each running stream (20 ms a token).
                    await trio.sleep(0.2)
                    served = await mock_stats(engine.address)
                    engine.process.signal(signal.SIGTERM)
            except BaseException:
                dump_logs(dynamo_env)
                raise
            assert await engine.process.wait(15) == 0
    assert served.get("requests", 0) >= STREAMS
    assert len(outcomes) == STREAMS
    assert all(o.succeeded and o.completion_tokens == TOKENS for o in outcomes), outcomes


async def _all_running(address: str) -> bool:
    return (await engine_load(address)).running_requests == STREAMS
