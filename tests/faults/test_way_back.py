"""Back to serving as soon as the engine is back (issue 38 §1), whatever the outage, through the real frontend.

Default flags: the worker as an operator runs it. Per round the engine is SIGKILLed under 8 streams, stays away 1, 3
or 7 s (the reconnect backoff, 1 s doubling, would stand at a different step each time) and starts again on the same
port. From the moment its port accepts a connection (probed every 2 ms here) the frontend must list the model and
answer within :data:`BOUND_S`, and the worker's own figure (its probe's first accept to routable, logged) must be
under :data:`OWN_BOUND_S`. Dynamo's own sidecar measured 0.03-0.05 s on this machine (``python -m bench.way_back``).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from functools import partial

import httpx
import pytest
import trio

from tests.helpers.processes import DynamoEnv, Frontend, free_port
from tests.helpers.stack import dump_logs, engine_load, start_engine, start_sidecar, wait_routable
from tests.helpers.waits import WaitTimeout, wait_until
from tests.helpers.way_back import OWN_FIGURE, first_accept, serving_after

from ._client import Outcome, stream_many

pytestmark = pytest.mark.e2e

#: Accepted connection -> the frontend serves, the client's view (polled every 20 ms). The design figure is 0.15 s;
#: measured 0.05-0.10 s (0.30-0.36 s before, at 3 and 7 s away). The margin is for a loaded two-core machine.
BOUND_S = 0.25
#: The worker's own figure: its probe's first accepted connection -> rediscovered, registered, routable.
OWN_BOUND_S = 0.15
AWAY_S = (1.0, 3.0, 7.0)
STREAMS = 8
ENGINE = ("--decode-ms-per-token", "20")


@pytest.mark.timeout(240)
async def test_after_outages_of_1_3_and_7_s_the_worker_serves_within_moments_of_the_engine_accepting(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Failed before: 0.30-0.36 s after the engine accepted (3 and 7 s away) -- the reconnect backoff, cut short only
    by the load poller's next answer (every second) -- and no figure of its own."""
    port = free_port()
    figures: list[tuple[float, float | None, int | None]] = []
    with trio.fail_after(200):
        async with (
            start_sidecar(dynamo_env, f"127.0.0.1:{port}", ready=None) as worker,
            httpx.AsyncClient(timeout=10) as http,
        ):
            try:
                killed_at = 0.0
                for round_ in range(len(AWAY_S) + 1):
                    away = AWAY_S[round_ - 1] if round_ else None  # the first start is not an outage's end
                    if away is not None:
                        await trio.sleep_until(killed_at + away)  # the outage itself: the engine stays away this long
                    mark = len(worker.process.log())
                    async with trio.open_nursery() as probes:
                        accepted: list[float] = []
                        probes.start_soon(partial(_note, accepted, port))
                        async with start_engine(dynamo_env, *ENGINE, port=port, name=f"engine-{round_}") as engine:
                            await wait_until(partial(bool, accepted), timeout=10, interval=0.002)
                            if away is not None:
                                seconds = await serving_after(http, frontend.url, accepted[0], poll_s=0.02, bound_s=5)
                                figures.append((away, seconds, await _own_figure(worker.process.log, mark)))
                            if round_ == len(AWAY_S):
                                break
                            await wait_routable(frontend.url, workers=1, timeout=60)
                            outcomes: list[Outcome] = []
                            async with trio.open_nursery() as nursery:
                                nursery.start_soon(partial(stream_many, frontend.url, STREAMS, outcomes, max_tokens=60))
                                await wait_until(lambda: _running(engine.address), timeout=20, interval=0.02)
                                engine.process.signal(signal.SIGKILL)
                                killed_at = trio.current_time()
                    assert all(o.failed_cleanly for o in outcomes), outcomes
            except BaseException:
                dump_logs(dynamo_env)
                raise
    for away, seconds, own in figures:
        print(
            f"away {away:g} s: the frontend served {_ms(seconds)} after the engine accepted; the worker's own {own} ms"
        )
    for away, seconds, own in figures:
        assert seconds is not None, f"away {away:g} s: not serving within 5 s of the engine accepting"
        assert seconds < BOUND_S, figures
        assert own is not None, f"away {away:g} s: no figure of the worker's own"
        assert own < OWN_BOUND_S * 1000, figures


async def _note(accepted: list[float], port: int) -> None:
    accepted.append(await first_accept(port))


async def _running(address: str) -> bool:
    return (await engine_load(address)).running_requests == STREAMS


async def _own_figure(log: Callable[[], str], mark: int) -> int | None:
    """The worker's figure for this round: its line follows the serving transition at once (it may still be on its
    way to the log file when the frontend serves)."""

    def line() -> int | None:
        found = OWN_FIGURE.findall(log()[mark:])
        return int(found[-1]) if found else None

    try:
        return await wait_until(line, timeout=2, interval=0.02)
    except WaitTimeout:
        return None


def _ms(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds * 1000:.0f} ms"
