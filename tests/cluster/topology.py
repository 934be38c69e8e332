"""The distributed topology as processes: etcd + NATS, frontends, sidecar workers with their mock engines.

Builds on :mod:`tests.helpers.processes` (``start_process``: own process group, bounded waits, always killed) and
:mod:`tests.cluster.network` (hosts). Everything a test starts it also stops; :class:`Cluster` can stop and restart
any single process (a fault) and keeps the rest running.

Dynamo settings used (the same variables Dynamo's own workers and frontend read)::

    DYN_DISCOVERY_BACKEND=etcd   ETCD_ENDPOINTS=http://<cp>:2379
    DYN_REQUEST_PLANE=nats       NATS_SERVER=nats://<cp>:4222
    DYN_EVENT_PLANE=nats
    DYN_TCP_RPC_HOST, DYN_TCP_RESPONSE_STREAM_HOST, DYN_EVENT_PLANE_HOST, DYN_SYSTEM_HOST, DYN_HTTP_HOST:
                                 the address of the process's own host
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.helpers.processes import (
    Process,
    base_env,
    dump_log_tails,
    free_low_port,
    free_port,
    fresh_log_path,
    http_ok,
    start_process,
    stop_process,
)
from tests.helpers.stack import MODEL, MODEL_DIR
from tests.helpers.waits import wait_until

from .network import Host, Network

FRONTENDS: tuple[str, ...] = ("fe1", "fe2")
WORKERS: tuple[str, ...] = ("w1", "w2", "w3")
#: Raft entries etcd applies between two snapshots (its default, 100,000, is for a cluster that runs for weeks).
SNAPSHOT_COUNT = 1000
#: Entries etcd 3.4 keeps in memory after a snapshot (``snapshotCatchUpEntries``, fixed in 3.4).
CATCH_UP_ENTRIES = 5000
#: Last address octet of each host in namespace mode.
OCTETS: dict[str, int] = {"cp": 1, "fe1": 11, "fe2": 12, "w1": 21, "w2": 22, "w3": 23, "w4": 24}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RECEIVED = re.compile(r"push_handler.*request received")
_INSTANCE = re.compile(r"register_endpoint called .*instance_id=(\d+)")


def _read_logs(path: Path) -> list[str]:
    """The lines of ``name.log`` and of its restarts' ``name.N.log``."""
    stem = path.name.split(".")[0]
    lines: list[str] = []
    for log in sorted(path.parent.glob(f"{stem}.*log")):
        if re.fullmatch(rf"{re.escape(stem)}(\.\d+)?\.log", log.name):
            lines += _ANSI.sub("", log.read_text(errors="replace")).splitlines()
    return lines


def find_binary(name: str) -> str | None:
    """``etcd`` is in /usr/bin, Debian's ``nats-server`` in /usr/sbin (not on every PATH)."""
    candidates = (f"/usr/sbin/{name}", f"/usr/bin/{name}")
    return shutil.which(name) or next((p for p in candidates if os.access(p, os.X_OK)), None)


def missing_binaries() -> list[str]:
    return [name for name in ("etcd", "nats-server") if find_binary(name) is None]


def _port(host: Host, fixed: int) -> int:
    """A fixed port in a fresh namespace; an OS-picked one on shared loopback."""
    return fixed if host.netns else free_port()


def _low_port(host: Host, fixed: int) -> int:
    return fixed if host.netns else free_low_port()


async def _tcp_banner(address: str, port: int, prefix: bytes) -> bool:
    try:
        with trio.fail_after(2):
            stream = await trio.open_tcp_stream(address, port)
            async with stream:
                return (await stream.receive_some(256)).startswith(prefix)
    except (OSError, trio.TooSlowError):
        return False


@dataclass
class ClusterWorker:
    """One worker host: the sidecar and the mock engine it drives (the sidecar can be restarted on its own)."""

    name: str
    host: Host
    engine: Process
    engine_address: str
    sidecar: Process
    system_port: int
    stack: AsyncExitStack
    sidecar_stack: AsyncExitStack
    restarts: int = 0
    #: The engine's command line and its own stack: the engine can be stopped and started again on its own.
    engine_argv: list[str] = field(default_factory=list)
    engine_stack: AsyncExitStack | None = None

    @property
    def system_url(self) -> str:
        return f"http://{self.host.address}:{self.system_port}"

    def received(self) -> int:
        """Requests Dynamo handed to this worker so far, over all its sidecar runs (Dynamo logs each at INFO)."""
        return sum(_RECEIVED.search(line) is not None for line in _read_logs(self.sidecar.log_path))

    def instance_id(self) -> int | None:
        """The instance id the current sidecar run registered (from Dynamo's log line)."""
        ids = _INSTANCE.findall(_ANSI.sub("", self.sidecar.log()))
        return int(ids[-1]) if ids else None


