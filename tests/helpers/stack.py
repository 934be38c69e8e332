"""The serving stack as processes: ``openengine-mock`` engines and ``openengine-sidecar`` workers.

Builds on :mod:`tests.helpers.processes` (same rules: loopback, bounded waits, process groups always killed).
The engine's own view (GetLoad) is read with the project's OpenEngine client, as an operator's probe would.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from openengine_bp.openengine.v1 import LoadInfo
from sidecar.convert.structjson import bp_struct_to_json
from sidecar.edge import open_edge
from sidecar.engine import EngineClientConfig, open_engine_client, parse_endpoint

from .processes import DynamoEnv, Frontend, Process, dump_log_tails, free_low_port, start_process
from .waits import wait_until

MODEL = "tiny-oe"
MODEL_DIR = Path(__file__).resolve().parents[2] / "sidecar" / "testing" / "mock" / "model"


@dataclass
class Engine:
    """A running ``openengine-mock``."""

    process: Process
    address: str

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


@dataclass
class Worker:
    """A running ``openengine-sidecar``."""

    process: Process
    system_port: int

    @property
    def system_url(self) -> str:
        return f"http://127.0.0.1:{self.system_port}"


async def engine_load(address: str) -> LoadInfo:
    """``Control.GetLoad`` of the engine at ``address``."""
    async with (
        open_edge() as edge,
        open_engine_client(edge, EngineClientConfig(endpoint=parse_endpoint(address), connections=1)) as client,
    ):
        return await client.get_load()


async def running_requests(address: str) -> int:
    load = await engine_load(address)
    assert load.running_requests is not None
    return load.running_requests


async def wait_engine_idle(address: str, timeout: float) -> float:
    """Poll GetLoad until nothing runs or queues; returns the seconds waited (fails after ``timeout``)."""
    start = trio.current_time()

    async def idle() -> bool:
        load = await engine_load(address)
        return load.running_requests == 0 and not load.queued_requests

    await wait_until(idle, timeout=timeout, what=f"engine {address} idle")
    return trio.current_time() - start


@asynccontextmanager
async def start_engine(
    denv: DynamoEnv, *args: str, name: str = "engine", port: int = 0, model: str = MODEL
) -> AsyncIterator[Engine]:
    """Start ``openengine-mock`` (``port`` 0 = OS-picked); yields once its port file exists."""
    port_file = denv.root / f"{name}.port"
    port_file.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "sidecar.testing.mock", "--port", str(port), "--port-file", str(port_file)]

    async def listening(_: Process) -> bool:
        return port_file.exists() and bool(port_file.read_text().strip())

    async with start_process(
        [*argv, "--served-model-name", model, *args], denv.env, log_path=denv.log_path(name), ready=listening
    ) as process:
        yield Engine(process, port_file.read_text().strip())


@asynccontextmanager
async def start_sidecar(
    denv: DynamoEnv,
    engine_address: str,
    *args: str,
    name: str = "sidecar",
    model: str = MODEL,
    ready: str | None = "worker registering -> serving",
    ready_timeout: float = 60.0,
    stop_grace: float = 10.0,
) -> AsyncIterator[Worker]:
    """Start ``python -m sidecar`` against ``engine_address``; yields once its log says it serves (``ready``)."""
    system_port = free_low_port()  # Dynamo parses DYN_SYSTEM_PORT as an i16
    argv = [sys.executable, "-m", "sidecar", "--grpc-endpoint", engine_address, "--model-path", str(MODEL_DIR)]
    if "--dynamo-system-port" not in args:
        # Dynamo's own system server behind the system port: by default the OS picks its port (32768 and up); servers
        # in tests keep below 32768, so the tests pin it (one test asks for the default with 0).
        argv += ["--dynamo-system-port", str(free_low_port())]
    async with start_process(
        [*argv, "--served-model-name", model, *args],
        denv.worker_env(DYN_SYSTEM_PORT=str(system_port)),
        log_path=denv.log_path(name),
        ready=ready,
        ready_timeout=ready_timeout,
        stop_grace=stop_grace,
    ) as process:
        yield Worker(process, system_port)


def dynamo_sidecar_missing() -> str | None:
    """Why Dynamo's own TensorRT-LLM sidecar cannot run here (one line), or ``None`` when it can."""
    if importlib.util.find_spec("dynamo.trtllm") is None:
        return "Dynamo's TensorRT-LLM sidecar (python -m dynamo.trtllm.sidecar) is not installed"
    return None


