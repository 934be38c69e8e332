"""The operator surface of a real worker: the real Dynamo frontend → ``openengine-sidecar`` → ``openengine-mock``.

* the system port's ``/metrics`` shows our ``openengine_sidecar_*`` series next to Dynamo's ``dynamo_component_*``
  after requests (what an operator's ``curl`` sees);
* the ops port's websocket feed shows each request's transitions in order, the CLI's ``status``/``watch`` read it;
* every log line of the worker is JSON with the worker state, request lines carry the request id;
* ``openengine-sidecar probe`` answers for the engine.
"""

from __future__ import annotations

import json
import re
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from trio_websocket import open_websocket_url

from tests.helpers.processes import free_low_port, free_port
from tests.helpers.stack import MODEL, dump_logs, engine_load, start_engine, start_sidecar, wait_routable
from tests.helpers.waits import wait_until

if TYPE_CHECKING:
    from tests.helpers.processes import DynamoEnv, Frontend, Process

pytestmark = pytest.mark.e2e

TIMEOUT = 120


async def ops_port(process: Process) -> int:
    match = await process.wait_for_log(r"live state page http://127\.0\.0\.1:(\d+)/", timeout=30)
    return int(match.group(1))


async def chat(frontend: Frontend, text: str, max_tokens: int = 12, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    if stream:
        body["stream"] = True
    async with httpx.AsyncClient(timeout=20) as client:
        response = await client.post(f"{frontend.url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


_OURS = ("outcome", "rpc", "code", "state")


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``(name, our labels sorted) -> value`` (Dynamo's injected labels, if any, left out)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k in _OURS))
            out[(s.name, labels)] = float(s.value)
    return out


async def run_cli(*args: str, timeout: float = 30) -> str:
    with trio.fail_after(timeout):
        result = await trio.run_process(
            [sys.executable, "-m", "sidecar", *args], capture_stdout=True, capture_stderr=True, check=False
        )
    out = result.stdout.decode() + result.stderr.decode()
    assert result.returncode == 0, out
    return out


async def test_metrics_feed_cli_and_logs_of_a_real_worker(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    try:
        await _metrics_feed_cli_and_logs(dynamo_env, frontend)
    except BaseException:
        dump_logs(dynamo_env)  # the scratch directory goes away with the test
        raise


async def _metrics_feed_cli_and_logs(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    with trio.fail_after(TIMEOUT):
        async with (
            start_engine(dynamo_env, "--speedup", "0") as engine,
            start_sidecar(
                dynamo_env, engine.address, "--ops-port", "0", "--log-format", "json", "--log-level", "debug"
            ) as worker,
        ):
            await wait_routable(frontend.url, workers=1, timeout=60)
            port = await ops_port(worker.process)
            async with httpx.AsyncClient(timeout=10) as client:
                before = samples((await client.get(f"{worker.system_url}/metrics")).text)  # after the warm-up request
            async with open_websocket_url(f"ws://127.0.0.1:{port}/ws") as ws:
                snapshot = json.loads(await ws.get_message())
                assert snapshot["worker"]["state"] == "serving"
                await chat(frontend, "Tell me about the river.")
                await chat(frontend, "And the sea?", stream=True)
                seen: dict[str, list[str]] = {}
                with trio.fail_after(10):  # the feed flushes every 50 ms
                    while sum(events[-1:] == ["finish"] for events in seen.values()) < 2:
                        message = json.loads(await ws.get_message())
                        for event in message["events"]:
                            if event["machine"] == "request":
                                seen.setdefault(event["id"], []).append(event["event"])
            # With the mock at full speed the first batch can already hold the terminal event: submitted -> finished.
            assert len(seen) == 2
            assert all(
                events in (["submit", "first_token", "finish"], ["submit", "finish"]) for events in seen.values()
            )

            async with httpx.AsyncClient(timeout=10) as client:
                text = (await client.get(f"{worker.system_url}/metrics")).text
                assert (await client.get(f"{worker.system_url}/health")).status_code == 200
            print("\n".join(line for line in text.splitlines() if line.startswith("openengine_sidecar_requests")))
            assert re.search(r"^dynamo_component_requests_total\{.*\} [1-9]", text, re.MULTILINE)
            after = samples(text)

            def delta(name: str, *labels: tuple[str, str]) -> float:
                return after[(name, labels)] - before.get((name, labels), 0.0)

            assert delta("openengine_sidecar_requests_ended_total", ("outcome", "finished")) == 2
            assert delta("openengine_sidecar_time_to_first_token_seconds_count") == 2
            assert delta("openengine_sidecar_output_tokens_total") > 2
            assert delta("openengine_sidecar_input_tokens_total") > 2
            generate_ok = (("code", "OK"), ("rpc", "Generate"))
            assert delta("openengine_sidecar_engine_rpc_duration_seconds_count", *generate_ok) == 2
            assert after[("openengine_sidecar_worker_state", (("state", "serving"),))] == 1

            finished = ("openengine_sidecar_requests_ended_total", (("outcome", "finished"),))
            status = await run_cli("status", "--ops-url", f"ws://127.0.0.1:{port}/ws", "--json")
            assert json.loads(status)["counts"]["request"]["finished"] == after[finished]
            watched = await run_cli("watch", "--ops-url", f"ws://127.0.0.1:{port}/ws", "--duration-secs", "1")
            assert "worker serving" in watched
            assert "finished" in watched
            probe = await run_cli("probe", "--grpc-endpoint", engine.address)
            assert "READY" in probe

        log = worker.process.log()
        assert "\x1b[" not in log, "colour codes in a log that is not a terminal"
        # --log-format json: every line is JSON, Dynamo's own (DYN_LOGGING_JSONL: `target`, `message`) and ours.
        records = [json.loads(line) for line in log.splitlines() if line.strip()]
        ours = [record for record in records if "logger" in record]
        dynamos = [record for record in records if "target" in record]
        assert ours, "no JSON log lines"
        assert dynamos, "none of Dynamo's lines"
        assert len(ours) + len(dynamos) == len(records)
        # --log-level debug, yet no line of the HTTP/2 wire loggers (they stay at WARNING unless named).
        assert not [r for r in ours if r["logger"].split(".")[0] in ("hpack", "h2", "grpclib")]
        assert all("worker_state" in line and "request_id" in line for line in ours)
        with_id = {line["request_id"] for line in ours if line["request_id"]}
        assert set(seen) <= with_id  # --log-level debug logs every request with its id
        assert ours[-1]["worker_state"] == "stopped"


async def test_probe_fails_for_an_engine_that_is_not_there() -> None:
    with trio.fail_after(30):
        result = await trio.run_process(
            [
                sys.executable,
                "-m",
                "sidecar",
                "probe",
                "--grpc-endpoint",
                f"127.0.0.1:{free_port()}",
                "--timeout-secs",
                "1",
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert result.returncode == 1
    assert b"UNAVAILABLE" in result.stderr or b"no answer" in result.stderr


async def test_an_engine_killed_under_load_is_one_line_per_request_never_a_traceback(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """8 requests in flight when the engine dies: each is one line of ours and one of Dynamo's (the exception it
    hands the frontend), and not one traceback (there were 32 chained ones)."""
    from tests.faults._client import stream_completion

    with trio.fail_after(TIMEOUT):
        async with (
            start_engine(dynamo_env, "--decode-ms-per-token", "20", "--kv-events", "disabled", port=free_port())
            as engine,
            start_sidecar(
                dynamo_env, engine.address, "--health-poll-interval-secs", "0.2", "--health-failure-threshold", "2"
            ) as worker,
        ):  # fmt: skip
            await wait_routable(frontend.url, workers=1, timeout=60)
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(partial(stream_completion, frontend.url, "The river", max_tokens=400))
                # The warm-up and our 8 received, and our 8 streaming on the engine.
                await wait_until(lambda: worker.process.log().count("request received") >= 9, timeout=20)
                await wait_until(lambda: _running_at_least(engine.address, 8), timeout=20)
                engine.process.proc.kill()
            await worker.process.wait_for_log(r"serving -> reconnecting", timeout=20)
            await wait_until(lambda: _lost_lines(worker.process.log()) >= 8, timeout=10, what="every request's line")
            log = worker.process.log()
    assert "Traceback" not in log, log
    ours = [line for line in log.splitlines() if "sidecar.requests" in line and "Connection lost" in line]
    dynamos = [line for line in log.splitlines() if line.startswith("dynamo._core.")]
    assert len(ours) == 8, "\n".join(ours)
    assert len(dynamos) <= 8, "\n".join(dynamos)


async def _running_at_least(address: str, count: int) -> bool:
    return ((await engine_load(address)).running_requests or 0) >= count


def _lost_lines(log: str) -> int:
    return sum("sidecar.requests" in line and "Connection lost" in line for line in log.splitlines())


@pytest.mark.parametrize("asked", [False, True], ids=["the-os-picks", "dynamo-system-port"])
async def test_dynamos_system_server_listens_where_asked_or_where_the_os_picks(
    dynamo_env: DynamoEnv, frontend: Frontend, asked: bool
) -> None:
    """Issue 27 item 9: Dynamo's own system server (behind the system port) took a port the sidecar drew at random in
    20000-32767, with no flag, where another service of a shared host may expect it. By default it now binds a port
    the OS picks (its ephemeral range; ``DYN_SYSTEM_PORT=0`` reads fine as a 16-bit number), and
    ``--dynamo-system-port`` pins it. Either way the frontend fetches the model card from it (the model is routable
    and answers) and the system port relays ``/metrics`` there."""
    wanted = free_low_port() if asked else None
    # 0 is the default (the OS picks: the one test whose server binds above 32767); start_sidecar pins one otherwise.
    flags = ("--dynamo-system-port", str(wanted or 0))
    try:
        with trio.fail_after(TIMEOUT):
            async with (
                start_engine(dynamo_env, "--speedup", "0") as engine,
                start_sidecar(dynamo_env, engine.address, *flags) as worker,
            ):
                await wait_routable(frontend.url, workers=1, timeout=60)
                await chat(frontend, "Tell me about the river.")
                found = re.search(r"relayed to Dynamo's system server on 127\.0\.0\.1:(\d+)", worker.process.log())
                assert found is not None, worker.process.log_tail()
                inner = int(found[1])
                if wanted:
                    assert inner == wanted
                else:
                    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
                    assert low <= inner <= high, f"{inner} is not a port the OS picks ({low}-{high})"
                async with httpx.AsyncClient(timeout=10) as http:
                    relayed = await http.get(f"{worker.system_url}/metrics")
                    live = await http.get(f"http://127.0.0.1:{inner}/engine/live")
                assert "dynamo_component_requests_total" in relayed.text
                assert (live.status_code, live.json()["state"]) == (200, "serving")
    except BaseException:
        dump_logs(dynamo_env)
        raise
