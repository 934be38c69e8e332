"""The processes of ``bench.chaos``: 2 frontends × 3 aggregated workers (each its own ``openengine-mock``), a 1P1D
pair, a fault-free reference stack, and for ``--control-plane etcd`` etcd + NATS; every one restartable on its own.

Builds on :mod:`tests.helpers.processes` (each process in a process group of its own, bounded waits, always
killed) and, for etcd + NATS and network namespaces, on :mod:`tests.cluster`. Nothing listens beyond loopback or
the project's own namespaces; every fixed port is below 32768 (Dynamo reads ``DYN_SYSTEM_PORT`` as an i16).

Layout::

    fe1, fe2        python -m dynamo.frontend --router-mode kv --migration-limit 3
    w1, w2, w3      openengine-sidecar → link (proxy or netem) → openengine-mock --profile full (KV events, LoRA)
    pd-prefill      openengine-sidecar (namespace pd) → openengine-mock --profile full --role prefill
    pd-decode       openengine-sidecar (namespace pd) → openengine-mock --profile full --role decode
    ref             a frontend, a sidecar and a mock of their own (file discovery, nothing shared, no faults):
                    the references, then stopped

Every process life is kept (:class:`Life`): its log, when it started and ended and how, so that the checker can
reconcile each sidecar run's counters with what the clients saw.

The ``common`` topology (``--topology common``) is what both sidecars serve, so that Dynamo's own TensorRT-LLM
sidecar (``--sidecar dynamo``: ``python -m dynamo.trtllm.sidecar``) runs the same soak as ours: every engine is
``openengine-mock --profile trtllm`` (TensorRT-LLM's server: no KV events, no LoRA), the pair's sidecars are told
their phase (``--disaggregation-mode``), and the frontends route round-robin (Dynamo's TensorRT-LLM sidecar
documentation says not to use the KV router with it). No LoRA adapter, no KV event faults.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import httpx
import trio

from bench._chaos_net import Link, NetemLink, ProxyLink
from tests.cluster.network import Host, Network
from tests.cluster.topology import Cluster
from tests.helpers.processes import (
    Process,
    base_env,
    free_low_port,
    fresh_log_path,
    http_ok,
    start_process,
    stop_process,
)
from tests.helpers.stack import MODEL, MODEL_DIR

ControlPlane = Literal["file", "etcd"]
NetworkMode = Literal["proxy", "netem"]
#: Which sidecar the workers run: ours (``python -m sidecar``) or Dynamo's (``python -m dynamo.trtllm.sidecar``).
SidecarKind = Literal["ours", "dynamo"]
#: ``full``: the soak's own topology (ours only); ``common``: what both sidecars serve (see the module docstring).
TopologyKind = Literal["full", "common"]

#: The base model, its LoRA adapter and the disaggregated pair's model (its own namespace: its decode worker must not
#: share an endpoint with the aggregated workers).
LORA: Final = "chaos-lora"
PD_MODEL: Final = "tiny-pd"
PD_NAMESPACE: Final = "pd"
AGG_WORKERS: Final = ("w1", "w2", "w3")
PD_WORKERS: Final = ("pd-prefill", "pd-decode")
FRONTENDS: Final = ("fe1", "fe2")

#: Mock flags shared by every engine: the full engine (KV events over gRPC for KV-aware routing, a detailed
#: GetLoad), prompt directives for the error faults, model time slow enough that faults land mid-stream.
ENGINE_FLAGS: Final = (
    "--profile", "full", "--kv-events", "grpc", "--decode-ms-per-token", "12", "--stop-grace-secs", "2",
)  # fmt: skip
AGG_ENGINE_FLAGS: Final = ("--capability", "lora=true", "--faults-from-prompt")
#: A handoff whose decode leg never comes (the client left between the legs) is held this long by the prefill mock.
PD_SESSION_TIMEOUT_S: Final = 8
#: Sidecar flags: short inactivity and drain bounds and a capped reconnect backoff, so that a run of minutes sees
#: many recoveries; the registration watchdog every 2 s.
SIDECAR_FLAGS: Final = (
    "--request-inactivity-timeout-secs", "5", "--drain-timeout-secs", "5", "--abort-timeout-secs", "1",
    "--registration-check-interval-secs", "2", "--reconnect-backoff-max-secs", "2",
)  # fmt: skip
FRONTEND_FLAGS: Final = ("--router-mode", "kv")
MIGRATION_LIMIT: Final = 3
#: The common topology's engines: TensorRT-LLM's server as the mock plays it, the same model time and grace.
COMMON_ENGINE_FLAGS: Final = ("--profile", "trtllm", "--decode-ms-per-token", "12", "--stop-grace-secs", "2")
COMMON_AGG_ENGINE_FLAGS: Final = ("--faults-from-prompt",)

_SERVING: Final = re.compile(r"worker \w+ -> serving")
_WORKER_ID: Final = re.compile(r'worker_id="([0-9a-f]+)"')


def now() -> float:
    return time.monotonic()


@dataclass
class Life:
    """One run of one process."""

    number: int
    process: Process
    started: float
    ended: float | None = None
    #: How it ended: "running", "sigterm", "sigkill", "exit N" (an exit nobody asked for), "stopped" (run end).
    end: str = "running"
    #: When it ended, as a Unix time (to compare with its log's timestamps).
    ended_unix: float | None = None


@dataclass
class Managed:
    """A process that can be stopped, killed, paused and started again; each start is a new :class:`Life`."""

    name: str
    root: Path
    argv: Callable[[int], list[str]]
    env: dict[str, str]
    ready: Callable[[Process], Awaitable[bool]] | str | None = None
    ready_timeout: float = 90.0
    stop_grace: float = 10.0
    #: The working directory (Dynamo's sidecar names its model after a relative ``--model-path``).
    cwd: Path | None = None
    lives: list[Life] = field(default_factory=list)
    paused: bool = False
    _stack: AsyncExitStack | None = None

    @property
    def life(self) -> Life | None:
        return self.lives[-1] if self.lives else None

    @property
    def process(self) -> Process | None:
        life = self.life
        return life.process if life is not None and life.end == "running" else None

    async def start(self, *, wait_ready: bool = True) -> Process:
        """Start a new life (the previous one must have ended)."""
        assert self._stack is None, f"{self.name} is already running"
        stack = AsyncExitStack()
        number = len(self.lives) + 1
        try:
            process = await stack.enter_async_context(
                start_process(
                    self.argv(number),
                    self.env,
                    log_path=fresh_log_path(self.root, self.name),
                    ready=self.ready if wait_ready else None,
                    ready_timeout=self.ready_timeout,
                    stop_grace=self.stop_grace,
                    cwd=self.cwd,
                )
            )
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        self.paused = False
        self.lives.append(Life(number, process, now()))
        return process

    def send_signal(self, signum: int) -> None:
        """``signum`` to the whole process group (a paused process's children pause too)."""
        process = self.process
        if process is not None and process.returncode is None:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signum)
        if signum == signal.SIGSTOP:
            self.paused = True
        elif signum == signal.SIGCONT:
            self.paused = False

    async def stop(self, signum: int = signal.SIGTERM, *, grace: float | None = None, end: str | None = None) -> None:
        """Signal the life's group, wait ``grace`` (its own stop grace by default), then SIGKILL; the life ends."""
        life, stack = self.life, self._stack
        if life is None or stack is None:
            return
        if self.paused:
            self.send_signal(signal.SIGCONT)
        await stop_process(life.process, grace=self.stop_grace if grace is None else grace, signum=signum)
        self._stack = None
        await stack.aclose()
        if life.end == "running":
            names: dict[int, str] = {signal.SIGKILL: "sigkill", signal.SIGTERM: "sigterm"}
            life.end = end or names.get(signum, "stopped")
        life.ended = life.ended or now()
        life.ended_unix = life.ended_unix or time.time()

    async def reap(self) -> int | None:
        """When the current life's process has exited by itself: end the life (``exit N``) and return N."""
        life = self.life
        if life is None or self._stack is None or life.process.returncode is None:
            return None
        code = life.process.returncode
        stack, self._stack = self._stack, None
        await stack.aclose()
        if life.end == "running":
            life.end = f"exit {code}"
        life.ended = life.ended or now()
        life.ended_unix = life.ended_unix or time.time()
        return code


