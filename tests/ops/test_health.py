"""The system port (``sidecar.ops.health.SystemPort``): the sidecar's for the whole life, Dynamo's server behind it.

Rulebook:

* ``/health``, ``/live`` and ``/engine/live`` are answered by the sidecar in every phase, with the state and reason;
* before Dynamo's runtime runs (and after it stopped) ``/metrics`` is the sidecar's families and every other path is
  503 with the state;
* while it runs every other request is relayed to Dynamo's own server (method, query, headers, body; the answer
  streamed back, chunked stays chunked), and a server that refuses or stays silent is one line, 502 or 504;
* Dynamo's server gets ``DYN_SYSTEM_PORT=0`` (the OS picks when it binds; the relay goes where the runtime says it
  bound) unless ``--dynamo-system-port`` names one, which is held from start-up until handed over, then free;
* a port in use is one line, never a traceback.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

import h11
import httpx
import pytest
import trio

from sidecar.ops import health
from tests.helpers.processes import free_low_port, free_port

if TYPE_CHECKING:
    from pathlib import Path

    from statemachines import WorkerLifecycle


async def get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as http:
        return await http.get(url)


class FakeDynamo:
    """Dynamo's system server, as far as the relay can tell: records each request, answers as told."""

    def __init__(self) -> None:
        self.seen: list[tuple[bytes, bytes, dict[bytes, bytes], bytes]] = []
        self.silent = False

    async def serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        request: h11.Request | None = None
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
        assert request is not None
        self.seen.append((request.method, request.target, dict(request.headers), body))
        if self.silent:
            await trio.sleep_forever()
        # No content-length: chunked, the way Dynamo's axum server streams /metrics.
        await stream.send_all(conn.send(h11.Response(status_code=201, headers=[("x-dynamo", "1")])) or b"")
        for piece in (b"answer to ", request.target, b" with ", body):
            await stream.send_all(conn.send(h11.Data(data=piece)) or b"")
        await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
        await stream.aclose()


async def test_before_dynamo_runs_the_port_answers_with_state_and_reason(worker_model: WorkerLifecycle) -> None:
    port = health.SystemPort(worker_model, "127.0.0.1", 0)
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
            assert response.json()["state"] == "connecting"
            assert "runtime" in response.json()["message"]
            async with httpx.AsyncClient(timeout=5) as http:
                response = await http.post(f"{base}/health", json={})
            assert (response.status_code, response.headers["allow"]) == (405, "GET")
            nursery.cancel_scope.cancel()


async def test_while_dynamo_runs_everything_else_is_relayed_to_it(worker_model: WorkerLifecycle) -> None:
    dynamo = FakeDynamo()
    port = health.SystemPort(worker_model, "127.0.0.1", 0)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            host, bound = await nursery.start(port.run)
            base = f"http://{host}:{bound}"
            assert port.dynamo_environment() == {"DYN_SYSTEM_HOST": "127.0.0.1", "DYN_SYSTEM_PORT": "0"}
            port.release_dynamo_port()
            # Dynamo binds a port the OS picks and the runtime reports it.
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            await nursery.start(trio.serve_listeners, dynamo.serve, listeners)
            port.forward_to_dynamo(listeners[0].socket.getsockname()[1])
            for event in ("connect", "connected", "discovered", "ready", "registered"):
                worker_model.fire(event, reason="engine READY")

            async with httpx.AsyncClient(timeout=5) as http:
                response = await http.get(f"{base}/metrics?name[]=x", headers={"accept": "text/plain"})
                assert (response.status_code, response.text) == (201, "answer to /metrics?name[]=x with ")
                assert response.headers["x-dynamo"] == "1"
                body = {"lora_name": "a", "source": {"uri": "file:///adapters/a"}}
                response = await http.post(f"{base}/engine/load_lora", json=body)
                assert response.status_code == 201
                method, target, headers, sent = dynamo.seen[-1]
                assert (method, target) == (b"POST", b"/engine/load_lora")
                assert json.loads(sent) == body
                assert headers[b"content-type"] == b"application/json"
                assert headers[b"connection"] == b"close"  # one request per relayed connection
                relayed = len(dynamo.seen)
                # Readiness and liveness stay the sidecar's: Dynamo's server never sees them.
                for path in ("/health", "/live", "/engine/live"):
                    response = await http.get(f"{base}{path}")
                    assert (response.status_code, response.json()["state"]) == (200, "serving"), path
                worker_model.fire("engine_lost", reason="engine gone")
                response = await http.get(f"{base}/health")
                assert response.status_code == 503
                assert response.json()["state"] == "reconnecting"
                assert response.json()["reason"] == "engine gone"
                assert len(dynamo.seen) == relayed

                port.answer_alone()  # Dynamo's runtime has shut down: the sidecar's own answers again
                response = await http.get(f"{base}/metrics")
                assert "openengine_sidecar_worker_state{" in response.text
                assert len(dynamo.seen) == relayed
            nursery.cancel_scope.cancel()


