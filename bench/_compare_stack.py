"""The stacks of ``bench.compare``: one fresh loopback deployment per scenario and sidecar -- the real Dynamo frontend,
``openengine-mock --profile trtllm`` engines and either sidecar -- built from :mod:`tests.helpers` (same rules:
loopback, ports below 32768 where Dynamo needs them, bounded waits, every process group killed on exit).

Both sidecars run with their defaults: the comparison is what an operator gets by swapping the command. Ours is
``python -m sidecar`` (:func:`tests.helpers.stack.start_sidecar`), Dynamo's is ``python -m dynamo.trtllm.sidecar``
(:func:`tests.helpers.stack.start_dynamo_sidecar`, named after a symlinked relative ``--model-path``).
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

import httpx
import trio

from tests.helpers.processes import DynamoEnv, Frontend, dynamo_env, start_frontend
from tests.helpers.stack import (
    Engine,
    Worker,
    engine_load,
    mock_stats,
    start_dynamo_sidecar,
    start_engine,
    start_sidecar,
    wait_routable,
)

Side = Literal["ours", "dynamo"]
SIDES: Final[tuple[Side, ...]] = ("ours", "dynamo")
LABELS: Final[dict[Side, str]] = {"ours": "ours", "dynamo": "Dynamo's"}
#: Every engine of the comparison is TensorRT-LLM's merged server as the mock plays it.
ENGINE_PROFILE: Final = ("--profile", "trtllm")
#: Bound on a sidecar's exit after the SIGTERM that ends a scenario (Dynamo's waits a 5 s grace even when idle).
STOP_BOUND_S: Final = 20.0


@dataclass
class Env:
    """One scenario's deployment for one sidecar: the frontend, and the engines and workers started so far."""

    side: Side
    scenario: str
    denv: DynamoEnv
    frontend: Frontend
    http: httpx.AsyncClient
    engines: list[Engine] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    #: Workers the scenario itself stopped (their pids): their exit is a figure, not a death.
    stopped: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.frontend.url

    async def routable(self, workers: int = 1, bound_s: float = 60.0) -> None:
        await wait_routable(self.url, workers=workers, timeout=bound_s)


@asynccontextmanager
async def open_env(
    side: Side, scenario: str, *, migration_limit: int = 0, log_dir: Path | None = None
) -> AsyncIterator[Env]:
    """A fresh scratch directory and frontend; the scenario starts engines and workers inside. The logs are copied
    to ``log_dir/<scenario>/<side>`` when asked for."""
    with dynamo_env() as denv:
        try:
            async with (
                start_frontend(denv, migration_limit=migration_limit, ready_timeout=60) as frontend,
                httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as http,
            ):
                yield Env(side, scenario, denv, frontend, http)
        finally:
            if log_dir is not None and (denv.root / "logs").is_dir():
                shutil.copytree(denv.root / "logs", log_dir / scenario / side, dirs_exist_ok=True)


@asynccontextmanager
async def engine(env: Env, *args: str, name: str = "engine", port: int = 0) -> AsyncIterator[Engine]:
    """``openengine-mock --profile trtllm`` with ``args``; tracked for the end-of-scenario idle check."""
    async with start_engine(env.denv, *ENGINE_PROFILE, *args, name=name, port=port) as started:
        env.engines.append(started)
        try:
            yield started
        finally:
            env.engines.remove(started)


@asynccontextmanager
async def worker(env: Env, address: str, *, name: str = "sidecar") -> AsyncIterator[Worker]:
    """The scenario's sidecar (ours or Dynamo's, with its defaults) against ``address``; yields once it says it
    serves. Tracked for the end-of-scenario stop."""
    if env.side == "ours":
        context = start_sidecar(env.denv, address, name=name, stop_grace=STOP_BOUND_S)
    else:
        context = start_dynamo_sidecar(env.denv, address, name=name, stop_grace=STOP_BOUND_S)
    async with context as started:
        env.workers.append(started)
        try:
            yield started
        finally:
            env.workers.remove(started)


async def listened(env: Env, name: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> float:
    """When the engine called ``name`` (a name not used before in this scenario) wrote its port file, i.e. listens:
    polled every 2 ms, returns the ``time.monotonic()`` it was first seen."""
    port_file = env.denv.root / f"{name}.port"
    task_status.started()
    while not (port_file.exists() and port_file.read_text().strip()):  # noqa: ASYNC110 (another process's file)
        await trio.sleep(0.002)
    return time.monotonic()


async def engine_running(address: str) -> int:
    """Requests the engine runs or queues (0 when it cannot be asked)."""
    try:
        load = await engine_load(address)
    except Exception:
        return 0
    return (load.running_requests or 0) + (load.queued_requests or 0)


async def engine_idle_after(address: str, bound_s: float, *, since: float | None = None) -> float | None:
    """Seconds from ``since`` (default: now) until the engine holds no request and no live stream (polled every
    2 ms), or None within ``bound_s``."""
    start = time.monotonic() if since is None else since
    while time.monotonic() - start < bound_s:
        if not await engine_running(address):
            try:
                stats = await mock_stats(address)
            except Exception:
                stats = {}
            if not stats.get("live_requests") and not stats.get("active_kv_sessions"):
                return time.monotonic() - start
        await trio.sleep(0.002)
    return None


async def end_of_scenario(env: Env) -> dict[str, object]:
    """What the scenario left: whether every live engine is idle (bounded), then each worker's exit status after a
    SIGTERM (or the status it exited with by itself)."""
    leaks: list[str] = []
    for live in list(env.engines):
        if live.process.returncode is not None:
            continue
        if await engine_idle_after(live.address, 5.0) is None:  # 5 s: an abort in flight lands well within
            leaks.append(f"{await engine_running(live.address)} request(s) held")
    exits: list[str] = []
    alive = True
    for started in list(env.workers):
        code = started.process.returncode
        if code is not None and started.process.pid in env.stopped:
            exits.append(f"exit {code} (the scenario's SIGTERM)")
            continue
        if code is not None:
            exits.append(f"died: exit {code}")
            alive = False
            continue
        started.process.signal(signal.SIGTERM)
        try:
            code = await started.process.wait(STOP_BOUND_S)
        except trio.TooSlowError:
            exits.append(f"no exit {STOP_BOUND_S:g} s after SIGTERM")
            continue
        exits.append(f"exit {code}")
    return {
        "exit": ", ".join(exits) or "—",
        "engine": "; ".join(leaks) or "idle",
        "alive": alive,
        "leak": bool(leaks),
    }


__all__ = [
    "ENGINE_PROFILE",
    "LABELS",
    "SIDES",
    "Env",
    "Side",
    "end_of_scenario",
    "engine",
    "engine_idle_after",
    "engine_running",
    "listened",
    "open_env",
    "worker",
]
