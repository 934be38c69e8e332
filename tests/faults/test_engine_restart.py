"""An engine restarted behind a serving worker, end to end (frontend → worker → openengine-mock), and what the
worker writes about it: the model card follows the engine's new limits (issue 27 item 2), and expected stops -- the
engine's graceful stop and restart, then the worker's own -- log nothing above INFO, every line with a timestamp and
a level (issue 27 item 3, issue 31 item 4).
"""

from __future__ import annotations

import re
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from tests.helpers.processes import DynamoEnv, Frontend, free_port
from tests.helpers.stack import MODEL, Worker, dump_logs, start_engine, start_sidecar, wait_routable

from ._client import stream_completion

pytestmark = pytest.mark.e2e

FAST_WATCH = (
    "--health-poll-interval-secs", "0.2", "--health-failure-threshold", "2", "--grpc-retry-interval-secs", "0.2",
    "--reconnect-backoff-max-secs", "0.5",
)  # fmt: skip

#: A log line of the worker: ours (``2026-…Z INFO sidecar.worker […]``) or Dynamo's (``2026-…Z  INFO dynamo_…``).
_LINE = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z\s+(TRACE|DEBUG|INFO|WARN|WARNING|ERROR|CRITICAL)\s")


def unexpected_lines(log: str) -> list[str]:
    """The lines of a worker log above INFO, and the lines without a timestamp and a level."""
    bad = []
    for line in log.splitlines():
        match = _LINE.match(line)
        if match is None or match.group(1) not in ("TRACE", "DEBUG", "INFO"):
            bad.append(line)
    return bad


async def context_window(url: str) -> int | None:
    async with httpx.AsyncClient(timeout=5) as http:
        models = (await http.get(f"{url}/v1/models")).json().get("data", [])
    windows = [m.get("context_window") for m in models if m.get("id") == MODEL]
    return windows[0] if windows else None


@asynccontextmanager
async def engine_restarted_behind_a_worker(
    denv: DynamoEnv, frontend: Frontend, *restart_flags: str, before_stop: Callable[[], Awaitable[None]] | None = None
) -> AsyncIterator[Worker]:
    """A worker serving an engine that stops gracefully (SIGTERM: GOAWAY) and starts again on the same port with
    ``restart_flags``; yields the worker once it serves the restarted engine (logs dumped when the body fails)."""
    port = free_port()
    async with start_sidecar(denv, f"127.0.0.1:{port}", *FAST_WATCH, ready=None) as worker:
        try:
            async with start_engine(denv, "--speedup", "0", port=port) as engine:
                await wait_routable(frontend.url, workers=1)
                if before_stop is not None:
                    await before_stop()
                engine.process.signal(signal.SIGTERM)
                assert await engine.process.wait(15) == 0
                await worker.process.wait_for_log(r"degraded -> reconnecting", timeout=20)
            mark = len(worker.process.log())
            async with start_engine(denv, "--speedup", "0", *restart_flags, port=port, name="engine-restarted"):
                await worker.process.wait_for_log(r"registering -> serving", timeout=30, start=mark)
                yield worker
        except BaseException:
            dump_logs(denv)
            raise


async def test_an_engine_restarted_with_other_limits_is_served_under_its_new_card(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Issue 27 item 2. Failed before: Dynamo refused the new card ("model update can only change
    runtime_config.taints"), the watchdog put the instance back ~5 s later and /v1/models said context 2048 for an
    engine of 1024. Now the card is replaced whole: the frontend lists the new limits once the worker serves."""

    async def old_card() -> None:
        assert await context_window(frontend.url) == 2048

    limits = ("--max-context-length", "1024", "--max-running-requests", "64")
    with trio.fail_after(120):
        async with engine_restarted_behind_a_worker(dynamo_env, frontend, *limits, before_stop=old_card) as worker:
            with trio.fail_after(10):
                while await context_window(frontend.url) != 1024:
                    await trio.sleep(0.05)
            outcome = await stream_completion(frontend.url, "The river", max_tokens=8)
            assert outcome.succeeded, outcome
            assert "context_length 2048 -> 1024, max_num_seqs 256 -> 64" in worker.process.log()


async def test_a_graceful_engine_restart_and_a_worker_stop_log_nothing_above_info(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Issue 27 item 3 and issue 31 item 4. Failed before: the worker withdrew twice per engine stop (Dynamo's
    ERROR "Unable to unregister endpoint instance … Could not find key" and our WARNING "withdrawal from routing
    failed"), and its own stop logged Dynamo's WARN "Failed to unregister endpoint from discovery"."""
    with trio.fail_after(120):
        async with engine_restarted_behind_a_worker(dynamo_env, frontend) as worker:
            await wait_routable(frontend.url, workers=1)
            outcome = await stream_completion(frontend.url, "The river", max_tokens=8)
            assert outcome.succeeded, outcome
            worker.process.signal(signal.SIGTERM)
            assert await worker.process.wait(30) == 0
        log = worker.process.log()
    assert "draining -> stopped" in log
    assert unexpected_lines(log) == [], log
