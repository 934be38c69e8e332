"""The system port before Dynamo's runtime exists (``sidecar.ops.health``), and one line for a port in use."""

from __future__ import annotations

import socket
import subprocess
import sys
from typing import TYPE_CHECKING

import httpx
import trio

from sidecar.ops import health
from tests.helpers.processes import free_low_port, free_port

if TYPE_CHECKING:
    from pathlib import Path

    from statemachines import WorkerLifecycle


async def get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as http:
        return await http.get(url)


async def test_the_startup_port_answers_with_state_and_reason_then_frees_the_port(
    worker_model: WorkerLifecycle,
) -> None:
    port = health.StartupPort(worker_model, "127.0.0.1", 0)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            host, bound = await nursery.start(port.run)
            base = f"http://{host}:{bound}"
            worker_model.fire("connect", reason="127.0.0.1:50051")
            response = await get(f"{base}/health")
            assert response.status_code == 503
            assert response.json() == {"status": "notready", "state": "connecting", "reason": "127.0.0.1:50051"}
            for path in ("/live", "/engine/live"):
                response = await get(f"{base}{path}")
                assert response.status_code == 200
                assert response.json()["state"] == "connecting"
                assert response.json()["ready"] is False
            response = await get(f"{base}/metrics")
            assert response.status_code == 200
            assert "openengine_sidecar_worker_state{" in response.text
            response = await get(f"{base}/engine/load_lora")  # Dynamo's routes come with its runtime
            assert response.status_code == 503
            assert "runtime" in response.json()["message"]

            await port.release()
            # Free at once: Dynamo's runtime binds it right after (with SO_REUSEADDR, as tokio's listeners do: the
            # connections the sidecar answered linger in TIME_WAIT).
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, bound))
                sock.listen()
            nursery.cancel_scope.cancel()


async def test_health_is_200_only_while_serving(worker_model: WorkerLifecycle) -> None:
    seen = []
    for event in ("connect", "connected", "discovered", "ready", "registered", "degrade", "recover", "registered"):
        worker_model.fire(event)
        seen.append((worker_model.state, health.readiness(worker_model)[0]))
    worker_model.fire("drain")
    seen.append((worker_model.state, health.readiness(worker_model)[0]))
    assert [state for state, status in seen if status == 200] == ["serving", "serving"]
    assert all(status == 503 for state, status in seen if state != "serving")


async def test_release_before_run_returns_at_once(worker_model: WorkerLifecycle) -> None:
    with trio.fail_after(2):
        await health.StartupPort(worker_model, "127.0.0.1", 0).release()


def _refusal(model_dir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "sidecar", "--grpc-endpoint", f"127.0.0.1:{free_port()}", "--model-path"]
    return subprocess.run(
        [*argv, str(model_dir), *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def test_a_port_in_use_is_one_line(model_dir: Path, tmp_path: Path) -> None:
    """The ops port or the system port already taken: exit 1 with one line naming it, never a traceback."""
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    base.update({"HOME": str(tmp_path), "DYN_FILE_KV": str(tmp_path / "kv"), "DYN_SYSTEM_HOST": "127.0.0.1"})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_low_port()))
        taken.listen()
        port = taken.getsockname()[1]
        for env, args, says in (
            (base, ("--ops-port", str(port)), f"--ops-port {port} on 127.0.0.1"),
            ({**base, "DYN_SYSTEM_PORT": str(port)}, (), f"DYN_SYSTEM_PORT {port} on 127.0.0.1"),
        ):
            done = _refusal(model_dir, env, *args)
            assert done.returncode == 1, done.stderr
            assert "Traceback" not in done.stderr
            errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
            assert len(errors) == 1, done.stderr
            assert says in errors[0]
            assert "in use" in errors[0]
