"""``launch/cluster.sh --demo --once``: the people's way to the same topology answers through every frontend."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .network import netns_unavailable
from .topology import missing_binaries

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "cluster.sh"


def test_cluster_sh_demo_answers_through_both_frontends() -> None:
    if missing_binaries():
        pytest.skip("etcd-server and nats-server are not installed")
    reason = netns_unavailable()
    if reason is not None:
        # On shared loopback the script uses fixed ports (8000, 2379, 4222, …) that other processes may hold.
        pytest.skip(f"launch/cluster.sh on loopback is not run by the tests: {reason}")
    done = subprocess.run(
        ["bash", str(SCRIPT), "--demo", "--once"], capture_output=True, text=True, timeout=240, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "hosts: network namespaces" in output
    assert output.count('"choices"') == 2, output[-4000:]
