"""Rules for calling Dynamo while its runtime calls into Python (etcd + NATS, Dynamo 1.6.1).

A serving worker's runtime threads run Python all the time: request handlers, ``/metrics`` callbacks, finished
futures. ``DistributedRuntime.endpoint(path)`` blocks its caller on the runtime with the GIL held, and with etcd and
NATS the build waits for I/O that only those threads drive. A LoRA worker built its three control endpoints that way
after it started serving and, in about 1 of 40 start-ups, hung for good after ``serving ... as instance`` (the
chaos soak's etcd run, the start-up stress in the closing note). ``busy_runtime_worker.py`` makes the runtime
threads busy on purpose, so both outcomes show in seconds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import trio

from tests.cluster.topology import find_binary, missing_binaries
from tests.helpers.processes import free_low_port, start_process

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.e2e

WORKER = Path(__file__).with_name("busy_runtime_worker.py")
#: Ample for three endpoints served on two busy cores; the deadlock never ends.
SERVE_BOUND_S = 20.0


@pytest.fixture
async def control_plane(tmp_path: Path) -> AsyncIterator[dict[str, str]]:
    """etcd and nats-server on loopback; the environment a worker needs to reach them."""
    missing = missing_binaries()
    if missing:
        message = f"{' and '.join(missing)} not installed (apt-get install -y etcd-server nats-server)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    etcd, nats = find_binary("etcd"), find_binary("nats-server")
    assert etcd is not None
    assert nats is not None
    client, peer, nats_port = (free_low_port() for _ in range(3))
    etcd_url = f"http://127.0.0.1:{client}"
    etcd_argv = [
        etcd, "--name", "busy", "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", etcd_url,
        "--advertise-client-urls", etcd_url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}", "--initial-cluster",
        f"busy=http://127.0.0.1:{peer}", "--log-level", "warn",
    ]  # fmt: skip
    nats_argv = [nats, "-a", "127.0.0.1", "-p", str(nats_port), "-js", "-sd", str(tmp_path / "nats")]

    async def etcd_healthy(_: object) -> bool:
        try:
            async with httpx.AsyncClient(timeout=2) as http:
                return bool((await http.get(f"{etcd_url}/health")).json().get("health") == "true")
        except (httpx.HTTPError, ValueError):
            return False

    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    async with (
        start_process(etcd_argv, env, log_path=tmp_path / "etcd.log", ready=etcd_healthy),
        start_process(nats_argv, env, log_path=tmp_path / "nats.log", ready="Server is ready"),
    ):
        yield {**env, "ETCD_ENDPOINTS": etcd_url, "NATS_SERVER": f"nats://127.0.0.1:{nats_port}"}


async def _run_worker(env: dict[str, str], tmp_path: Path, when: str) -> tuple[bool, str]:
    """Whether the worker served its controls within the bound, and its log."""
    worker_env = {**env, "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_SYSTEM_PORT": str(free_low_port())}
    log = tmp_path / f"worker-{when}.log"
    argv = [sys.executable, str(WORKER), "--when", when]
    async with start_process(argv, worker_env, log_path=log, ready=r"^BUSY \d+", ready_timeout=60) as worker:
        with trio.move_on_after(SERVE_BOUND_S):
            await worker.wait_for_log(r"^ANSWERED ", SERVE_BOUND_S)
            return True, worker.log()
        return False, worker.log()


async def test_control_endpoints_built_with_the_runtime_are_served_while_it_runs_python(
    control_plane: dict[str, str], tmp_path: Path
) -> None:
    """``open_dynamo(controls=...)`` builds the endpoints before any callback exists: serving them later, with
    every runtime thread in a ``/metrics`` callback, finishes and the control answers."""
    with trio.fail_after(120):
        served, log = await _run_worker(control_plane, tmp_path, "with-runtime")
    assert served, f"controls not served within {SERVE_BOUND_S} s:\n{log[-3000:]}"
    assert '"status":"ok"' in log.replace(" ", "")


async def test_building_an_endpoint_while_the_runtime_runs_python_deadlocks(
    control_plane: dict[str, str], tmp_path: Path
) -> None:
    """The binding fact behind the rule (Dynamo 1.6.1): built once the runtime calls into Python, the first endpoint
    never comes back. If a Dynamo upgrade makes this pass, the rule in ``b.create_runtime`` may go."""
    with trio.fail_after(120):
        served, log = await _run_worker(control_plane, tmp_path, "late")
    assert "BUSY" in log
    assert not served, "building an endpoint while the runtime runs Python no longer deadlocks"
    assert "SERVED" not in log
