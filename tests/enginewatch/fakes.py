"""An in-memory engine and worker for the engine watch's tests, in trio's virtual time.

:class:`FakeEngine` is what the watch sees of an engine through its client: Control RPCs, ``Generate`` streams (played
into the real request path by :class:`~tests.helpers.scripted_engine.LoopSideGenerate`), and its port (:class:`Port`,
the way back's connect probe). It can be killed (the port refuses, RPCs fail UNAVAILABLE, open streams break), come
back (as a new instance, or one whose gRPC service does not answer yet), and be *stopped* as SIGSTOP stops a process:
its connections stay open, nothing answers (an RPC gets DEADLINE_EXCEEDED at its deadline, a stream is silent) until
it is resumed, when everything held carries on.

:class:`Host` is the worker around the watch (``WatchHost``): it records what was withdrawn, registered and restored.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from openengine.v1 import generation_pb2 as pb
from openengine_bp.openengine.v1 import (
    AbortResponse,
    AbortStatus,
    DeploymentCapacity,
    HealthResponse,
    HealthState,
    LoadInfo,
    ModelInfo,
    ServerInfo,
)
from sidecar.cli import parse_config
from sidecar.config import SidecarConfig
from sidecar.dynamo import Registration
from sidecar.engine import PINNED_SCHEMA_RELEASE
from sidecar.enginewatch import EngineWatch
from sidecar.errors import EngineRpcError, GrpcCode
from sidecar.requests import RequestServer, ServingContext
from sidecar.startup import Discovery
from statemachines import WorkerLifecycle
from tests.helpers.scripted_engine import LoopSideGenerate

MODEL_DIR = Path(__file__).resolve().parents[2] / "sidecar" / "testing" / "mock" / "model"


class FakeEngine(LoopSideGenerate):
    """One engine behind the watch's client (see the module docstring). ``tokens`` a stream yields, one every
    ``token_s``; the counters say what the engine was asked."""

    def __init__(self, *, tokens: int = 10, token_s: float = 0.1) -> None:
        self.instance = "engine-1"
        self.context = 256
        self.tokens = tokens
        self.token_s = token_s
        #: The process is up and its port accepts connections.
        self.up = True
        #: Its gRPC service answers (False: the port accepts, calls fail UNAVAILABLE -- a server still starting).
        self.answering = True
        self.ready = True
        self.calls: dict[str, int] = {}
        self.call_times: dict[str, list[float]] = {}
        self.generates: list[str] = []
        self.aborts: list[str] = []
        self.open_streams = 0
        self._resumed = trio.Event()
        self._resumed.set()
        # Bumped by kill(): a stream of an earlier life breaks (its connection is gone).
        self._life = 0
        self._life_changed = trio.Event()
        self.going_away_listeners: list[Callable[[str], None]] = []

    # -- what a test does to it ------------------------------------------------------------------------------------

    def kill(self) -> None:
        self.up = False
        self._life += 1
        self._life_changed.set()
        self._life_changed = trio.Event()
        self.resume()

    def start(self, *, instance: str | None = None, answering: bool = True) -> None:
        """The process is back: its port accepts; it answers at once unless ``answering`` is False."""
        if instance is not None:
            self.instance = instance
        self.up = True
        self.answering = answering

    def stop(self) -> None:
        """SIGSTOP: nothing answers until :meth:`resume` (connections stay open)."""
        self._resumed = trio.Event()

    def resume(self) -> None:
        self._resumed.set()

    @property
    def stopped(self) -> bool:
        return not self._resumed.is_set()

    # -- the client's going-away API (this engine never sends GOAWAY) ----------------------------------------------

    @property
    def going_away(self) -> str | None:
        return None

    @property
    def draining_connections(self) -> int:
        return 0

    def on_going_away(self, listener: Callable[[str], None]) -> None:
        self.going_away_listeners.append(listener)

    async def wait_drained(self, timeout_s: float = math.inf) -> None:
        await trio.lowlevel.checkpoint()

    # -- Control RPCs ----------------------------------------------------------------------------------------------

    async def _rpc(self, name: str, timeout_s: float | None) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.call_times.setdefault(name, []).append(trio.current_time())
        await trio.lowlevel.checkpoint()
        if not self.up:
            raise EngineRpcError(name, GrpcCode.UNAVAILABLE, "connection refused")
        if not self._resumed.is_set():
            with trio.move_on_after(timeout_s if timeout_s is not None else 30.0):
                await self._resumed.wait()
            if not self._resumed.is_set():
                raise EngineRpcError(name, GrpcCode.DEADLINE_EXCEEDED, "no answer within the deadline")
            if not self.up:
                raise EngineRpcError(name, GrpcCode.UNAVAILABLE, "stream terminated: connection lost")
        if not self.answering:
            raise EngineRpcError(name, GrpcCode.UNAVAILABLE, "the engine closed the connection before HTTP/2 began")

    async def get_server_info(self, *, trace: Any = None, timeout_s: float | None = None) -> ServerInfo:
        await self._rpc("GetServerInfo", timeout_s)
        return ServerInfo(
            engine_name="fake",
            engine_version="1",
            instance_id=self.instance,
            schema_revision=1,
            minimum_client_revision=1,
            schema_release=PINNED_SCHEMA_RELEASE,
            supported_models=["tiny"],
            capacity=DeploymentCapacity(kv_block_size=16, total_kv_blocks=100, max_running_requests=8),
        )

    async def get_model_info(self, model: str, *, trace: Any = None, timeout_s: float | None = None) -> ModelInfo:
        await self._rpc("GetModelInfo", timeout_s)
        return ModelInfo(
            model_id="tiny", served_model_name="tiny", max_context_length=self.context, supports_token_ids_input=True
        )

    async def health(self, *args: Any, timeout_s: float | None = None, **kw: Any) -> HealthResponse:
        await self._rpc("Health", timeout_s)
        return HealthResponse(state=HealthState.READY if self.ready else HealthState.NOT_READY)

    async def get_load(self, include_per_rank: bool = False, *, timeout_s: float | None = None) -> LoadInfo:
        await self._rpc("GetLoad", timeout_s)
        return LoadInfo(instance_id=self.instance, running_requests=self.open_streams)

    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> AbortResponse:
        await self._rpc("Abort", timeout_s)
        self.aborts.append(request_id)
        return AbortResponse(status=AbortStatus.ABORTED)

    # -- Generate --------------------------------------------------------------------------------------------------

    @asynccontextmanager
    async def generate(
        self, request: pb.GenerateRequest, *, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncIterator[AsyncIterator[list[pb.GenerateResponse]]]:
        self.calls["Generate"] = self.calls.get("Generate", 0) + 1
        await trio.lowlevel.checkpoint()
        if not self.up:
            raise EngineRpcError("Generate", GrpcCode.UNAVAILABLE, "connection refused")
        self.generates.append(request.request_id)
        life = self._life
        self.open_streams += 1
        try:
            yield self._stream(request, life)
        finally:
            self.open_streams -= 1

    async def _stream(self, request: pb.GenerateRequest, life: int) -> AsyncIterator[list[pb.GenerateResponse]]:
        count = min(self.tokens, request.stopping.max_tokens or self.tokens)
        for index in range(count):
            await self._step(life)
            response = pb.GenerateResponse(request_id=request.request_id)
            response.token.output_index = 0
            response.token.tokens.add(token_id=7 + index % 5)
            yield [response]
        await self._step(life)
        done = pb.GenerateResponse(request_id=request.request_id)
        done.finished.output_index = 0
        done.finished.reason = pb.FINISH_REASON_LENGTH
        done.usage.prompt_tokens = len(request.token_ids.ids)
        done.usage.completion_tokens = count
        yield [done]

    async def _step(self, life: int) -> None:
        """One decode step: ``token_s`` of work, which a stopped engine does not do (it resumes where it was)."""
        async with trio.open_nursery() as nursery:

            async def work() -> None:
                await trio.sleep(self.token_s)
                await self._resumed.wait()
                nursery.cancel_scope.cancel()

            async def killed() -> None:
                while self._life == life:
                    await self._life_changed.wait()
                raise EngineRpcError("Generate", GrpcCode.UNAVAILABLE, "stream terminated: connection lost")

            nursery.start_soon(work)
            nursery.start_soon(killed)


class Port:
    """The fake engine's port, as the connect probe sees it: accepting while the process is up, also when stopped
    (its kernel accepts connections for a stopped process)."""

    endpoint = "the fake engine's port"

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.probes = 0

    async def accepts(self, timeout_s: float) -> bool | None:
        self.probes += 1
        await trio.lowlevel.checkpoint()
        return self.engine.up


class Host:
    """The worker around the watch: records ``(time, what, detail)`` for every withdrawal, card and restore."""

    def __init__(self, config: SidecarConfig, engine: FakeEngine) -> None:
        self.config = config
        self.engine = engine
        self.calls: list[tuple[float, str, Any]] = []
        self.routable = True
        self.registration_held = False
        self.restarts = 0

    def serving_context(self, discovery: Discovery) -> ServingContext:
        return ServingContext(
            client=self.engine,  # type: ignore[arg-type]
            caps=discovery.caps,
            model=discovery.model,
            context_length=discovery.context_length,
            abort_timeout_s=self.config.abort_timeout_s,
            inactivity_timeout_s=self.config.request_inactivity_timeout_s,
            role=discovery.role,
        )

    def card(self, discovery: Discovery) -> Registration:
        return Registration(
            model_path=str(MODEL_DIR), served_model_name="tiny", context_length=discovery.context_length
        )

    async def withdraw(self) -> None:
        await trio.lowlevel.checkpoint()
        self.routable = False
        self.calls.append((trio.current_time(), "withdraw", None))

    async def into_routing(self, card: Registration | None) -> str | None:
        await trio.lowlevel.checkpoint()
        if card is not None:
            self.calls.append((trio.current_time(), "register", card))
        self.routable = True
        self.calls.append((trio.current_time(), "restore", None))
        return None

    async def engine_restarted(self) -> None:
        await trio.lowlevel.checkpoint()
        self.restarts += 1

    def names(self) -> list[str]:
        return [name for _, name, _ in self.calls]


def config(*args: str) -> SidecarConfig:
    return parse_config(["--grpc-endpoint", "127.0.0.1:1", "--model-path", str(MODEL_DIR), *args])


async def serving_watch(engine: FakeEngine, *args: str) -> tuple[EngineWatch, Host, Port]:
    """A watch as the worker leaves it once registered: discovered, serving, requests attached."""
    cfg = config(*args)
    life = WorkerLifecycle()
    requests = RequestServer()
    host = Host(cfg, engine)
    port = Port(engine)
    watch = EngineWatch(cfg, life, requests, engine, host, trio.Event(), probe=port)  # type: ignore[arg-type]
    life.fire("connect")
    life.fire("connected")
    watch.adopt(await watch.discover_until_ready(trio.current_time() + 30))
    assert watch.discovery is not None
    requests.attach(host.serving_context(watch.discovery))
    life.fire("registered")
    return watch, host, port