@dataclass
class Engine:
    managed: Managed
    host: Host
    port: int
    #: KV-event faults armed for each life: life number → ``--kv-fault`` values.
    kv_faults: dict[int, list[str]] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{self.host.address}:{self.port}"


@dataclass
class Worker:
    """A sidecar and the engine it drives; ``endpoint`` is what the sidecar dials (a proxy, or the engine)."""

    name: str
    sidecar: Managed
    engine: Engine
    host: Host
    system_port: int
    endpoint: str
    model: str
    link: Link | None = None

    @property
    def system_url(self) -> str:
        return f"http://{self.host.address}:{self.system_port}"


@dataclass
class Frontend:
    managed: Managed
    host: Host
    port: int

    @property
    def name(self) -> str:
        return self.managed.name

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{self.port}"


@dataclass
class Topology:
    """The running processes of one chaos run (see the module docstring)."""

    root: Path
    control_plane: ControlPlane
    network: Network
    network_mode: Literal["proxy", "netem"]
    env: dict[str, str]
    frontends: dict[str, Frontend] = field(default_factory=dict)
    workers: dict[str, Worker] = field(default_factory=dict)
    proxies: list[ProxyLink] = field(default_factory=list)
    cluster: Cluster | None = None  # etcd + NATS (``--control-plane etcd``)
    lora_root: Path | None = None
    #: Times the operator (this program) loaded the LoRA adapter again on a worker that came back without it.
    lora_reloads: int = 0
    #: etcd's warm-up before the load (``fill_raft_log``): entries written, seconds taken.
    etcd_warm_up: tuple[int, float] | None = None
    sidecar_kind: SidecarKind = "ours"
    kind: TopologyKind = "full"

    @property
    def models(self) -> frozenset[str]:
        """What every frontend must list for the topology to be whole."""
        return frozenset({MODEL, PD_MODEL, *((LORA,) if self.kind == "full" else ())})

    @property
    def engine_flags(self) -> tuple[str, ...]:
        return ENGINE_FLAGS if self.kind == "full" else COMMON_ENGINE_FLAGS

    @property
    def frontend_flags(self) -> tuple[str, ...]:
        return FRONTEND_FLAGS if self.kind == "full" else ()

    # -- hosts and environment ----------------------------------------------------------------------------------

    def host(self, name: str) -> Host:
        return self.network.hosts.get(name) or Host(name, "127.0.0.1")

    @property
    def client_host(self) -> str:
        """The address the chaos process itself listens on (proxies) and is reached at from every host."""
        return self.network.client_address if self.network.isolated else "127.0.0.1"

    def host_env(self, host: Host, **extra: str) -> dict[str, str]:
        env = dict(self.env)
        for key in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST"):
            env[key] = host.address
        env.update({"DYN_SYSTEM_HOST": host.address, "DYN_HTTP_HOST": host.address})
        if self.cluster is not None:
            env.update({"ETCD_ENDPOINTS": self.cluster.etcd_url, "NATS_SERVER": self.cluster.nats_url})
        env.update(extra)
        return env

    def plane_flags(self) -> list[str]:
        if self.control_plane == "etcd":
            return ["--discovery-backend", "etcd", "--request-plane", "nats", "--event-plane", "nats"]
        return ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]

    @property
    def file_kv(self) -> Path | None:
        return Path(self.env["DYN_FILE_KV"]) if "DYN_FILE_KV" in self.env else None

    # -- building -----------------------------------------------------------------------------------------------

    def add_frontend(self, name: str) -> Frontend:
        host = self.host(name)
        port = free_low_port()
        url = f"http://{host.address}:{port}"

        def argv(_: int) -> list[str]:
            return host.argv(
                [
                    sys.executable, "-m", "dynamo.frontend", "--http-host", host.address, "--http-port", str(port),
                    *self.plane_flags(), "--migration-limit", str(MIGRATION_LIMIT), *self.frontend_flags,
                ]
            )  # fmt: skip

        async def live(_: Process) -> bool:
            return await http_ok(f"{url}/live")

        managed = Managed(name, self.root, argv, self.host_env(host), ready=live, stop_grace=10)
        frontend = Frontend(managed, host, port)
        self.frontends[name] = frontend
        return frontend

    def add_worker(self, name: str, engine_host: Host, *, engine_args: Sequence[str], sidecar_args: Sequence[str],
                   model: str, link: Literal["proxy", "netem", "direct"]) -> Worker:  # fmt: skip
        engine_port = free_low_port()
        port_file = self.root / f"{name}-engine.port"
        engine_holder: list[Engine] = []

        def engine_argv(life: int) -> list[str]:
            port_file.unlink(missing_ok=True)
            faults = [arg for f in engine_holder[0].kv_faults.get(life, []) for arg in ("--kv-fault", f)]
            return engine_host.argv(
                [
                    sys.executable, "-m", "sidecar.testing.mock", "--host", engine_host.address,
                    "--port", str(engine_port), "--port-file", str(port_file), "--served-model-name", model,
                    *self.engine_flags, *engine_args, *faults,
                ]
            )  # fmt: skip

        async def listening(_: Process) -> bool:
            return port_file.exists() and bool(port_file.read_text().strip())

        engine = Engine(
            Managed(
                f"{name}-engine", self.root, engine_argv, self.host_env(engine_host), ready=listening, stop_grace=5
            ),
            engine_host,
            engine_port,
        )
        engine_holder.append(engine)
        # A direct link (the pair) puts the sidecar on its engine's host; the others have a host of their own.
        host = engine_host if link == "direct" else self.host(name)
        system_port = free_low_port()
        worker_link: Link | None = None
        endpoint = engine.address
        if link == "proxy":
            proxy = ProxyLink(self.client_host, free_low_port(), lambda: (engine.host.address, engine.port))
            self.proxies.append(proxy)
            worker_link, endpoint = proxy, f"{self.client_host}:{proxy.port}"
        elif link == "netem":
            assert engine_host.netns is not None
            tag = engine_host.netns.rsplit("-", 1)[0]
            index = list(self.network.hosts).index(engine_host.name)
            worker_link = NetemLink(engine_host.netns, f"{tag}-sw", f"p{index}")

        def sidecar_argv(_: int) -> list[str]:
            if self.sidecar_kind == "dynamo":
                # Named after --model-path as given: a relative path, a symlink in its working directory.
                return host.argv(
                    [
                        sys.executable, "-m", "dynamo.trtllm.sidecar", "--grpc-endpoint", endpoint,
                        "--model-path", model, *self.plane_flags(), *sidecar_args,
                    ]
                )  # fmt: skip
            return host.argv(
                [
                    sys.executable, "-m", "sidecar", "--grpc-endpoint", endpoint, "--model-path", str(MODEL_DIR),
                    "--served-model-name", model, *self.plane_flags(), *SIDECAR_FLAGS, *sidecar_args,
                    "--dynamo-system-port", str(free_low_port()),  # below 32768, as every server of the run
                ]
            )  # fmt: skip

        dynamo = self.sidecar_kind == "dynamo"
        sidecar = Managed(
            name,
            self.root,
            sidecar_argv,
            self.host_env(host, DYN_SYSTEM_PORT=str(system_port)),
            ready=f"Serving {re.escape(model)} on " if dynamo else "worker registering -> serving",
            stop_grace=15,
            cwd=_model_links(self.root, model) if dynamo else None,
        )
        worker = Worker(name, sidecar, engine, host, system_port, endpoint, model, worker_link)
        self.workers[name] = worker
        return worker

    # -- running ------------------------------------------------------------------------------------------------

    async def start_all(self) -> None:
        """Frontends and engines at once, then the sidecars (two at a time: start-ups on two cores are slow)."""
        async with trio.open_nursery() as nursery:
            for frontend in self.frontends.values():
                nursery.start_soon(_start, frontend.managed)
            for worker in self.workers.values():
                nursery.start_soon(_start, worker.engine.managed)
        limiter = trio.CapacityLimiter(2)

        async def sidecar(worker: Worker) -> None:
            async with limiter:
                await worker.sidecar.start()

        async with trio.open_nursery() as nursery:
            for worker in self.workers.values():
                nursery.start_soon(sidecar, worker)

    async def stop_all(self) -> None:
        """Sidecars first (they drain), then the engines, the frontends and the control plane; shielded."""
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for worker in self.workers.values():
                    nursery.start_soon(_stop, worker.sidecar)
            async with trio.open_nursery() as nursery:
                for worker in self.workers.values():
                    nursery.start_soon(_stop, worker.engine.managed)
                for frontend in self.frontends.values():
                    nursery.start_soon(_stop, frontend.managed)
            for link in (w.link for w in self.workers.values()):
                if link is not None:
                    with suppress(Exception):
                        link.clear()

    async def load_lora(self, worker: Worker) -> dict[str, Any]:
        assert self.lora_root is not None
        body = {"lora_name": LORA, "source_path": str(self.lora_root / LORA)}
        async with httpx.AsyncClient(timeout=30) as http:
            answer = (await http.post(f"{worker.system_url}/engine/load_lora", json=body)).json()
        assert isinstance(answer, dict)
        return answer

    async def list_loras(self, worker: Worker) -> list[str] | None:
        """The adapters the worker serves; None when it cannot be asked (not up)."""
        try:
            async with httpx.AsyncClient(timeout=5) as http:
                answer = (await http.post(f"{worker.system_url}/engine/list_loras", json={})).json()
        except (httpx.HTTPError, ValueError):
            return None
        if not isinstance(answer, dict) or answer.get("status") != "ok":
            return None
        return [str(a.get("lora_name")) for a in answer.get("loras", [])]


