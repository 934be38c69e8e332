"""Fixtures for the distributed-control-plane tests (``-m cluster``): hosts, etcd + NATS, frontends, workers.

Each test gets a fresh topology (≈10 s to start on two cores) and stops all of it, even when it fails; the logs of
every process are printed when a test fails. Measured recovery times are collected and printed at the end of the run
("cluster recovery times"); ``docs/distributed.md`` quotes them.

etcd and nats-server come from Debian (``apt-get install -y etcd-server nats-server``). Without them the tests are
skipped, except under CI (``CI`` set), where a missing install step must fail loudly.
``OPENENGINE_CLUSTER_LOGS=DIR`` keeps every process log under ``DIR/<test name>/``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from .network import Network, open_network
from .report import RESULTS
from .topology import OCTETS, Cluster, missing_binaries, open_cluster

HOSTS = ("cp", "fe1", "fe2", "w1", "w2", "w3", "w4")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cluster: etcd + NATS control plane, two frontends and three workers on separate test hosts"
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RESULTS:
        return
    terminalreporter.section("cluster recovery times")
    for line in RESULTS:
        terminalreporter.write_line(line)


def _require_binaries() -> None:
    missing = missing_binaries()
    if missing:
        message = f"{' and '.join(missing)} not installed (apt-get install -y etcd-server nats-server)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def cluster_network() -> Iterator[Network]:
    """The test hosts: network namespaces joined through a bridge when possible, else loopback (logged)."""
    _require_binaries()
    with open_network(HOSTS, addresses=OCTETS) as network:
        yield network


@pytest.fixture
def cluster_root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="oe-cluster-") as tmp:
        yield Path(tmp)


@pytest.fixture
async def cluster(
    request: pytest.FixtureRequest, cluster_network: Network, cluster_root: Path
) -> AsyncIterator[Cluster]:
    """etcd + NATS, frontends fe1 and fe2, workers w1–w3 (``@pytest.mark.parametrize("cluster", [{...}],
    indirect=True)`` passes ``open_cluster`` keyword arguments, e.g. ``workers``, ``engine_args``)."""
    kwargs = dict(getattr(request, "param", {}))
    failed = True
    try:
        async with open_cluster(cluster_network, cluster_root, **kwargs) as running:
            yield running
            failed = request.node.rep_call.failed if hasattr(request.node, "rep_call") else False
    finally:
        if failed:
            _dump(cluster_root)
        keep = os.environ.get("OPENENGINE_CLUSTER_LOGS")
        if keep and (cluster_root / "logs").is_dir():
            shutil.copytree(cluster_root / "logs", Path(keep) / request.node.name, dirs_exist_ok=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]


def _dump(root: Path, lines: int = 40) -> None:
    for log in sorted((root / "logs").glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"===== {log.name} (tail)\n" + "\n".join(tail))
