"""Fixtures for the engine client: a real ``openengine-mock`` subprocess, an edge, a connected client.

Rules (see ``tests/conftest.py``): the mock binds loopback on a port the OS picks and reports it through
``--port-file``; waiting for it is bounded; the process (its whole session) is killed on exit, even when the test fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from sidecar.edge import Edge, open_edge
from sidecar.engine import Endpoint, EngineClient, EngineClientConfig, open_engine_client, parse_endpoint
from tests.helpers.waits import wait_until

#: Bound on the mock writing its port file (interpreter start + tokenizer load on a loaded 2-core CI box).
MOCK_START_TIMEOUT = 30.0
#: Bound on the mock exiting after SIGTERM before it is killed.
MOCK_STOP_TIMEOUT = 5.0


def _mock_argv(port: int, port_file: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sidecar.testing.mock",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--port-file",
        str(port_file),
    ]


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the OS picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class MockEngine:
    """A running ``openengine-mock``."""

    endpoint: Endpoint
    process: trio.Process
    log_path: Path

    def log_text(self) -> str:
        """Everything the mock printed so far."""
        return self.log_path.read_text(errors="replace")


@asynccontextmanager
async def start_mock(*flags: str, port: int = 0, wait: bool = True) -> AsyncIterator[MockEngine]:
    """Start ``python -m sidecar.testing.mock --speedup 0`` with ``flags``; kill it on exit.

    ``port`` = 0 lets the OS pick; ``wait=False`` yields before the mock listens (for late-start tests).
    """
    with tempfile.TemporaryDirectory(prefix="engine-mock-") as tmp:
        port_file = Path(tmp) / "port"
        log_path = Path(tmp) / "mock.log"
        argv = [*_mock_argv(port, port_file), "--speedup", "0", *flags]
        with log_path.open("wb") as log:
            process = await trio.lowlevel.open_process(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            endpoint = Endpoint("127.0.0.1", port)
            if wait:

                def listening() -> bool:
                    if process.returncode is not None:
                        raise RuntimeError(f"openengine-mock exited early:\n{log_path.read_text()[-4000:]}")
                    return port_file.exists()

                await wait_until(listening, timeout=MOCK_START_TIMEOUT, interval=0.02, what="openengine-mock listening")
                endpoint = parse_endpoint(port_file.read_text().strip())
            yield MockEngine(endpoint, process, log_path)
        finally:
            with trio.CancelScope(shield=True):
                await _stop(process)


async def _stop(process: trio.Process) -> None:
    if process.returncode is None:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with trio.move_on_after(MOCK_STOP_TIMEOUT):
            await process.wait()
    if process.returncode is None:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


@dataclass
class SharedMock:
    """A default mock shared by the tests of one module (it is stateless between requests)."""

    endpoint: Endpoint
    process: subprocess.Popen[bytes]
    log_path: Path


@pytest.fixture(scope="module")
def shared_mock() -> Iterator[SharedMock]:
    """One default mock per test module: starting an interpreter per test would cost ~0.7 s each.

    A plain (not trio) fixture, since it must outlive each test's trio run; the process is killed on teardown.
    """
    with tempfile.TemporaryDirectory(prefix="engine-mock-") as tmp:
        port_file = Path(tmp) / "port"
        log_path = Path(tmp) / "mock.log"
        argv = [*_mock_argv(0, port_file), "--speedup", "0"]
        with log_path.open("wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + MOCK_START_TIMEOUT
            while not port_file.exists():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"openengine-mock did not start:\n{log_path.read_text()[-4000:]}")
                time.sleep(0.02)  # the poll interval of a synchronous fixture (wait_until is async)
            yield SharedMock(parse_endpoint(port_file.read_text().strip()), process, log_path)
        finally:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(MOCK_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.fixture
def mock_engine(shared_mock: SharedMock) -> SharedMock:
    """The module's default mock (aggregated, TensorRT-LLM capabilities, no delays)."""
    if shared_mock.process.poll() is not None:
        pytest.fail(f"the shared openengine-mock died:\n{shared_mock.log_path.read_text()[-4000:]}")
    return shared_mock


@pytest.fixture
async def edge() -> AsyncIterator[Edge]:
    """A running edge thread."""
    async with open_edge() as running:
        yield running


@asynccontextmanager
async def connected_client(edge: Edge, endpoint: Endpoint, **config: object) -> AsyncIterator[EngineClient]:
    """A client on ``edge`` that has seen the engine answer on every pooled connection."""
    settings: dict[str, object] = {"connections": 2, "retry_interval_s": 0.1, "rpc_timeout_s": 10.0}
    settings.update(config)
    async with open_engine_client(edge, EngineClientConfig(endpoint, **settings)) as client:  # type: ignore[arg-type]
        await client.wait_connected(trio.current_time() + 15)
        yield client


@pytest.fixture
async def client(edge: Edge, mock_engine: SharedMock) -> AsyncIterator[EngineClient]:
    """A client connected to the default mock."""
    async with connected_client(edge, mock_engine.endpoint) as connected:
        yield connected
