"""The model card follows the engine every time (issue 38 §1): 50 restarts with another context length, 0 stale.

An engine restarted with other limits gets its card replaced: Dynamo 1.6.1 refuses to rewrite a card in place, so the
worker removes it and publishes the new one under the same key. Dynamo's file store reads a removal when its watcher
gets to it and drops it when the key exists again by then ("Suppressing stale FileStore remove event for a recreated
key"); the frontend then took the new card for a change of the old one and refused it ("Rejecting immutable discovery
model-card mutation ... model update can only change runtime_config.taints"), keeping the old card until the next
restart -- 3 of 53 restarts against TensorRT-LLM's own server, 4 of 30 against the mock. The worker now keeps the key
absent long enough for every watcher to see it gone, and reads back what the store holds.
"""

from __future__ import annotations

import signal

import httpx
import pytest
import trio

from tests.helpers.processes import DynamoEnv, Frontend, free_port
from tests.helpers.stack import MODEL, dump_logs, start_engine, start_sidecar
from tests.helpers.waits import WaitTimeout, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RESTARTS = 50
CONTEXTS = (1024, 2048)
#: Fast supervision: a restart is noticed and served again within moments.
FAST_WATCH = (
    "--health-poll-interval-secs", "0.2", "--health-failure-threshold", "2", "--grpc-retry-interval-secs", "0.2",
    "--reconnect-backoff-max-secs", "0.5",
)  # fmt: skip


async def context_window(http: httpx.AsyncClient, url: str) -> int | None:
    models = (await http.get(f"{url}/v1/models")).json().get("data", [])
    windows = [m.get("context_window") for m in models if m.get("id") == MODEL]
    return windows[0] if windows else None


@pytest.mark.timeout(420)
async def test_fifty_restarts_with_another_context_length_leave_no_stale_card(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Failed before: 4 of 30 restarts left the frontend listing the previous context length, each with the
    frontend's ERROR "Rejecting immutable discovery model-card mutation"."""
    port = free_port()
    stale: list[tuple[int, int, int | None]] = []
    with trio.fail_after(400):
        async with (
            start_sidecar(dynamo_env, f"127.0.0.1:{port}", *FAST_WATCH, ready=None) as worker,
            httpx.AsyncClient(timeout=5) as http,
        ):
            try:
                for restart in range(RESTARTS + 1):
                    context = CONTEXTS[restart % 2]
                    mark = len(worker.process.log())
                    args = ("--speedup", "0", "--max-context-length", str(context))
                    async with start_engine(dynamo_env, *args, port=port, name=f"engine-{restart}") as engine:
                        await worker.process.wait_for_log(r"-> serving", timeout=30, start=mark)

                        async def follows(context: int = context) -> bool:
                            return await context_window(http, frontend.url) == context

                        try:
                            await wait_until(follows, timeout=3, interval=0.02, retry_on=(httpx.HTTPError,))
                        except WaitTimeout:
                            stale.append((restart, context, await context_window(http, frontend.url)))
                        engine.process.signal(signal.SIGKILL)
                        assert await engine.process.wait(10) == -signal.SIGKILL
            except BaseException:
                dump_logs(dynamo_env)
                raise
        rejected = frontend.process.log().count("Rejecting immutable discovery model-card mutation")
        replaced = worker.process.log().count("the model card changed")
    print(f"{RESTARTS} restarts: {replaced} card replacements, {len(stale)} stale, frontend refusals {rejected}")
    assert replaced == RESTARTS
    assert stale == [], f"restart, context wanted, context listed: {stale}"
    assert rejected == 0
