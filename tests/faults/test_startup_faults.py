"""Start-up faults, the lost-registration watchdog, fail-fast mode and TLS towards the engine.

Each start-up fault either waits (engine not up yet, model still loading) or refuses with one clear line and exit
status 1 — never a half-registered worker.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trustme

from tests.helpers.processes import DynamoEnv, Frontend, free_port
from tests.helpers.stack import start_engine, start_sidecar, wait_engine_idle, wait_routable
from tests.helpers.waits import wait_until

from ._client import Outcome, stream_completion

pytestmark = pytest.mark.e2e

FAST = ("--grpc-retry-interval-secs", "0.2")


async def test_a_worker_started_before_its_engine_waits_then_serves(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    port = free_port()
    with trio.fail_after(90):
        async with start_sidecar(dynamo_env, f"127.0.0.1:{port}", *FAST, ready=None) as worker:
            await trio.sleep(1.5)  # not a synchronisation: a negative check, no engine for a while
            assert worker.process.returncode is None
            assert "-> serving" not in worker.process.log()
            async with start_engine(dynamo_env, "--speedup", "0", port=port):
                await worker.process.wait_for_log(r"registering -> serving", timeout=30)
                await wait_routable(frontend.url, workers=1)


async def test_a_slow_model_load_is_waited_on_in_starting(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    # An engine that listens while loading and says STARTING: the full engine. TensorRT-LLM keeps its port closed
    # until loaded instead (the worker-before-engine test above).
    with trio.fail_after(90):
        async with start_engine(dynamo_env, "--profile", "full", "--speedup", "0", "--startup-delay", "3") as engine:
            started = trio.current_time()
            async with start_sidecar(dynamo_env, engine.address, *FAST) as worker:
                assert trio.current_time() - started >= 2.5, "registered before the engine was READY"
                assert "health STARTING" in worker.process.log()
                await wait_routable(frontend.url, workers=1)


@pytest.mark.parametrize(
    ("mock_args", "sidecar_args", "refusal"),
    [
        (("--schema-release", "main"), (), "main"),
        (("--schema-release", "0123456789abcdef0123456789abcdef"), (), "0123456789abcdef"),
        ((), ("--expected-engine", "vllm"), "vllm"),
        (("--schema-release", "empty"), ("--expected-schema-release", "768a93c7b44e"), "empty schema_release"),
        (("--model-alias", "other-model"), (), "--model"),
    ],
    ids=[
        "moving-schema-name",
        "other-schema-release",
        "wrong-engine",
        "no-schema-release-but-one-expected",
        "several-models-without-model",
    ],
)
async def test_an_incompatible_engine_is_refused_with_one_clear_line(
    dynamo_env: DynamoEnv, mock_args: tuple[str, ...], sidecar_args: tuple[str, ...], refusal: str
) -> None:
    with trio.fail_after(60):
        async with (
            start_engine(dynamo_env, "--speedup", "0", *mock_args) as engine,
            start_sidecar(dynamo_env, engine.address, *FAST, *sidecar_args, ready=None) as worker,
        ):
            with trio.fail_after(30):
                assert await worker.process.proc.wait() == 1
            lines = [line for line in worker.process.log().splitlines() if "refusing to start" in line]
            assert len(lines) == 1, worker.process.log_tail()
            assert refusal in lines[0]
            assert "-> serving" not in worker.process.log()


async def test_a_prefix_schema_release_like_tensorrt_llm_sends_is_accepted(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    with trio.fail_after(60):
        async with (
            start_engine(dynamo_env, "--speedup", "0", "--schema-release", "prefix") as engine,
            start_sidecar(dynamo_env, engine.address, *FAST),
        ):
            await wait_routable(frontend.url, workers=1)


async def test_no_engine_at_all_is_refused_after_the_startup_deadline(dynamo_env: DynamoEnv) -> None:
    with trio.fail_after(60):
        port = free_port()
        async with start_sidecar(
            dynamo_env, f"127.0.0.1:{port}", *FAST, "--grpc-startup-deadline-secs", "2", ready=None
        ) as worker:
            with trio.fail_after(20):
                assert await worker.process.proc.wait() == 1
            assert "could not reach OpenEngine" in worker.process.log()


async def test_exit_on_engine_loss_fails_fast_with_status_1(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    with trio.fail_after(60):
        async with (
            start_engine(dynamo_env, "--speedup", "0") as engine,
            start_sidecar(
                dynamo_env,
                engine.address,
                *FAST,
                "--exit-on-engine-loss",
                "--health-poll-interval-secs",
                "0.2",
                "--health-failure-threshold",
                "2",
            ) as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            engine.process.proc.kill()
            with trio.fail_after(20):
                assert await worker.process.proc.wait() == 1
            assert "--exit-on-engine-loss" in worker.process.log()


async def test_a_deleted_discovery_entry_is_restored_under_load(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    """File discovery never restores a lost entry by itself; the worker's watchdog does. Requests during the gap
    get a clear error or their full answer — never a truncated success."""
    outcomes: list[Outcome] = []
    with trio.fail_after(90):
        async with (
            start_engine(dynamo_env, "--decode-ms-per-token", "2") as engine,
            start_sidecar(dynamo_env, engine.address, "--registration-check-interval-secs", "0.3") as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            async with trio.open_nursery() as nursery:

                async def load() -> None:
                    for _ in range(40):
                        outcomes.append(await stream_completion(frontend.url, "The river", max_tokens=8))
                        await trio.sleep(0.05)  # not a synchronisation: the load's pace

                nursery.start_soon(load)
                await wait_until(lambda: len(outcomes) >= 2, timeout=30)  # the load runs
                removed = _remove_instance_files(dynamo_env.file_kv)
                assert removed, "found no discovery entries to delete"
                await worker.process.wait_for_log(r"registration disappeared; publishing it again", timeout=10)
            assert all(o.succeeded or o.failed_cleanly for o in outcomes)
            assert all(o.completion_tokens == 8 for o in outcomes if o.succeeded)
            assert outcomes[-1].succeeded, "requests flow again after the restore"
            await wait_engine_idle(engine.address, timeout=2)


def _remove_instance_files(root: Path) -> list[Path]:
    files = [p for sub in ("v1/instances", "v1/mdc") for p in (root / sub).glob("*") if p.is_file()]
    for path in files:
        path.unlink()
    return files


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
async def test_tls_to_an_engine_on_another_host(
    dynamo_env: DynamoEnv, frontend: Frontend, tmp_path: Path, mutual: bool
) -> None:
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    client_cert = ca.issue_cert("sidecar.client")
    ca_pem, server_pem, client_pem = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "client.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    server_cert.private_key_and_cert_chain_pem.write_to_path(str(server_pem))
    client_cert.private_key_and_cert_chain_pem.write_to_path(str(client_pem))
    mock_tls = ["--tls-cert", str(server_pem), "--tls-key", str(server_pem)]
    if mutual:
        mock_tls += ["--tls-client-ca", str(ca_pem)]
    sidecar_tls = ["--grpc-tls-ca", str(ca_pem)]
    if mutual:
        sidecar_tls += ["--grpc-tls-cert", str(client_pem), "--grpc-tls-key", str(client_pem)]
    with trio.fail_after(90):
        async with start_engine(dynamo_env, "--speedup", "0", *mock_tls) as engine:
            if mutual:
                # Without a client certificate the engine refuses the handshake: the worker never registers.
                async with start_sidecar(
                    dynamo_env,
                    f"https://{engine.address}",
                    "--grpc-tls-ca",
                    str(ca_pem),
                    *FAST,
                    "--grpc-startup-deadline-secs",
                    "2",
                    ready=None,
                    name="sidecar-no-client-cert",
                ) as refused:
                    with trio.fail_after(30):
                        assert await refused.process.proc.wait() == 1
            async with start_sidecar(dynamo_env, f"https://{engine.address}", *sidecar_tls, *FAST):
                await wait_routable(frontend.url, workers=1)
                outcome = await stream_completion(frontend.url, "The river", max_tokens=6)
                assert outcome.succeeded, outcome


async def test_a_tls_endpoint_without_tls_configured_is_a_bad_flag(dynamo_env: DynamoEnv) -> None:
    with trio.fail_after(30):
        async with start_sidecar(dynamo_env, "https://127.0.0.1:1", ready=None) as worker:
            assert await worker.process.proc.wait() == 2
            assert "--grpc-tls-ca" in worker.process.log()
