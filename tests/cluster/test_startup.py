"""Start-up against an unreachable control plane: refused after the deadline, in one line, exit status 1.

Needs neither etcd nor nats-server: the worker is pointed at a loopback port nobody listens on.
"""

from __future__ import annotations

import re
import time

import pytest
import trio

from tests.helpers.processes import dynamo_env, free_port
from tests.helpers.stack import start_engine, start_sidecar

# pytest.mark.timeout: the cluster (hosts, etcd, NATS, two frontends, three workers) starts inside each test's bound
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(600)]

DEADLINE = 2.0


@pytest.mark.parametrize(
    ("plane", "args", "variable", "url"),
    [
        ("etcd", ("--discovery-backend", "etcd"), "ETCD_ENDPOINTS", "http://127.0.0.1:{port}"),
        ("NATS", ("--request-plane", "nats"), "NATS_SERVER", "nats://127.0.0.1:{port}"),
    ],
)
async def test_an_unreachable_control_plane_is_refused_after_the_deadline_in_one_line(
    plane: str, args: tuple[str, ...], variable: str, url: str
) -> None:
    with dynamo_env() as denv, trio.fail_after(90):
        denv.env[variable] = url.format(port=free_port())
        async with (
            start_engine(denv) as engine,
            start_sidecar(
                denv, engine.address, *args, "--control-plane-deadline-secs", str(DEADLINE), ready="-> registering"
            ) as worker,
        ):
            registering = time.monotonic()
            assert await worker.process.wait(timeout=DEADLINE + 30) == 1
            waited = time.monotonic() - registering
        log = worker.process.log()
        refusals = re.findall(r"refusing to start: control plane unreachable \(([^)]*)\): (.*)", log)
        assert len(refusals) == 1, log[-3000:]
        assert refusals[0][0].startswith(f"{plane} at {denv.env[variable]}")
        assert "Traceback" not in log
        assert DEADLINE - 0.5 <= waited < DEADLINE + 10, waited
