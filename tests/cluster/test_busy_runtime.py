"""Rules for calling Dynamo while its runtime calls into Python (etcd + NATS, Dynamo 1.6.1).

A serving worker's runtime threads run Python all the time: request handlers, ``/metrics`` callbacks, finished
futures. ``DistributedRuntime.endpoint(path)`` blocks its caller on the runtime with the GIL held, and with etcd and
NATS the build waits for I/O that only those threads drive. A LoRA worker built its three control endpoints that way
after it started serving and, in about 1 of 120 start-ups, hung for good after ``serving ... as instance`` (the
etcd chaos soak, a start-up stress). ``busy_runtime_worker.py`` makes the runtime threads busy on purpose, so both
outcomes show in seconds. The control plane is the cluster fixture's etcd + NATS, without frontends or workers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio

from tests.helpers.processes import free_low_port, start_process

from .network import Host
from .topology import Cluster

# pytest.mark.timeout: the cluster (hosts, etcd, NATS, two frontends, three workers) starts inside each test's bound
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(600)]

WORKER = Path(__file__).with_name("busy_runtime_worker.py")
#: Ample for three endpoints served on two busy cores; the deadlock never ends.
SERVE_BOUND_S = 20.0
CONTROL_PLANE_ONLY = pytest.mark.parametrize("cluster", [{"frontends": (), "workers": ()}], indirect=True)


async def _run_worker(cluster: Cluster, when: str) -> tuple[bool, str]:
    """Whether the worker (in the test's namespace, on loopback) served its controls within the bound, and its log."""
    env = cluster.host_env(Host("busy", "127.0.0.1"), DYN_SYSTEM_PORT=str(free_low_port()))
    argv = [sys.executable, str(WORKER), "--when", when]
    log = cluster.log_path(f"busy-{when}")
    async with start_process(argv, env, log_path=log, ready=r"^BUSY \d+", ready_timeout=60) as worker:
        with trio.move_on_after(SERVE_BOUND_S):
            await worker.wait_for_log(r"^ANSWERED ", SERVE_BOUND_S)
            return True, worker.log()
        return False, worker.log()


@CONTROL_PLANE_ONLY
async def test_control_endpoints_built_with_the_runtime_are_served_while_it_runs_python(cluster: Cluster) -> None:
    """``open_dynamo(controls=...)`` builds the endpoints before any callback exists: serving them later, with
    every runtime thread in a ``/metrics`` callback, finishes and the control answers."""
    with trio.fail_after(120):
        served, log = await _run_worker(cluster, "with-runtime")
    assert served, f"controls not served within {SERVE_BOUND_S} s:\n{log[-3000:]}"
    assert '"status":"ok"' in log.replace(" ", "")


@CONTROL_PLANE_ONLY
async def test_building_an_endpoint_while_the_runtime_runs_python_deadlocks(cluster: Cluster) -> None:
    """The binding fact behind the rule (Dynamo 1.6.1): built once the runtime calls into Python, the first endpoint
    never comes back. If a Dynamo upgrade makes this pass, the rule in ``b.create_runtime`` may go."""
    with trio.fail_after(120):
        served, log = await _run_worker(cluster, "late")
    assert "BUSY" in log
    assert not served, "building an endpoint while the runtime runs Python no longer deadlocks"
    assert "SERVED" not in log
