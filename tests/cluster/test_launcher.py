"""``launch/cluster.sh --demo --once``: the people's way to the same topology answers through every frontend, on
ports the caller picks (so it runs next to other clusters and tests), keeps its logs and stops cleanly."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

import pytest

from tests.deploy.sessions import run_launcher

from .network import netns_unavailable
from .topology import missing_binaries

# pytest.mark.timeout: the cluster (hosts, etcd, NATS, two frontends, three workers) starts inside each test's bound
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "cluster.sh"


def free_run(count: int, high: int = 32767) -> int:
    """The first of ``count`` consecutive loopback ports that were all free a moment ago."""
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(20000, high - count)
        sockets = []
        try:
            for port in range(first, first + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports")


@pytest.mark.parametrize("mode", ["netns", "loopback"])
def test_cluster_sh_demo_answers_through_both_frontends(mode: str, tmp_path: Path) -> None:
    if missing_binaries():
        pytest.skip("etcd-server and nats-server are not installed")
    reason = netns_unavailable()
    if mode == "netns" and reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    logs = tmp_path / "logs"
    argv = ["bash", str(SCRIPT), "--demo", "--once", "--workers", "2", "--log-dir", str(logs)]
    argv += ["--etcd-port", str(free_run(2)), "--nats-port", str(free_run(1)), "--http-port", str(free_run(2))]
    argv += ["--system-port", str(free_run(2)), "--engine-port", str(free_run(2))]
    if mode == "loopback":
        argv.append("--loopback")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    status, output, left = run_launcher(argv, 300, env)
    assert status == 0, output[-4000:]
    assert not left, f"cluster.sh left processes behind: {left}"
    assert ("hosts: network namespaces" if mode == "netns" else "hosts: all on loopback") in output
    assert output.count('"choices"') == 2, output[-4000:]
    assert f"logs kept in {logs}/" in output
    stopped = next(line for line in output.splitlines() if line.startswith("stopped (exit status): "))
    for name in ("sidecar-w1", "sidecar-w2", "engine-w1", "engine-w2", "fe1", "fe2", "nats"):
        assert f"{name} 0" in stopped, stopped
    # etcd stops by re-raising the SIGTERM it got (143): its clean stop, and the summary says so (it used to print a
    # bare "nats 1, etcd 143" and exit 0; NATS is now stopped with SIGINT, its clean stop).
    assert "etcd 143 (ended by the SIGTERM that stopped it, as etcd does)" in stopped, stopped
    assert "not a clean stop" not in output
    assert {p.name for p in logs.glob("*.log")} >= {"etcd.log", "nats.log", "fe1.log", "sidecar-w1.log"}
