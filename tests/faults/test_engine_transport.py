"""The engine transport end to end (frontend → worker → openengine-mock): the engine's graceful stop (GOAWAY),
TLS in operation (a rotated client certificate, the worker's bound sockets), a Unix-domain socket."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import trio

from tests.helpers.pki import Pki, ahead
from tests.helpers.processes import DynamoEnv, Frontend, free_low_port, free_port, start_process
from tests.helpers.stack import MODEL, MODEL_DIR, start_engine, start_sidecar, wait_routable
from tests.helpers.waits import wait_until

from ._client import Outcome, stream_completion

pytestmark = pytest.mark.e2e

FAST_WATCH = (
    "--health-poll-interval-secs", "0.2", "--health-failure-threshold", "2", "--grpc-retry-interval-secs", "0.2",
    "--reconnect-backoff-max-secs", "0.5", "--abort-timeout-secs", "1",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------- GOAWAY


async def test_in_flight_requests_finish_across_the_engines_graceful_stop(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Issue 14 item 3: 8 streams of 40 tokens at 20 ms/token, the engine SIGTERMed after 10 tokens: 8/8 finish
    with a finish_reason; the worker withdraws at once and serves again once the engine is back."""
    port = free_port()
    engine_flags = ("--decode-ms-per-token", "20", "--stop-grace-secs", "5", "--kv-events", "disabled")
    with trio.fail_after(180):
        async with start_sidecar(dynamo_env, f"127.0.0.1:{port}", *FAST_WATCH, ready=None) as worker:
            async with start_engine(dynamo_env, *engine_flags, port=port) as engine:
                await wait_routable(frontend.url, workers=1)
                outcomes = [Outcome(status=0) for _ in range(8)]
                async with trio.open_nursery() as nursery:
                    for i, outcome in enumerate(outcomes):
                        nursery.start_soon(
                            partial(stream_completion, frontend.url, f"Story {i}", max_tokens=40, into=outcome)
                        )
                    await wait_until(lambda: min(len(o.pieces) for o in outcomes) >= 10, timeout=60, interval=0.005)
                    engine.process.signal(signal.SIGTERM)
                    await worker.process.wait_for_log(r"serving -> degraded.*going away", timeout=10)
                # Tokens by the usage: under load the worker merges the chunks Dynamo has not taken yet
                # (sidecar/convert/coalesce.py), so one SSE event may carry several tokens' text.
                finished = [(o.error, o.finish_reason, o.completion_tokens) for o in outcomes]
                assert finished == [(None, "length", 40)] * 8
                assert await engine.process.wait(timeout=15) == 0
            await worker.process.wait_for_log(r"degraded -> reconnecting", timeout=20)
            async with start_engine(dynamo_env, "--speedup", "0", port=port, name="engine-restarted"):
                await worker.process.wait_for_log(r"(?s)reconnecting.*registering -> serving", timeout=30)
                again = await stream_completion(frontend.url, "The river", max_tokens=8)
                assert again.succeeded, again


# ---------------------------------------------------------------------------------------------- Unix socket