@asynccontextmanager
async def start_dynamo_sidecar(
    denv: DynamoEnv,
    engine_address: str,
    *args: str,
    name: str = "dynamo-sidecar",
    model: str = MODEL,
    model_dir: Path = MODEL_DIR,
    ready_timeout: float = 60.0,
    stop_grace: float = 10.0,
    system_port: int | None = None,
    env: dict[str, str] | None = None,
) -> AsyncIterator[Worker]:
    """Start Dynamo's own sidecar (``python -m dynamo.trtllm.sidecar``, in the ai-dynamo 1.6.1 wheel) against
    ``engine_address``; yields once its log says it serves.

    It has no ``--served-model-name``: it names the model after ``--model-path`` as given, so it runs from a
    directory holding a symlink named ``model`` to ``model_dir`` and is given that relative path (the engine must
    serve the same name: ``GenerateRequest.model`` is that path too).
    """
    missing = dynamo_sidecar_missing()
    if missing is not None:
        raise RuntimeError(missing)
    cwd = denv.root / f"{name}-models"
    link = cwd / model
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(model_dir)
    port = system_port if system_port is not None else free_low_port()
    argv = [sys.executable, "-m", "dynamo.trtllm.sidecar", "--grpc-endpoint", engine_address, "--model-path", model]
    async with start_process(
        [*argv, *args],
        env if env is not None else denv.worker_env(DYN_SYSTEM_PORT=str(port)),
        log_path=denv.log_path(name),
        ready=f"Serving {model} on ",
        ready_timeout=ready_timeout,
        stop_grace=stop_grace,
        cwd=cwd,
    ) as process:
        yield Worker(process, port)


def dump_logs(denv: DynamoEnv, lines: int = 40) -> None:
    """Print every process log's tail (the scratch directory goes away with the test)."""
    dump_log_tails(denv.root, lines)


async def wait_routable(url: str, workers: int, timeout: float = 30.0) -> None:
    """Wait until the frontend lists the model and ``workers`` instances, and a tiny request succeeds.

    A worker's own "serving" log line comes before the frontend has seen its instance; requests sent in between
    never reach it (they fail at the frontend), which would make a fault test pass for the wrong reason.
    """
    body = {"model": MODEL, "prompt": "warm up", "max_tokens": 1}
    async with httpx.AsyncClient(timeout=10) as http:

        async def routable() -> bool:
            health = (await http.get(f"{url}/health")).json()
            models = [m["id"] for m in (await http.get(f"{url}/v1/models")).json().get("data", [])]
            listed = len(health.get("instances", [])) >= workers and MODEL in models
            return listed and (await http.post(f"{url}/v1/completions", json=body)).status_code == 200

        what = f"{MODEL} routable to {workers} workers at {url}"
        await wait_until(routable, timeout=timeout, interval=0.05, what=what, retry_on=(httpx.HTTPError, ValueError))


async def mock_stats(address: str) -> dict[str, Any]:
    """The engine's cumulative ``ServerInfo.extra.mock_stats`` (what ``openengine-mock`` received)."""
    async with (
        open_edge() as edge,
        open_engine_client(edge, EngineClientConfig(endpoint=parse_endpoint(address), connections=1)) as client,
    ):
        info = await client.get_server_info()
    assert info.extra is not None
    stats = bp_struct_to_json(info.extra).get("mock_stats") or {}
    assert isinstance(stats, dict)
    return stats


@asynccontextmanager
async def engine_and_worker(denv: DynamoEnv, frontend: Frontend, *mock_args: str) -> AsyncIterator[str]:
    """A zero-delay ``openengine-mock`` started with ``mock_args`` and one worker, routable through ``frontend``;
    yields the engine's address. Logs are dumped when the body fails."""
    async with (
        start_engine(denv, "--speedup", "0", *mock_args) as engine,
        start_sidecar(denv, engine.address),
    ):
        await wait_routable(frontend.url, workers=1)
        try:
            yield engine.address
        except BaseException:
            dump_logs(denv)
            raise


#: A prompt of many KV blocks: its repeats hit the prefix cache of the worker that served it first.
LONG_PROMPT = " ".join(f"Stanza {i}: the river bends past the mill, the bridge and the quiet town." for i in range(24))


async def cached_completion(http: httpx.AsyncClient, url: str, prompt: str = LONG_PROMPT) -> int:
    """One short greedy completion of ``prompt``; returns how many prompt tokens the engine found cached."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = await http.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of every sample of the Prometheus metric ``name`` in ``text`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
