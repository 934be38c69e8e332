"""Fixtures that start ``openengine-mock`` as a real subprocess and always stop it."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

START_TIMEOUT_S = 30.0
_counter = itertools.count()


class MockProcess:
    """A running ``openengine-mock`` subprocess."""

    def __init__(self, proc: subprocess.Popen[bytes], port_file: Path, log_path: Path) -> None:
        self.proc = proc
        self.port_file = port_file
        self.log_path = log_path
        self.address = ""

    @classmethod
    def spawn(cls, port_file: Path, log_path: Path, args: Sequence[str], *, wait: bool = True) -> MockProcess:
        """``openengine-mock --port 0 --port-file PORT_FILE ARGS``, its output in ``log_path``; with ``wait``, once it
        listens (killed if it never does)."""
        cmd = [sys.executable, "-m", "sidecar.testing.mock", "--port", "0", "--port-file", str(port_file), *args]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        mock = cls(proc, port_file, log_path)
        if wait:
            try:
                mock.wait_listening()
            except BaseException:
                mock.kill()
                raise
        return mock

    def wait_listening(self, timeout: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.port_file.exists():
                self.address = self.port_file.read_text().strip()
                if self.address:
                    return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(f"openengine-mock exited early ({self.proc.returncode}):\n{self.log()}")
            # The poll interval of a synchronous fixture (wait_until is async).
            time.sleep(0.02)
        raise TimeoutError(f"openengine-mock did not listen within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Send ``sig`` and wait for the exit code (kills after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)


def _start(directory: Path, args: tuple[str, ...], *, wait: bool = True) -> MockProcess:
    k = next(_counter)
    port_file = directory / f"mock-{os.getpid()}-{k}.port"
    log_path = directory / f"mock-{os.getpid()}-{k}.log"
    return MockProcess.spawn(port_file, log_path, ("--speedup", "0", *args), wait=wait)


StartMock = Callable[..., MockProcess]


@pytest.fixture
def start_mock(tmp_path: Path) -> Iterator[StartMock]:
    """``start_mock(*flags, wait=True)`` → a :class:`MockProcess`; every one is killed after the test."""
    started: list[MockProcess] = []

    def start(*args: str, wait: bool = True) -> MockProcess:
        mock = _start(tmp_path, args, wait=wait)
        started.append(mock)
        return mock

    yield start
    for mock in started:
        mock.kill()


@pytest.fixture(scope="session")
def mock_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockProcess]:
    """One ``--profile full`` mock (``--speedup 0``) shared by the tests of the richer engine's behaviour."""
    mock = _start(tmp_path_factory.mktemp("mock"), ("--profile", "full"))
    yield mock
    mock.kill()


@pytest.fixture
def addr(mock_server: MockProcess) -> str:
    """The shared ``full`` mock's address (``host:port``); fails the test if the process died."""
    if mock_server.proc.poll() is not None:
        pytest.fail(f"the shared openengine-mock died:\n{mock_server.log()}")
    return mock_server.address


@pytest.fixture(scope="session")
def trtllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockProcess]:
    """One default mock (``--profile trtllm``, ``--speedup 0``): TensorRT-LLM's merged server."""
    mock = _start(tmp_path_factory.mktemp("mock-trtllm"), ())
    yield mock
    mock.kill()


@pytest.fixture
def trt_addr(trtllm_server: MockProcess) -> str:
    """The shared default (``trtllm``) mock's address; fails the test if the process died."""
    if trtllm_server.proc.poll() is not None:
        pytest.fail(f"the shared openengine-mock died:\n{trtllm_server.log()}")
    return trtllm_server.address