async def _start(managed: Managed) -> None:
    await managed.start()


async def _stop(managed: Managed) -> None:
    await managed.stop(end="stopped")


# ---------------------------------------------------------------------------------------------------------- probes


async def worker_state(http: httpx.AsyncClient, worker: Worker) -> str:
    """The sidecar's state from ``/health`` ("serving" only while it answers 200), or "down"."""
    try:
        response = await http.get(f"{worker.system_url}/health", timeout=2)
        body = response.json()
    except (httpx.HTTPError, ValueError):
        return "down"
    if response.status_code == 200:
        return "serving"
    return str(body.get("state") or "notready") if isinstance(body, dict) else "notready"


async def worker_instance(http: httpx.AsyncClient, worker: Worker) -> int | None:
    """The sidecar's Dynamo instance id (every ``dynamo_component_*`` series on its system port names it)."""
    try:
        text = (await http.get(f"{worker.system_url}/metrics", timeout=2)).text
    except httpx.HTTPError:
        return None
    match = _WORKER_ID.search(text)
    return int(match.group(1), 16) if match else None


async def frontend_instances(http: httpx.AsyncClient, frontend: Frontend) -> set[int] | None:
    """Instance ids of ``generate`` endpoints the frontend's ``/health`` lists; None when it does not answer."""
    try:
        health = (await http.get(f"{frontend.url}/health", timeout=2)).json()
    except (httpx.HTTPError, ValueError):
        return None
    return {int(i["instance_id"]) for i in health.get("instances", []) if i.get("endpoint") == "generate"}


