"""The live state page in a real headless Chromium (Debian's ``/usr/bin/chromium``, driven by Playwright).

The page of a real worker loads, draws every machine, connects its websocket; then requests go through the real
frontend and the page's counts move while they run (requests in flight highlighted) and after (finished totals).

Needs ``apt-get install -y chromium`` (Debian's package; Playwright never downloads a browser here). Skipped, with
the reason, when Chromium or the ``playwright`` package is missing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio

from tests.helpers.stack import MODEL, dump_logs, start_engine, start_sidecar, wait_routable

if TYPE_CHECKING:
    from tests.helpers.processes import DynamoEnv, Frontend

pytestmark = pytest.mark.e2e

CHROMIUM = os.environ.get("OPENENGINE_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# Flags for a closed network and a root user (see the machine notes): no sandbox, no background connections.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REQUESTS = 4
TIMEOUT = 150


def _skip_reason() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM}: apt-get install -y chromium"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    return None


def until(page: Any, function: str, timeout_s: float) -> None:
    """Poll ``page.evaluate(function)`` until truthy. Not ``wait_for_function``: that evals a string, which the page's
    Content-Security-Policy (no 'unsafe-eval') rightly refuses."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(function):
        if time.monotonic() > deadline:
            state = page.evaluate(
                """() => ({conn: document.getElementById('conn').textContent, seq: document.body.dataset.seq,
                    counts: [...document.querySelectorAll('#table-request td.num')]
                        .map(td => td.id + '=' + td.textContent).join(' '),
                    log: [...document.querySelectorAll('#events div')].slice(0, 12).map(d => d.textContent)})"""
            )
            raise TimeoutError(f"{function} not true within {timeout_s}s; page: {state}")
        page.wait_for_timeout(50)


def browse(url: str, *, ready: trio.Event, requests_done: trio.Event, screenshot: Path) -> dict[str, Any]:
    """In a worker thread: load the page, report readiness to trio, watch the counts until the requests are done."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p, tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        browser = p.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1400, "height": 900},
        )
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(url, timeout=20_000)
            page.wait_for_selector("#conn[data-state=open]", timeout=20_000)
            until(page, "() => document.body.dataset.workerState === 'serving'", 20)
            drawn = page.evaluate(
                """() => ({
                    machines: [...document.querySelectorAll('svg.diagram')].map(s => s.id),
                    states: document.querySelectorAll('svg.diagram g.state').length,
                    edges: document.querySelectorAll('svg.diagram g.edge').length,
                    current: [...document.querySelectorAll('g.state.current')].map(g => g.id),
                    mermaid: document.querySelectorAll('details pre').length,
                })"""
            )
            # Requests that ended, in any terminal state: the frontend itself stops a stream that reaches a stop
            # sequence, and the sidecar counts that as `cancelled` although the client got a normal answer.
            ended = (
                "() => ['finished', 'cancelled', 'failed', 'rejected'].reduce((n, s) =>"
                " n + Number(document.getElementById(`cell-request-${s}`).textContent), 0)"
            )
            ended_before = page.evaluate(ended)
            # Record the largest number of requests in flight the page ever shows (a MutationObserver on the counts).
            page.evaluate(
                """() => {
                    window.maxBusy = 0;
                    const active = ['received', 'submitted', 'streaming', 'decoding', 'prefill_ready']
                        .map(s => document.getElementById(`count-request-${s}`)).filter(Boolean);
                    const check = () => {
                        const n = active.reduce((sum, el) => sum + Number(el.textContent), 0);
                        window.maxBusy = Math.max(window.maxBusy, n);
                        if (document.querySelector('g.state.busy')) window.sawBusyClass = true;
                    };
                    new MutationObserver(check).observe(document.body, {subtree: true, childList: true,
                        characterData: true, attributes: true});
                }"""
            )
            trio.from_thread.run_sync(ready.set)
            trio.from_thread.run(requests_done.wait)
            until(page, f"() => ({ended})() >= {ended_before + REQUESTS}", 20)
            result = {
                **drawn,
                "ended_before": ended_before,
                "ended_after": page.evaluate(ended),
                "max_busy": page.evaluate("window.maxBusy"),
                "saw_busy_class": page.evaluate("window.sawBusyClass === true"),
                "log_lines": page.locator("#events div").count(),
                "errors": errors,
            }
            page.screenshot(path=str(screenshot), full_page=True)
            return result
        finally:
            browser.close()


async def test_the_page_draws_the_machines_and_its_counts_move(
    dynamo_env: DynamoEnv, frontend: Frontend, tmp_path: Path
) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    try:
        seen = await _browse_a_real_worker(dynamo_env, frontend, tmp_path)
    except BaseException:
        dump_logs(dynamo_env)
        raise
    print(f"\nbrowser saw: {seen}")
    assert seen["errors"] == []
    assert seen["machines"][:2] == ["svg-worker", "svg-request"]
    assert seen["states"] >= 11 + 7
    assert seen["edges"] > 10
    assert seen["current"] == ["state-worker-serving"]
    assert seen["mermaid"] == len(seen["machines"])
    assert seen["ended_after"] >= seen["ended_before"] + REQUESTS
    assert seen["max_busy"] >= 1, "the page never showed a request in flight"
    assert seen["saw_busy_class"]
    assert seen["log_lines"] >= REQUESTS * 3


async def _browse_a_real_worker(dynamo_env: DynamoEnv, frontend: Frontend, tmp_path: Path) -> dict[str, Any]:
    ready, requests_done = trio.Event(), trio.Event()
    with trio.fail_after(TIMEOUT):
        # ~40 ms per token: each request stays in flight for about a second, long enough to be seen.
        async with (
            start_engine(dynamo_env, "--decode-ms-per-token", "40") as engine,
            start_sidecar(dynamo_env, engine.address, "--ops-port", "0") as worker,
        ):
            await wait_routable(frontend.url, workers=1, timeout=60)
            match = await worker.process.wait_for_log(r"live state page (http://127\.0\.0\.1:\d+/)", timeout=30)
            url = match.group(1)

            async def drive() -> None:
                await ready.wait()
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24}
                statuses: list[int] = []

                async def one(client: httpx.AsyncClient) -> None:
                    statuses.append((await client.post(f"{frontend.url}/v1/chat/completions", json=body)).status_code)

                async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as nursery:
                    for _ in range(REQUESTS):
                        nursery.start_soon(one, client)
                assert statuses == [200] * REQUESTS
                requests_done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(drive)
                seen = await trio.to_thread.run_sync(
                    lambda: browse(url, ready=ready, requests_done=requests_done, screenshot=tmp_path / "page.png"),
                    abandon_on_cancel=True,
                )
    return seen