async def test_a_dynamo_server_that_refuses_or_stays_silent_is_one_line(worker_model: WorkerLifecycle) -> None:
    dynamo = FakeDynamo()
    dynamo.silent = True
    dynamo_port = free_low_port()
    port = health.SystemPort(worker_model, "127.0.0.1", 0, control_timeout_s=0.5, dynamo_port=dynamo_port)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=10) as http:
            host, bound = await nursery.start(port.run)
            base = f"http://{host}:{bound}"
            port.release_dynamo_port()
            port.forward_to_dynamo(dynamo_port)
            # Nothing listens on Dynamo's port yet.
            response = await http.get(f"{base}/metrics")
            assert response.status_code == 502
            assert response.text.count("\n") == 1
            assert f"Dynamo's system server (127.0.0.1:{dynamo_port}) is not answering" in response.text

            listeners = await trio.open_tcp_listeners(dynamo_port, host="127.0.0.1")
            await nursery.start(trio.serve_listeners, dynamo.serve, listeners)
            response = await http.post(f"{base}/engine/load_lora", json={"lora_name": "a"})
            assert response.status_code == 504
            assert response.text == f"Dynamo's system server (127.0.0.1:{dynamo_port}) did not answer within 0.5s\n"
            nursery.cancel_scope.cancel()


async def test_by_default_nothing_is_reserved_and_the_os_picks_dynamos_port(worker_model: WorkerLifecycle) -> None:
    """Issue 27 item 9: the sidecar drew Dynamo's port at random from 20000-32767 and held it, taking a port some other
    service of the host may expect. Now Dynamo gets 0 (its value reads fine as a 16-bit number) and binds a port the
    OS picks; the relay learns it from the runtime. Without one reported, the sidecar keeps answering alone."""
    port = health.SystemPort(worker_model, "127.0.0.1", 0)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            host, bound = await nursery.start(port.run)
            assert port.dynamo_environment() == {"DYN_SYSTEM_HOST": "127.0.0.1", "DYN_SYSTEM_PORT": "0"}
            assert port.dynamo_port == 0
            port.release_dynamo_port()
            port.forward_to_dynamo(None)  # a runtime that started no system server
            response = await get(f"http://{host}:{bound}/metrics")
            assert response.status_code == 200
            assert "openengine_sidecar_worker_state{" in response.text
            nursery.cancel_scope.cancel()


async def test_a_dynamo_system_port_asked_for_is_held_until_handed_over(worker_model: WorkerLifecycle) -> None:
    dynamo_port = free_low_port()
    port = health.SystemPort(worker_model, "127.0.0.1", 0, dynamo_port=dynamo_port)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            _, bound = await nursery.start(port.run)
            environment = port.dynamo_environment()
            assert environment == {"DYN_SYSTEM_HOST": "127.0.0.1", "DYN_SYSTEM_PORT": str(dynamo_port)}
            assert dynamo_port != bound
            with socket.socket() as sock, pytest.raises(OSError, match="in use"):
                sock.bind(("127.0.0.1", dynamo_port))
            port.release_dynamo_port()
            port.release_dynamo_port()  # idempotent
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", dynamo_port))
                sock.listen()
            nursery.cancel_scope.cancel()


async def test_a_dynamo_system_port_its_last_run_left_in_time_wait_is_held_again(
    worker_model: WorkerLifecycle,
) -> None:
    """A worker restarted within a minute of its last run: Dynamo's server there had closed its connections first
    (the relay's scrapes), so the port sits in TIME_WAIT. Seen in a 10-minute etcd soak: the restarted sidecar
    refused to start ("Address already in use") and exited 1. Failed before: the reservation did not set
    SO_REUSEADDR, as every server's listener does."""
    dynamo_port = free_low_port()
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Dynamo's (tokio's) listener
        server.bind(("127.0.0.1", dynamo_port))
        server.listen()
        client = socket.create_connection(("127.0.0.1", dynamo_port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: TIME_WAIT on dynamo_port
        client.recv(1)  # its FIN has arrived
        client.close()
    port = health.SystemPort(worker_model, "127.0.0.1", 0, dynamo_port=dynamo_port)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(port.run)
            with socket.socket() as sock, pytest.raises(OSError, match="in use"):
                sock.bind(("127.0.0.1", dynamo_port))  # still held against anyone else
            nursery.cancel_scope.cancel()


async def test_a_dynamo_system_port_in_use_is_one_line_naming_the_flag(worker_model: WorkerLifecycle) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_low_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        port = health.SystemPort(worker_model, "127.0.0.1", 0, dynamo_port=busy)
        with (
            trio.fail_after(20),
            pytest.raises(OSError, match=f"--dynamo-system-port {busy} on 127.0.0.1: .*in use") as refused,
        ):
            await port.run()  # fails before it serves anything
        assert refused.value.strerror == f"--dynamo-system-port {busy} on 127.0.0.1: Address already in use"


async def test_health_is_200_only_while_serving(worker_model: WorkerLifecycle) -> None:
    seen = []
    for event in ("connect", "connected", "discovered", "ready", "registered", "degrade", "recover", "registered"):
        worker_model.fire(event)
        seen.append((worker_model.state, health.readiness(worker_model)[0]))
    worker_model.fire("drain")
    seen.append((worker_model.state, health.readiness(worker_model)[0]))
    assert [state for state, status in seen if status == 200] == ["serving", "serving"]
    assert all(status == 503 for state, status in seen if state != "serving")


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
        own = {**base, "DYN_SYSTEM_PORT": str(free_low_port())}
        for env, args, says in (
            (base, ("--ops-port", str(port)), f"--ops-port {port} on 127.0.0.1"),
            ({**base, "DYN_SYSTEM_PORT": str(port)}, (), f"DYN_SYSTEM_PORT {port} on 127.0.0.1"),
            (own, ("--dynamo-system-port", str(port)), f"--dynamo-system-port {port} on 127.0.0.1"),
        ):
            done = _refusal(model_dir, env, *args)
            assert done.returncode == 1, done.stderr
            assert "Traceback" not in done.stderr
            errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
            assert len(errors) == 1, done.stderr
            assert says in errors[0]
            assert "in use" in errors[0]