async def test_a_worker_serves_an_engine_on_a_unix_socket(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    socket_path = dynamo_env.root / "engine.sock"
    with trio.fail_after(120):
        async with start_engine(dynamo_env, "--speedup", "0", "--uds", str(socket_path)) as engine:
            assert engine.address == f"unix://{socket_path}"
            async with start_sidecar(dynamo_env, f"unix://{socket_path}"):
                await wait_routable(frontend.url, workers=1)
                outcome = await stream_completion(frontend.url, "The river", max_tokens=12)
                assert outcome.succeeded, outcome
                assert outcome.completion_tokens == 12
            probe = await trio.run_process(
                [sys.executable, "-m", "sidecar", "probe", "--grpc-endpoint", f"unix://{socket_path}"],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert probe.returncode == 0, probe.stderr
            assert b"READY" in probe.stdout


# ---------------------------------------------------------------------------------------------- TLS


async def test_a_rotated_short_lived_client_certificate_lets_the_worker_serve_again(
    dynamo_env: DynamoEnv, frontend: Frontend, tmp_path: Path
) -> None:
    """Issue 21 item 1: the client certificate expires while the engine is down and is replaced on disk; the
    restarted engine refuses the old one. The worker reads the new files on reconnect and serves again."""
    pki = Pki.create(tmp_path)
    lifetime_s = 25.0
    pki.write_client(not_after=ahead(seconds=lifetime_s))
    expires_at = time.monotonic() + lifetime_s
    mock_tls = pki.mock_flags(client_ca=pki.ca_pem)
    sidecar_tls = (
        "--grpc-tls-ca", str(pki.ca_pem), "--grpc-tls-cert", str(pki.client_crt), "--grpc-tls-key", str(pki.client_key)
    )  # fmt: skip
    port = free_port()
    with trio.fail_after(180):
        async with (
            start_engine(dynamo_env, "--speedup", "0", *mock_tls, port=port) as engine,
            start_sidecar(dynamo_env, f"https://127.0.0.1:{port}", *sidecar_tls, *FAST_WATCH) as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            engine.process.proc.kill()
            await engine.process.wait(timeout=10)
            await worker.process.wait_for_log(r"serving -> reconnecting", timeout=20)
            # Not a synchronisation: what is awaited is time itself, the certificate's expiry.
            await trio.sleep(max(0.0, expires_at - time.monotonic()) + 1.0)
            pki.write_client()  # cert-manager renews the certificate in place
            async with start_engine(dynamo_env, "--speedup", "0", *mock_tls, port=port, name="engine-restarted"):
                await worker.process.wait_for_log(r"(?s)reconnecting.*registering -> serving", timeout=30)
                outcome = await stream_completion(frontend.url, "The river", max_tokens=8)
                assert outcome.succeeded, outcome
                assert "TLS files changed on disk" in worker.process.log()


# Dynamo's log line for each event-plane publisher it binds (ANSI colours stripped by _plain).
_DYNAMO_ZMQ_PUB = r"ZMQ PUB transport bound with configured HWM endpoint=tcp://0\.0\.0\.0:(\d+)"


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _listening_sockets(pid: int) -> list[tuple[str, str, int]]:
    """``(kind, address, port)`` of every TCP socket listening and UDP socket bound by process ``pid``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for kind in ("tcp", "tcp6", "udp", "udp6"):
        lines = Path(f"/proc/{pid}/net/{kind}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if inode not in inodes or (kind.startswith("tcp") and state != "0A"):  # 0A: LISTEN
                continue
            address_hex, port_hex = local.split(":")
            raw = bytes.fromhex(address_hex)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((kind, str(ipaddress.ip_address(raw)), int(port_hex, 16)))
    return found


async def test_a_worker_talking_tls_to_a_remote_engine_listens_on_loopback_only(
    dynamo_env: DynamoEnv, frontend: Frontend, tmp_path: Path
) -> None:
    """Issue 21 item 8: the sockets a running worker has bound, read from /proc, are all loopback -- with none of
    the DYN_*_HOST variables set (the worker's own defaults, not the test's environment, must keep them there)."""
    pki = Pki.create(tmp_path)
    env = dynamo_env.worker_env(DYN_SYSTEM_PORT=str(free_low_port()))
    for name in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST"):
        env.pop(name, None)
    with trio.fail_after(120):
        async with start_engine(dynamo_env, "--speedup", "0", *pki.mock_flags()) as engine:
            argv = [
                sys.executable, "-m", "sidecar", "--grpc-endpoint", f"https://{engine.address}",
                "--grpc-tls-ca", str(pki.ca_pem), "--model-path", str(MODEL_DIR), "--served-model-name", MODEL,
                "--ops-port", "0",
            ]  # fmt: skip
            async with start_process(
                argv, env, log_path=dynamo_env.log_path("sidecar"), ready="registering -> serving", ready_timeout=60
            ) as worker:
                await wait_routable(frontend.url, workers=1)
                sockets = _listening_sockets(worker.pid)
                assert any(kind.startswith("tcp") for kind, _, _ in sockets), sockets  # it does listen
                exposed = {port for _, address, port in sockets if not ipaddress.ip_address(address).is_loopback}
                # Dynamo 1.6.1's direct ZMQ event plane binds tcp://0.0.0.0:0 whatever DYN_EVENT_PLANE_HOST says
                # (only the advertised address follows it): the one exception, each one named by its log line.
                dynamo_pubs = {int(port) for port in re.findall(_DYNAMO_ZMQ_PUB, _plain(worker.log()))}
                assert exposed <= dynamo_pubs, f"bound beyond loopback: {exposed - dynamo_pubs} (all: {sockets})"