async def frontend_models(http: httpx.AsyncClient, frontend: Frontend) -> set[str]:
    """The model ids the frontend's ``/v1/models`` lists (empty when it does not answer)."""
    try:
        models = (await http.get(f"{frontend.url}/v1/models", timeout=2)).json()
    except (httpx.HTTPError, ValueError):
        return set()
    return {str(m.get("id")) for m in models.get("data", []) if isinstance(m, dict)}


def _model_links(root: Path, model: str) -> Path:
    """A directory holding ``model`` → the test model (Dynamo's sidecar runs there with ``--model-path model``)."""
    links = root / "models"
    links.mkdir(exist_ok=True)
    link = links / model
    if not link.is_symlink():
        link.symlink_to(MODEL_DIR)
    return links


def make_adapter(root: Path) -> Path:
    adapter = root / LORA
    adapter.mkdir(parents=True, exist_ok=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA"}))
    return root


def build(
    root: Path,
    control_plane: ControlPlane,
    network: Network,
    network_mode: Literal["proxy", "netem"],
    *,
    sidecar: SidecarKind = "ours",
    kind: TopologyKind = "full",
) -> Topology:
    """The topology's processes, not started (``start_all``); the control plane is started by the caller."""
    env = base_env(root)
    if control_plane == "etcd":
        env.update({"DYN_DISCOVERY_BACKEND": "etcd", "DYN_REQUEST_PLANE": "nats", "DYN_EVENT_PLANE": "nats"})
        env.pop("DYN_FILE_KV", None)
    topo = Topology(root, control_plane, network, network_mode, env, sidecar_kind=sidecar, kind=kind)
    full = kind == "full"
    if full:
        topo.lora_root = make_adapter(root / "loras")
    for name in FRONTENDS:
        topo.add_frontend(name)
    for index, name in enumerate(AGG_WORKERS, start=1):
        engine_host = topo.host(f"e{index}")
        topo.add_worker(
            name,
            engine_host,
            engine_args=AGG_ENGINE_FLAGS if full else COMMON_AGG_ENGINE_FLAGS,
            sidecar_args=("--lora-root", str(topo.lora_root)) if full else (),
            model=MODEL,
            link=network_mode,
        )
    pd_host = topo.host("pd")
    for name, role in zip(PD_WORKERS, ("prefill", "decode"), strict=True):
        extra = ("--kv-session-timeout", str(PD_SESSION_TIMEOUT_S)) if role == "prefill" else ()
        # The full engine is given its role; TensorRT-LLM's reports none and its worker is told its phase.
        engine_role = ("--role", role) if full else ()
        phase = () if full else ("--disaggregation-mode", role)
        topo.add_worker(
            name,
            pd_host,
            engine_args=(*engine_role, *extra),
            sidecar_args=("--namespace", PD_NAMESPACE, *phase),
            model=PD_MODEL,
            link="direct",
        )
    return topo