@dataclass
class ClusterFrontend:
    name: str
    host: Host
    port: int
    process: Process
    stack: AsyncExitStack

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{self.port}"


@dataclass
class Cluster:
    """A running topology. Start/stop single processes with the methods; ``open_cluster`` stops everything."""

    network: Network
    root: Path
    env: dict[str, str]
    etcd_port: int
    nats_port: int
    stack: AsyncExitStack
    sidecar_args: tuple[str, ...] = ()
    engine_args: tuple[str, ...] = ()
    frontend_args: tuple[str, ...] = ()
    migration_limit: int = 3
    etcd: Process | None = None
    nats: Process | None = None
    frontends: dict[str, ClusterFrontend] = field(default_factory=dict)
    workers: dict[str, ClusterWorker] = field(default_factory=dict)
    frontend_restarts: dict[str, int] = field(default_factory=dict)
    # One exit stack per running control-plane service ("etcd", "nats"): each is stopped and restarted on its own.
    _service_stacks: dict[str, AsyncExitStack] = field(default_factory=dict)

    # ------------------------------------------------------------------ addresses and environment

    @property
    def cp(self) -> Host:
        return self.network["cp"]

    @property
    def etcd_url(self) -> str:
        return f"http://{self.cp.address}:{self.etcd_port}"

    @property
    def nats_url(self) -> str:
        return f"nats://{self.cp.address}:{self.nats_port}"

    def host_env(self, host: Host, **extra: str) -> dict[str, str]:
        """The shared Dynamo environment, every listener on ``host``'s address."""
        env = dict(self.env)
        env.update(
            {
                "ETCD_ENDPOINTS": self.etcd_url,
                "NATS_SERVER": self.nats_url,
                "DYN_TCP_RPC_HOST": host.address,
                "DYN_TCP_RESPONSE_STREAM_HOST": host.address,
                "DYN_EVENT_PLANE_HOST": host.address,
                "DYN_SYSTEM_HOST": host.address,
                "DYN_HTTP_HOST": host.address,
            }
        )
        env.update(extra)
        return env

    def log_path(self, name: str) -> Path:
        return fresh_log_path(self.root, name)

    def dump_logs(self, lines: int = 30) -> None:
        dump_log_tails(self.root, lines)

    # ------------------------------------------------------------------ control plane

    async def start_etcd(self) -> Process:
        """etcd on the control-plane host, data in ``root/etcd`` (kept across restarts)."""
        binary = find_binary("etcd")
        assert binary is not None
        host = self.cp
        peer = f"http://127.0.0.1:{_port(host, 2380)}"
        client = self.etcd_url
        argv = [
            binary,
            "--name",
            "oe-cp",
            "--data-dir",
            str(self.root / "etcd"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"oe-cp={peer}",
            "--logger",
            "zap",
            "--log-level",
            "warn",
            # As production runs etcd: without compaction every put and delete (workers joining, withdrawing,
            # restarting) stays in its history and its memory grows for good (+8.9 MB/h in the 60-minute soak).
            "--auto-compaction-mode",
            "periodic",
            "--auto-compaction-retention",
            "5m",
            # etcd 3.4 keeps its raft log in memory until a snapshot, then the last 5,000 entries (fixed); the default
            # 100,000 between snapshots is more than a test or an hour's soak writes, so its memory would only rise.
            "--snapshot-count",
            str(SNAPSHOT_COUNT),
        ]

        async def healthy(_: Process) -> bool:
            try:
                async with httpx.AsyncClient(timeout=2) as http:
                    return bool((await http.get(f"{client}/health")).json().get("health") == "true")
            except (httpx.HTTPError, ValueError):
                return False

        self.etcd = await self._start_service("etcd", host.argv(argv), healthy)
        return self.etcd

    async def stop_etcd(self, signum: int = signal.SIGKILL) -> None:
        assert self.etcd is not None
        await self._stop_service("etcd", self.etcd, signum)
        self.etcd = None

    async def start_nats(self) -> Process:
        """nats-server with JetStream on the control-plane host, store in ``root/nats``."""
        binary = find_binary("nats-server")
        assert binary is not None
        host = self.cp
        argv = [binary, "-a", host.address, "-p", str(self.nats_port), "-js", "-sd", str(self.root / "nats")]

        async def listening(_: Process) -> bool:
            return await _tcp_banner(host.address, self.nats_port, b"INFO ")

        self.nats = await self._start_service("nats", host.argv(argv), listening)
        return self.nats

    async def stop_nats(self, signum: int = signal.SIGKILL) -> None:
        assert self.nats is not None
        await self._stop_service("nats", self.nats, signum)
        self.nats = None

    async def _start_service(self, name: str, argv: list[str], ready: Callable[[Process], Awaitable[bool]]) -> Process:
        stack = AsyncExitStack()
        process = await stack.enter_async_context(
            start_process(argv, self.env, log_path=self.log_path(name), ready=ready, ready_timeout=30)
        )
        self._service_stacks[name] = stack
        return process

    async def _stop_service(self, name: str, process: Process, signum: int) -> None:
        await stop_process(process, signum=signum, grace=10)
        await self._service_stacks.pop(name).aclose()

    # ------------------------------------------------------------------ frontends and workers

    async def start_frontend(self, name: str, *, port: int | None = None) -> ClusterFrontend:
        host = self.network[name]
        port = port or _port(host, 8000)
        argv = [
            sys.executable,
            "-m",
            "dynamo.frontend",
            "--http-host",
            host.address,
            "--http-port",
            str(port),
            "--discovery-backend",
            "etcd",
            "--request-plane",
            "nats",
            "--event-plane",
            "nats",
            "--migration-limit",
            str(self.migration_limit),
            *self.frontend_args,
        ]
        url = f"http://{host.address}:{port}"

        async def live(_: Process) -> bool:
            return await http_ok(f"{url}/live")

        stack = AsyncExitStack()
        await self.stack.enter_async_context(stack)
        process = await stack.enter_async_context(
            start_process(host.argv(argv), self.host_env(host), log_path=self.log_path(name), ready=live)
        )
        frontend = ClusterFrontend(name, host, port, process, stack)
        self.frontends[name] = frontend
        return frontend

    async def stop_frontend(self, name: str, signum: int = signal.SIGKILL) -> None:
        frontend = self.frontends.pop(name)
        await stop_process(frontend.process, signum=signum)
        await frontend.stack.aclose()

    async def start_worker(self, name: str, *, ready_timeout: float = 90.0) -> ClusterWorker:
        """The mock engine on the worker host's address, then ``python -m sidecar`` against it (etcd + NATS)."""
        host = self.network[name]
        stack = AsyncExitStack()
        await self.stack.enter_async_context(stack)
        try:
            return await self._start_worker(name, host, stack, ready_timeout)
        except BaseException:
            await stack.aclose()
            raise

    async def _start_worker(self, name: str, host: Host, stack: AsyncExitStack, ready_timeout: float) -> ClusterWorker:
        port_file = self.root / f"{name}-engine.port"
        engine_argv = [
            sys.executable,
            "-m",
            "sidecar.testing.mock",
            "--host",
            host.address,
            "--port",
            str(_port(host, 50051)),
            "--port-file",
            str(port_file),
            "--served-model-name",
            MODEL,
            # KV-aware routing needs KV events and KV usage in GetLoad: the full engine.
            "--profile",
            "full",
            *self.engine_args,
        ]
        engine_stack = AsyncExitStack()
        await stack.enter_async_context(engine_stack)
        engine = await self._start_engine(name, host, engine_argv, engine_stack)
        engine_address = port_file.read_text().strip()
        system_port = _low_port(host, 8081)
        sidecar_stack = AsyncExitStack()
        await stack.enter_async_context(sidecar_stack)
        sidecar = await self._start_sidecar(name, host, engine_address, system_port, sidecar_stack, ready_timeout)
        worker = ClusterWorker(name, host, engine, engine_address, sidecar, system_port, stack, sidecar_stack)
        worker.engine_argv, worker.engine_stack = engine_argv, engine_stack
        self.workers[name] = worker
        return worker

    async def _start_engine(self, name: str, host: Host, argv: list[str], stack: AsyncExitStack) -> Process:
        port_file = self.root / f"{name}-engine.port"
        port_file.unlink(missing_ok=True)

        async def engine_listening(_: Process) -> bool:
            return port_file.exists() and bool(port_file.read_text().strip())

        return await stack.enter_async_context(
            start_process(
                host.argv(argv),
                self.host_env(host),
                log_path=self.log_path(f"{name}-engine"),
                ready=engine_listening,
            )
        )

    async def stop_engine(self, name: str, signum: int = signal.SIGTERM) -> int:
        """Stop the worker's engine (SIGTERM: its graceful stop, a GOAWAY first); its exit status."""
        worker = self.workers[name]
        assert worker.engine_stack is not None
        worker.engine.signal(signum)
        status = await worker.engine.wait(30)
        await worker.engine_stack.aclose()
        return status

    async def start_engine(self, name: str) -> Process:
        """Start the worker's engine again, on the same address, after :meth:`stop_engine`."""
        worker = self.workers[name]
        worker.engine_stack = AsyncExitStack()
        await worker.stack.enter_async_context(worker.engine_stack)
        worker.engine = await self._start_engine(name, worker.host, worker.engine_argv, worker.engine_stack)
        return worker.engine

    async def _start_sidecar(
        self, name: str, host: Host, engine_address: str, system_port: int, stack: AsyncExitStack, ready_timeout: float
    ) -> Process:
        sidecar_argv = [
            sys.executable,
            "-m",
            "sidecar",
            "--grpc-endpoint",
            engine_address,
            "--model-path",
            str(MODEL_DIR),
            "--served-model-name",
            MODEL,
            "--discovery-backend",
            "etcd",
            "--request-plane",
            "nats",
            "--event-plane",
            "nats",
            "--dynamo-system-port",  # below 32768, as every server in tests (by default the OS picks it)
            str(free_low_port()),
            *self.sidecar_args,
        ]
        return await stack.enter_async_context(
            start_process(
                host.argv(sidecar_argv),
                self.host_env(host, DYN_SYSTEM_PORT=str(system_port)),
                log_path=self.log_path(name),
                ready="worker registering -> serving",
                ready_timeout=ready_timeout,
                stop_grace=15,
            )
        )

    async def restart_sidecar(self, name: str, *, ready_timeout: float = 90.0) -> Process:
        """A supervisor's job: start the worker's sidecar again (same engine, same ports) after it exited."""
        worker = self.workers[name]
        await worker.sidecar_stack.aclose()
        worker.sidecar_stack = AsyncExitStack()
        await worker.stack.enter_async_context(worker.sidecar_stack)
        worker.sidecar = await self._start_sidecar(
            name, worker.host, worker.engine_address, worker.system_port, worker.sidecar_stack, ready_timeout
        )
        worker.restarts += 1
        return worker.sidecar

    async def restart_frontend(self, name: str) -> ClusterFrontend:
        """Start a frontend again on the same host and port after it exited (or was killed)."""
        old = self.frontends.pop(name, None)
        if old is not None:
            await old.stack.aclose()
        self.frontend_restarts[name] = self.frontend_restarts.get(name, 0) + 1
        return await self.start_frontend(name, port=old.port if old else None)

    async def supervise(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Restart every sidecar and frontend that exits, like systemd/Kubernetes would (until cancelled)."""
        task_status.started()
        while True:
            for name, worker in list(self.workers.items()):
                if worker.sidecar.returncode is not None:
                    await self.restart_sidecar(name)
            for name, frontend in list(self.frontends.items()):
                if frontend.process.returncode is not None:
                    await self.restart_frontend(name)
            await trio.sleep(0.2)  # the supervisor's period, like systemd's restart check

    async def stop_worker(self, name: str) -> None:
        worker = self.workers.pop(name)
        await worker.stack.aclose()


@asynccontextmanager
async def open_cluster(
    network: Network,
    root: Path,
    *,
    frontends: Sequence[str] = FRONTENDS,
    workers: Sequence[str] = WORKERS,
    sidecar_args: Sequence[str] = (),
    engine_args: Sequence[str] = (),
    frontend_args: Sequence[str] = (),
    migration_limit: int = 3,
) -> AsyncIterator[Cluster]:
    """etcd + NATS, then the frontends and the workers (in parallel); everything stopped on exit, workers first."""
    env = base_env(root)
    env.update({"DYN_DISCOVERY_BACKEND": "etcd", "DYN_REQUEST_PLANE": "nats", "DYN_EVENT_PLANE": "nats"})
    for key in ("DYN_FILE_KV",):
        env.pop(key, None)
    async with AsyncExitStack() as stack:
        cp = network["cp"]
        cluster = Cluster(
            network,
            root,
            env,
            etcd_port=_port(cp, 2379),
            nats_port=_port(cp, 4222),
            stack=stack,
            sidecar_args=tuple(sidecar_args),
            engine_args=tuple(engine_args),
            frontend_args=tuple(frontend_args),
            migration_limit=migration_limit,
        )

        async def stop_control_plane() -> None:
            if cluster.etcd is not None:
                await cluster.stop_etcd(signal.SIGTERM)
            if cluster.nats is not None:
                await cluster.stop_nats(signal.SIGTERM)

        stack.push_async_callback(stop_control_plane)
        await cluster.start_etcd()
        await cluster.start_nats()
        async with trio.open_nursery() as nursery:
            for name in frontends:
                nursery.start_soon(cluster.start_frontend, name)
        # Workers one after another: three concurrent sidecar start-ups on two cores take longer than in turn.
        for name in workers:
            await cluster.start_worker(name)
        yield cluster


# ---------------------------------------------------------------------- the client side


async def frontend_instances(url: str) -> set[int]:
    """Instance ids the frontend's ``/health`` lists for the generate endpoint (empty when it cannot tell)."""
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            health = (await http.get(f"{url}/health")).json()
    except (httpx.HTTPError, ValueError):
        return set()
    return {int(i["instance_id"]) for i in health.get("instances", []) if i.get("endpoint") == "generate"}


async def wait_instances(frontends: Sequence[ClusterFrontend], expected: set[int], timeout: float) -> float:
    """Wait until every frontend lists exactly ``expected``; returns the seconds waited."""
    start = time.monotonic()
    with trio.fail_after(timeout):
        for frontend in frontends:
            await wait_until(lambda: _lists(frontend.url, expected), timeout=timeout, interval=0.05)  # noqa: B023
    return time.monotonic() - start


async def complete(url: str, prompt: str = "Hello", *, max_tokens: int = 4, timeout: float = 30.0) -> httpx.Response:
    """A non-streaming ``/v1/completions`` with ``ignore_eos`` (exactly ``max_tokens`` tokens on success)."""
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=timeout) as http:
        return await http.post(f"{url}/v1/completions", json=body)


async def status_of(url: str, **kwargs: Any) -> int:
    """The HTTP status of one small completion; 0 when the connection fails."""
    try:
        response = await complete(url, **kwargs)
    except httpx.HTTPError:
        return 0
    if response.status_code == 200:
        usage = response.json().get("usage", {})
        assert usage.get("completion_tokens") == kwargs.get("max_tokens", 4), response.text
    return response.status_code


async def wait_serving(frontends: Sequence[ClusterFrontend], timeout: float) -> float:
    """Wait until a request through every frontend succeeds; returns the seconds waited."""
    start = time.monotonic()
    with trio.fail_after(timeout):
        for frontend in frontends:
            await wait_until(lambda: _serves(frontend.url), timeout=timeout, interval=0.05)  # noqa: B023
    return time.monotonic() - start


async def routed_to(frontend: ClusterFrontend, worker: ClusterWorker, timeout: float) -> float:
    """Send small requests through ``frontend`` until one lands on ``worker``; returns the seconds it took."""
    start = time.monotonic()
    before = worker.received()
    with trio.fail_after(timeout):
        for attempt in itertools.count():
            # Short, distinct prompts: no cached prefix pulls them to one worker when the model is KV-routed.
            await status_of(frontend.url, prompt=f"to {worker.name} {attempt}")
            if worker.received() > before:
                return time.monotonic() - start
            await trio.sleep(0.02)  # the poll interval (a request is the probe; each try is counted)
    raise AssertionError("unreachable")


async def _lists(url: str, expected: set[int]) -> bool:
    return await frontend_instances(url) == expected


async def _serves(url: str) -> bool:
    return await status_of(url, timeout=10) == 200
