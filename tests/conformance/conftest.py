"""Fixtures for the conformance kit: ``openengine-mock`` processes (always stopped) and one in-process kit runner."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sidecar.conformance import main
from tests.mock.conftest import MockProcess

#: Every kit run's RPC deadline and settle bound: generous for a loaded 2-core box, far inside the test timeouts.
KIT_BOUNDS = ("--rpc-timeout", "20", "--settle-secs", "15")
#: A realistic-but-fast model speed: a long request lasts a few seconds (holds stay open), short ones milliseconds.
MOCK_SPEED = ("--decode-ms-per-token", "1")


def start_mock(directory: Path, *args: str, name: str = "mock") -> MockProcess:
    """Start ``openengine-mock`` on an OS-picked loopback port and wait until it listens (30 s bound)."""
    return MockProcess.spawn(directory / f"{name}.port", directory / f"{name}.log", ("--host", "127.0.0.1", *args))


@pytest.fixture
def mocks(tmp_path: Path) -> Iterator[list[MockProcess]]:
    """A list the test appends its mocks to (via :func:`start_mock`); every one is killed afterwards."""
    started: list[MockProcess] = []
    yield started
    for mock in started:
        mock.kill()


@pytest.fixture
def mock_factory(tmp_path: Path, mocks: list[MockProcess]) -> MockFactory:
    return MockFactory(tmp_path, mocks)


@dataclass
class MockFactory:
    directory: Path
    started: list[MockProcess]

    def __call__(self, *args: str, name: str = "mock") -> MockProcess:
        mock = start_mock(self.directory, *args, name=f"{name}-{len(self.started)}")
        self.started.append(mock)
        return mock


@pytest.fixture(scope="session")
def default_mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockProcess]:
    """One mock in its default configuration, shared by the tests that only read from it (no fault flags)."""
    mock = start_mock(tmp_path_factory.mktemp("conformance"), *MOCK_SPEED)
    yield mock
    mock.kill()


@dataclass(frozen=True)
class KitRun:
    """One in-process run of ``openengine-conformance``: exit code, stdout, stderr."""

    code: int
    out: str
    err: str

    @property
    def report(self) -> dict[str, object]:
        data = json.loads(self.out)
        assert isinstance(data, dict)
        return data

    def verdicts(self) -> dict[str, str]:
        checks = self.report["checks"]
        assert isinstance(checks, list)
        return {c["id"]: c["verdict"] for c in checks}

    def evidence(self, check_id: str) -> str:
        checks = self.report["checks"]
        assert isinstance(checks, list)
        return str(next(c["evidence"] for c in checks if c["id"] == check_id))


def run_kit(capsys: pytest.CaptureFixture[str], *argv: str) -> KitRun:
    """``openengine-conformance ARGV`` in this process (its own asyncio loop), with the tests' bounds."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main([*KIT_BOUNDS, *argv])
    captured = capsys.readouterr()
    code = exited.value.code
    assert isinstance(code, int)
    return KitRun(code, captured.out, captured.err)


def failed(run: KitRun) -> dict[str, str]:
    """The failed checks and their evidence."""
    checks = run.report["checks"]
    assert isinstance(checks, list)
    return {c["id"]: c["evidence"] for c in checks if c["verdict"] == "fail"}
