"""The Dynamo adapter end to end: the real frontend, ``echo_worker.py`` processes (``open_edge`` + ``open_dynamo``),
real HTTP over loopback. Each test runs under ``trio.fail_after``; fixtures kill every process they start.

Measured figures are printed (``pytest -s``) and asserted with slack for a loaded 2-core machine.
"""

from __future__ import annotations

import re
import signal
import statistics
import time
from typing import TYPE_CHECKING

import httpx
import pytest
import trio

from sidecar.dynamo import DynamoSettings, file_discovery_keys
from tests.helpers.processes import (
    frontend_instances,
    list_models,
    start_frontend,
    wait_for_instances,
    wait_for_model,
)
from tests.helpers.waits import wait_until

from .workers import body, post, start_echo_worker

if TYPE_CHECKING:
    from pathlib import Path

    from tests.helpers.processes import DynamoEnv, Frontend

pytestmark = pytest.mark.e2e

TEST_TIMEOUT = 90


async def test_completions_and_chat_streaming_and_not(
    frontend: Frontend, dynamo_env: DynamoEnv, model_dir: Path
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        async with start_echo_worker(dynamo_env, model_dir) as worker:
            waited = await wait_for_model(frontend.url, "tiny", 20)
            print(f"\nregistration: worker {worker.timings}, listed by the frontend {waited:.3f} s after READY")
            for stream in (False, True):
                reply = await post(frontend.url, body(chat=False, stream=stream, max_tokens=4), chat=False)
                assert reply.status == 200, reply
                assert reply.error() is None
                assert reply.text() == "One two three four"
                assert reply.finish_reason() == "length"
                if stream:
                    assert reply.done
                    usage = reply.events[-1]["usage"]
                else:
                    assert reply.json is not None
                    usage = reply.json["usage"]
                assert usage["completion_tokens"] == 4
                # max_tokens large: the echo reaches <|im_end|> and the frontend stops the stream (EOS).
                reply = await post(frontend.url, body(chat=True, stream=stream, max_tokens=64))
                assert reply.status == 200, reply
                assert reply.text() == "user\nOne two three four five six"
                assert reply.finish_reason() == "stop"


async def test_trace_context_and_annotations_reach_the_handler(dynamo_env: DynamoEnv, model_dir: Path) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        # The client's traceparent reaches the worker's context only with tracing on (JSONL logging or OTel export)
        # in the frontend *and* the worker; with it on only in the worker, the worker starts a trace of its own.
        dynamo_env.env["DYN_LOGGING_JSONL"] = "1"
        async with (
            start_frontend(dynamo_env) as frontend,
            start_echo_worker(dynamo_env, model_dir) as worker,
        ):
            await wait_for_model(frontend.url, "tiny", 20)
            trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
            headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01", "tracestate": "x=1"}
            reply = await post(frontend.url, body(annotations=["k:v", "a:b"]), headers=headers)
            assert reply.status == 200
            line = (await worker.process.wait_for_log(r"^REQ a .*$", 5)).group(0)
            assert "annotations=['k:v', 'a:b']" in line, line
            # Same trace, the frontend's span as parent; tracestate is dropped by the frontend.
            assert f"'traceparent': '00-{trace_id}-" in line, line


async def test_request_rejected_is_a_400_with_the_message(
    frontend: Frontend, dynamo_env: DynamoEnv, model_dir: Path
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        async with start_echo_worker(dynamo_env, model_dir):
            await wait_for_model(frontend.url, "tiny", 20)
            reply = await post(frontend.url, body(annotations=["fail:RequestRejected"]))
            assert reply.status == 400
            assert reply.json is not None
            assert reply.json["message"] == "messages: rejected on purpose"
            reply = await post(frontend.url, body(stream=True, annotations=["fail:RequestRejected"]))
            assert reply.status == 200  # SSE headers leave before the first token
            error = reply.error()
            assert error is not None
            assert error["code"] == 400
            assert error["message"] == "messages: rejected on purpose"


# (what the trio handler raises, HTTP status with --migration-limit 0). The DynamoErrorKind values go through
# sidecar.errors' table as SidecarError(kind=...); RuntimeError/TimeoutError are stray exceptions (mapped to Unknown).
ERROR_STATUS = [
    ("InvalidArgument", 400),
    ("Disconnected", 503),
    ("CannotConnect", 503),
    ("ConnectionTimeout", 504),
    ("Cancelled", 499),
    ("Unknown", 500),
    ("RuntimeError", 500),
    ("TimeoutError", 500),  # raised as is, a 504 that migrates; the adapter makes it Unknown
    ("ConnectionError", 500),  # raised as is, a 503 that migrates
    ("EngineShutdown", 503),  # last: it also takes the worker out of routing for a few seconds
]


async def test_error_kinds_map_to_http_status(frontend: Frontend, dynamo_env: DynamoEnv, model_dir: Path) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        async with start_echo_worker(dynamo_env, model_dir) as worker:
            await wait_for_model(frontend.url, "tiny", 20)
            for kind, status in ERROR_STATUS:
                # Before the first token, not streamed: the status itself.
                reply = await post(frontend.url, body(annotations=[f"fail:{kind}"]))
                assert reply.status == status, (kind, reply)
                if status == 400:
                    assert reply.json is not None
                    assert "says InvalidArgument" in reply.json["message"]
                if kind == "EngineShutdown":
                    break  # the worker is out of routing now; the mid-stream case is covered by the migration test
                # Mid-stream, streamed: the tokens so far, then an SSE error event with the status as code.
                reply = await post(
                    frontend.url, body(stream=True, max_tokens=6, annotations=[f"fail:{kind}", "fail_at:2"])
                )
                assert reply.status == 200, (kind, reply)
                assert reply.error_code() == status, (kind, reply)
                assert reply.text(), kind
            assert worker.process.returncode is None


@pytest.mark.parametrize("frontend", [3], indirect=True)
@pytest.mark.parametrize("kind", ["EngineGone", "WorkerDraining", "CannotConnect", "ConnectionTimeout"])
async def test_migratable_error_is_migrated_to_the_other_worker(
    frontend: Frontend, dynamo_env: DynamoEnv, model_dir: Path, kind: str
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        async with (
            start_echo_worker(dynamo_env, model_dir, tag="a") as a,
            start_echo_worker(dynamo_env, model_dir, tag="b") as b,
        ):
            await wait_for_model(frontend.url, "tiny", 20)
            await wait_for_instances(frontend.url, 2, 20)  # both instances known to the router
            for i in range(6):
                fail_at = 0 if i % 2 == 0 else 2  # before the first token, and mid-stream
                annotations = [f"fail:{kind}", "fail_tag:a", f"fail_at:{fail_at}"]
                reply = await post(
                    frontend.url, body(chat=False, stream=i >= 3, max_tokens=6, annotations=annotations), chat=False
                )
                assert reply.status == 200, reply
                assert reply.error() is None, reply
                assert reply.finish_reason() == "length"
            assert a.count("REQ") >= 1, "worker a never got a request"
            assert b.count("DONE") == 6


@pytest.mark.parametrize("frontend", [3], indirect=True)
@pytest.mark.parametrize("kind", ["Unknown", "InvalidArgument"])
async def test_non_migratable_error_is_not_migrated(
    frontend: Frontend, dynamo_env: DynamoEnv, model_dir: Path, kind: str
) -> None:
    status = {"Unknown": 500, "InvalidArgument": 400}[kind]
    with trio.fail_after(TEST_TIMEOUT):
        async with (
            start_echo_worker(dynamo_env, model_dir, tag="a") as a,
            start_echo_worker(dynamo_env, model_dir, tag="b") as b,
        ):
            await wait_for_model(frontend.url, "tiny", 20)
            await wait_for_instances(frontend.url, 2, 20)
            failed = 0
            for _ in range(6):
                reply = await post(frontend.url, body(max_tokens=4, annotations=[f"fail:{kind}", "fail_tag:a"]))
                assert reply.status in (200, status), reply
                failed += reply.status == status
            assert failed >= 1
            assert failed == a.count("REQ"), "a failed request was retried elsewhere"
            assert b.count("REQ") == 6 - failed


async def test_client_disconnect_cancels_the_trio_handler_task(
    frontend: Frontend, dynamo_env: DynamoEnv, model_dir: Path
) -> None:
    latencies = []
    with trio.fail_after(TEST_TIMEOUT):
        async with start_echo_worker(dynamo_env, model_dir) as worker:
            await wait_for_model(frontend.url, "tiny", 20)
            payload = body(chat=False, stream=True, max_tokens=1000, annotations=["delay:0.02", "batch:1"])
            for _ in range(5):
                start = len(worker.process.log())
                async with (
                    httpx.AsyncClient(timeout=10) as client,
                    client.stream("POST", frontend.url + "/v1/completions", json=payload) as response,
                ):
                    seen = 0
                    async for line in response.aiter_lines():
                        seen += line.startswith("data:")
                        if seen >= 5:
                            break
                    closed_at = time.monotonic()
                match = await worker.process.wait_for_log(r"^CANCELLED a \S+ (\S+)$", 5, start=start)
                latencies.append(float(match.group(1)) - closed_at)
    print(f"\ncancel propagation (client close -> trio Cancelled): {[f'{x * 1000:.0f} ms' for x in latencies]}")
    assert statistics.median(latencies) < 0.5
    assert max(latencies) < 1.0


@pytest.mark.parametrize("frontend", [0], indirect=True)
async def test_withdraw_and_restore(frontend: Frontend, dynamo_env: DynamoEnv, model_dir: Path) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        async with (
            start_echo_worker(dynamo_env, model_dir, tag="a") as a,
            start_echo_worker(dynamo_env, model_dir, tag="b") as b,
        ):
            await wait_for_model(frontend.url, "tiny", 20)
            await wait_for_instances(frontend.url, 2, 20)
            # An in-flight stream on a survives the withdrawal.
            inflight: list[object] = []

            async def long_request() -> None:
                annotations = ["delay:0.05", "batch:1", "fail:Unknown", "fail_tag:b", "fail_at:1000"]
                inflight.append(
                    await post(frontend.url, body(chat=False, max_tokens=20, annotations=annotations), chat=False)
                )

            async with trio.open_nursery() as nursery:
                # Round robin: send until one lands on a.
                for _ in range(10):
                    before, landed = a.count("REQ"), a.count("REQ") + b.count("REQ")
                    nursery.start_soon(long_request)
                    await wait_until(lambda: a.count("REQ") + b.count("REQ") > landed, timeout=10)  # noqa: B023
                    if a.count("REQ") > before:
                        break
                assert a.count("REQ") >= 1
                t0 = time.monotonic()
                assert await a.command("withdraw") == "None"
                withdraw_s = time.monotonic() - t0
                withdrawn = int(a.instance_hex, 16)

                async def a_unknown() -> bool:
                    return withdrawn not in await frontend_instances(frontend.url)

                await wait_until(a_unknown, timeout=10, what="the frontend's discovery watch drops a")
                assert await a.command("present") == "True"  # it publishes what it should: the card only
                seen_a = a.count("REQ")
                for _ in range(4):
                    reply = await post(frontend.url, body(chat=False, max_tokens=2), chat=False)
                    assert reply.status == 200
                assert a.count("REQ") == seen_a, "a withdrawn worker got a new request"
            assert all(getattr(r, "status", None) == 200 for r in inflight), inflight
            assert a.count("DONE") >= 1
            t0 = time.monotonic()
            await a.command("restore")
            restore_s = time.monotonic() - t0
            with trio.fail_after(10):
                while a.count("REQ") == seen_a:
                    reply = await post(frontend.url, body(chat=False, max_tokens=2), chat=False)
                    assert reply.status == 200
            routed_again_s = time.monotonic() - t0
            assert b.process.returncode is None
    print(f"\nwithdraw call {withdraw_s * 1000:.1f} ms, restore call {restore_s * 1000:.1f} ms")
    print(f"withdrawn worker routed again {routed_again_s:.2f} s after restore")


async def test_withdrawn_single_worker_answers_503_and_comes_back(
    frontend: Frontend, dynamo_env: DynamoEnv, model_dir: Path
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        async with start_echo_worker(dynamo_env, model_dir) as worker:
            await wait_for_model(frontend.url, "tiny", 20)
            await worker.command("withdraw")
            t0 = time.monotonic()
            await wait_until(lambda: _status_is(frontend.url, 503), timeout=10, interval=0.02)
            gone_s = time.monotonic() - t0
            await worker.command("restore")
            t0 = time.monotonic()
            await wait_until(lambda: _status_is(frontend.url, 200), timeout=10, interval=0.02)
            back_s = time.monotonic() - t0
    print(f"\nwithdraw -> 503 after {gone_s:.3f} s; restore -> 200 after {back_s:.3f} s")


async def test_unregister_and_register_again(frontend: Frontend, dynamo_env: DynamoEnv, model_dir: Path) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        async with start_echo_worker(dynamo_env, model_dir) as worker:
            await wait_for_model(frontend.url, "tiny", 20)
            await worker.command("unregister")
            gone = await wait_for_model(frontend.url, "tiny", 10, present=False)
            assert (await post(frontend.url, body(max_tokens=2))).status == 404
            await worker.command("restore")
            await worker.command("register")
            back = await wait_for_model(frontend.url, "tiny", 10)
            await wait_until(lambda: _status_is(frontend.url, 200), timeout=10, interval=0.05)
    print(f"\nunregister -> gone from /v1/models after {gone:.3f} s; register -> listed after {back:.3f} s")


async def test_lost_registration_is_detected_and_republished(
    frontend: Frontend, dynamo_env: DynamoEnv, model_dir: Path
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        async with start_echo_worker(dynamo_env, model_dir) as worker:
            await wait_for_model(frontend.url, "tiny", 20)
            assert await worker.command("present") == "True"
            await worker.command("republish")  # harmless while everything is in place
            assert (await post(frontend.url, body(max_tokens=2))).status == 200
            instance, card = file_discovery_keys(DynamoSettings(), int(worker.instance_hex, 16), dynamo_env.file_kv)
            assert instance.is_file()
            assert card.is_file()
            instance.unlink()
            card.unlink()
            assert await worker.command("present") == "False"
            await wait_for_model(frontend.url, "tiny", 10, present=False)
            await worker.command("republish")
            assert await worker.command("present") == "True"
            back = await wait_for_model(frontend.url, "tiny", 10)
            assert (await post(frontend.url, body(max_tokens=2))).status == 200
    print(f"\nrepublished registration listed again after {back:.3f} s")


async def test_sigterm_drains_in_flight_requests(frontend: Frontend, dynamo_env: DynamoEnv, model_dir: Path) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        async with start_echo_worker(dynamo_env, model_dir) as worker:
            await wait_for_model(frontend.url, "tiny", 20)
            payload = body(chat=False, stream=True, max_tokens=15, annotations=["delay:0.1", "batch:1"])
            replies = []

            async def stream() -> None:
                replies.append(await post(frontend.url, payload, chat=False))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream)
                await worker.process.wait_for_log(r"^REQ a ", 5)
                # Not a synchronisation: the SIGTERM is meant to land a few tokens into the stream (0.1 s each).
                await trio.sleep(0.3)
                worker.process.signal(signal.SIGTERM)
                await worker.process.wait_for_log(r"^SHUTDOWN_BEGIN", 5)
                # No new requests reach a draining worker, once the frontend has seen it go.
                await wait_until(lambda: _no_instances(frontend.url), timeout=10, what="the draining worker unlisted")
                late = await post(frontend.url, body(chat=False, max_tokens=2), chat=False)
                assert late.status in (404, 503), late
            [reply] = replies
            assert reply.status == 200
            assert reply.error() is None
            assert reply.finish_reason() == "length"
            assert reply.events[-1]["usage"]["completion_tokens"] == 15
            assert await worker.process.wait(10) == 0
            log = worker.process.log()
            assert re.search(r"^SHUTDOWN_DONE", log, re.MULTILINE)
            assert re.search(r"^EXIT", log, re.MULTILINE)
            assert "tiny" not in await list_models(frontend.url)
            assert not list((dynamo_env.file_kv / "v1" / "instances").glob("*"))


@pytest.mark.parametrize("health_payload", [False, True])
async def test_set_health_drives_the_system_health_endpoint(
    frontend: Frontend, dynamo_env: DynamoEnv, model_dir: Path, health_payload: bool
) -> None:
    extra = () if health_payload else ("--no-health-payload",)
    with trio.fail_after(TEST_TIMEOUT):
        async with (
            start_echo_worker(dynamo_env, model_dir, extra=extra) as worker,
            httpx.AsyncClient(timeout=5) as client,
        ):
            url = f"http://127.0.0.1:{worker.system_port}/health"
            assert (await client.get(url)).status_code == 200  # the worker calls set_health(True) once serving
            await worker.command("health 0")
            # Served with a health_check_payload, /health follows the endpoint's own (canary) health and
            # set_health(False) has no effect: Dynamo 1.6.1 behaviour, pinned here.
            expected = 200 if health_payload else 503
            await wait_until(lambda: _get_status(client, url, expected), timeout=5)
            await worker.command("health 1")
            await wait_until(lambda: _get_status(client, url, 200), timeout=5)


async def test_leaving_open_dynamo_without_shutdown_still_deregisters(
    frontend: Frontend, dynamo_env: DynamoEnv, model_dir: Path
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        async with start_echo_worker(dynamo_env, model_dir) as worker:
            await wait_for_model(frontend.url, "tiny", 20)
            t0 = time.monotonic()
            await worker.process.send_line("abort")
            assert await worker.process.wait(10) == 0
            exit_s = time.monotonic() - t0
            assert not list((dynamo_env.file_kv / "v1" / "instances").glob("*"))
            assert not list((dynamo_env.file_kv / "v1" / "mdc").glob("*"))
            gone = await wait_for_model(frontend.url, "tiny", 5, present=False)
    print(f"\nabort -> process exit {exit_s:.2f} s, model gone {gone:.3f} s later")


async def _status_is(url: str, status: int) -> bool:
    return (await post(url, body(max_tokens=2))).status == status


async def _no_instances(url: str) -> bool:
    return not await frontend_instances(url)


async def _get_status(client: httpx.AsyncClient, url: str, status: int) -> bool:
    return (await client.get(url)).status_code == status
