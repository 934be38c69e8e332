"""The sidecar on Dynamo's distributed control plane: etcd discovery, NATS request and event planes, two frontends
and three workers (each with its own mock engine) on separate test hosts, and what each control-plane fault does.

Every test asserts what clients see (complete answers or clean errors, never a truncated success) and records the
time until traffic flows normally again (printed under "cluster recovery times"; quoted in docs/distributed.md).
"""

from __future__ import annotations

import math
import re
import shutil
import signal
import time
from datetime import UTC, datetime

import httpx
import pytest
import trio

from tests.faults._client import Outcome, stream_completion
from tests.helpers.stack import engine_load, wait_engine_idle
from tests.helpers.waits import wait_until

from .report import record
from .topology import (
    Cluster,
    ClusterFrontend,
    ClusterWorker,
    frontend_instances,
    routed_to,
    status_of,
    wait_instances,
    wait_serving,
)

# pytest.mark.timeout: the cluster (hosts, etcd, NATS, two frontends, three workers) starts inside each test's bound
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(600)]

#: Bound on any one test (cluster start-up included): a hang fails, never blocks CI.
TEST_BOUND = 150.0
#: The TTL of the etcd lease every Dynamo process registers under (Dynamo 1.6.1).
LEASE_TTL_S = 30.0


def _ids(cluster: Cluster) -> set[int]:
    ids = {w.instance_id() for w in cluster.workers.values()}
    assert None not in ids
    return {i for i in ids if i is not None}


async def _streams(frontends: list[ClusterFrontend], count: int, max_tokens: int, out: list[Outcome]) -> None:
    """``count`` streaming completions spread over ``frontends``, all at once; outcomes appended to ``out``."""
    async with trio.open_nursery() as nursery:
        for i in range(count):

            async def one(i: int = i) -> None:
                url = frontends[i % len(frontends)].url
                try:
                    out.append(await stream_completion(url, f"Story {i}.", max_tokens=max_tokens, timeout=90))
                except httpx.HTTPError as exc:  # the frontend went away mid-stream
                    out.append(Outcome(status=0, error=repr(exc)))

            nursery.start_soon(one)


async def _victim_and_others(cluster: Cluster) -> tuple[ClusterWorker, list[ClusterWorker]]:
    """Worker w1, the one the test stops, and the others, once every frontend routes to every worker."""
    await wait_instances(list(cluster.frontends.values()), _ids(cluster), timeout=30)
    victim = cluster.workers["w1"]
    return victim, [w for w in cluster.workers.values() if w is not victim]


async def _until_gone(frontends: list[ClusterFrontend], instance_id: int | None, poll: float) -> None:
    """Until no frontend lists ``instance_id`` any more (the caller bounds the wait)."""
    for frontend in frontends:
        await wait_until(lambda: _unlisted(frontend.url, instance_id), timeout=math.inf, interval=poll)  # noqa: B023


def _steady_load(
    nursery: trio.Nursery,
    frontends: list[ClusterFrontend],
    statuses: list[int],
    stop: trio.Event,
    *,
    max_tokens: int,
    per_client: int,
) -> None:
    """Four clients sending small completions one after another through the frontends in turn, each status
    appended to ``statuses``, until ``stop`` (at most ``per_client`` requests each)."""

    async def client(i: int) -> None:
        for n in range(per_client):
            if stop.is_set():
                return
            url = frontends[(i + n) % len(frontends)].url
            statuses.append(await status_of(url, prompt=f"client {i} asks {n}", max_tokens=max_tokens, timeout=60))

    for i in range(4):
        nursery.start_soon(client, i)


async def _running(workers: list[ClusterWorker]) -> int:
    return sum([(await engine_load(w.engine_address)).running_requests or 0 for w in workers])


async def _wait_running(workers: list[ClusterWorker], at_least: int, timeout: float = 30) -> None:
    await wait_until(lambda: _at_least(workers, at_least), timeout=timeout, interval=0.02)


async def test_both_frontends_route_to_every_worker_across_hosts(cluster: Cluster) -> None:
    with trio.fail_after(TEST_BOUND):
        frontends = list(cluster.frontends.values())
        await wait_instances(frontends, _ids(cluster), timeout=30)
        for frontend in frontends:
            for worker in cluster.workers.values():
                await routed_to(frontend, worker, timeout=20)
        if cluster.network.isolated:
            # Each process bound its host's own address: nothing of the topology listens on a shared loopback.
            for worker in cluster.workers.values():
                assert f"listening on {worker.host.address}:" in worker.engine.log()
        mode = cluster.network.mode + (f": {cluster.network.reason}" if cluster.network.reason else "")
        record("test hosts", None, mode)


@pytest.mark.parametrize("cluster", [{"workers": ("w1", "w2")}], indirect=True)
async def test_a_joining_worker_takes_traffic_from_both_frontends(cluster: Cluster) -> None:
    with trio.fail_after(TEST_BOUND):
        frontends = list(cluster.frontends.values())
        await wait_serving(frontends, timeout=30)
        started = time.monotonic()
        joined = await cluster.start_worker("w3")
        serving = time.monotonic() - started
        times = [await routed_to(frontend, joined, timeout=30) for frontend in frontends]
        await wait_instances(frontends, _ids(cluster), timeout=10)
        total = time.monotonic() - started
    record("worker join: start to traffic from both frontends", total, f"sidecar serving after {serving:.2f} s")
    assert total < 60, times


@pytest.mark.parametrize("cluster", [{"engine_args": ("--decode-ms-per-token", "10")}], indirect=True)
async def test_a_drained_worker_leaves_both_frontends_before_it_exits_and_loses_no_request(cluster: Cluster) -> None:
    in_flight: list[Outcome] = []
    during: list[int] = []
    with trio.fail_after(TEST_BOUND):
        frontends = list(cluster.frontends.values())
        victim, others = await _victim_and_others(cluster)
        victim_id = victim.instance_id()
        async with trio.open_nursery() as nursery:
            # 500 tokens at 10 ms: about 5 s of decoding that the drain must wait for.
            nursery.start_soon(_streams, frontends, 12, 500, in_flight)
            await _wait_running([victim], 2, timeout=30)
            sent = time.monotonic()
            victim.sidecar.signal(signal.SIGTERM)
            with trio.fail_after(10):
                await _until_gone(frontends, victim_id, poll=0.01)
            withdrawn = time.monotonic() - sent
            assert victim.sidecar.returncode is None, "the worker exited before both frontends stopped routing to it"
            assert (await engine_load(victim.engine_address)).running_requests, "nothing left to drain: test too slow"
            received = victim.received()

            async def new_request(i: int) -> None:
                during.append(await status_of(frontends[i % 2].url, prompt=f"during drain {i}"))

            # New requests while the worker drains: all go elsewhere and all succeed.
            async with trio.open_nursery() as requests:
                for i in range(12):
                    requests.start_soon(new_request, i)
            assert victim.received() == received, "a frontend routed a new request to the draining worker"
            with trio.fail_after(60):
                assert await victim.sidecar.proc.wait() == 0
            exited = time.monotonic() - sent
        assert during == [200] * 12
        assert len(in_flight) == 12
        assert all(o.succeeded and o.completion_tokens == 500 for o in in_flight), [
            o for o in in_flight if not o.succeeded
        ][:3]
        log = victim.sidecar.log()
        assert "serving -> draining" in log
        assert "draining -> stopped" in log
        await wait_engine_idle(victim.engine_address, timeout=5)
        for worker in others:
            assert worker.sidecar.returncode is None
    record("drain: SIGTERM to gone from both frontends", withdrawn, f"worker exited 0 after {exited:.2f} s")
    record("drain: interruption seen by clients", 0.0, "12/12 in-flight complete, 12/12 new requests served")


@pytest.mark.parametrize("cluster", [{"engine_args": ("--decode-ms-per-token", "10")}], indirect=True)
async def test_a_killed_worker_costs_no_request_while_its_lease_runs_out(cluster: Cluster) -> None:
    """SIGKILL: no drain, no deregistration. The dead worker stays in both frontends' instance lists until its etcd
    lease expires (up to the 30 s TTL); every request routed to it meanwhile fails at once and, with
    ``--migration-limit 3``, is retried on another worker, as are the requests it was serving when it died. Clients
    see none of it: every request of a steady load through both frontends completes, whole. (With Dynamo's default
    ``--migration-limit 0`` the same run failed 12 of 205 requests with 503.) The engine of the dead worker aborts
    the streams whose connections dropped and ends idle."""
    statuses: list[int] = []
    stop = trio.Event()
    with trio.fail_after(TEST_BOUND):
        frontends = list(cluster.frontends.values())
        victim, others = await _victim_and_others(cluster)
        victim_id = victim.instance_id()

        async with trio.open_nursery() as nursery:
            # Bounded: at most 500 requests per client, and only until the dead worker is gone (stop).
            _steady_load(nursery, frontends, statuses, stop, max_tokens=8, per_client=500)
            # Kill it while it serves: its in-flight requests must be migrated too.
            await _wait_running([victim], 1)
            victim.sidecar.signal(signal.SIGKILL)
            killed = time.monotonic()
            with trio.fail_after(LEASE_TTL_S + 20):
                await _until_gone(frontends, victim_id, poll=0.2)
            gone = time.monotonic() - killed
            await trio.sleep(2.0)  # not a synchronisation: the traffic goes on a little past it, still served
            stop.set()
        assert await victim.sidecar.wait(5) == -signal.SIGKILL
        await wait_engine_idle(victim.engine_address, timeout=10)
        for worker in others:
            assert worker.sidecar.returncode is None
    failed = [s for s in statuses if s != 200]
    assert not failed, f"{len(failed)} of {len(statuses)} requests failed after the SIGKILL: {sorted(set(failed))}"
    assert len(statuses) >= 40, f"only {len(statuses)} requests: too few to say anything"
    assert gone > 5, f"gone {gone:.1f} s after the kill: that was no lease expiry"
    record("worker SIGKILL: killed to gone from both frontends (lease expiry)", gone)
    record("worker SIGKILL: failed requests (--migration-limit 3)", 0.0, f"0 of {len(statuses)}")


async def test_etcd_restart_keeps_every_worker_and_renews_leases(cluster: Cluster) -> None:
    statuses: list[int] = []
    with trio.fail_after(TEST_BOUND):
        frontends = list(cluster.frontends.values())
        ids = _ids(cluster)
        await wait_instances(frontends, ids, timeout=30)
        await cluster.stop_etcd(signal.SIGKILL)
        down = time.monotonic()
        # Routing works from each frontend's discovery view while etcd is away.
        while time.monotonic() - down < 3.0:
            for frontend in frontends:
                statuses.append(await status_of(frontend.url, prompt="etcd away"))
        await cluster.start_etcd()
        up = time.monotonic()
        relisted = await wait_instances(frontends, ids, timeout=30)
        # Longer than the 30 s lease: the restarted etcd keeps the leases only if the workers renew them.
        while time.monotonic() - up < LEASE_TTL_S + 2:
            for frontend in frontends:
                statuses.append(await status_of(frontend.url, prompt="etcd back"))
            await trio.sleep(0.2)  # not a synchronisation: the pace of the traffic watched through the lease
        assert await frontend_instances(frontends[0].url) == ids
        assert await frontend_instances(frontends[1].url) == ids
        for frontend in frontends:
            for worker in cluster.workers.values():
                await routed_to(frontend, worker, timeout=10)
        for worker in cluster.workers.values():
            assert worker.sidecar.returncode is None
            assert "control plane lost" not in worker.sidecar.log()
        for frontend in frontends:
            assert frontend.process.returncode is None
    failed = [s for s in statuses if s != 200]
    assert not failed, f"{len(failed)} of {len(statuses)} requests failed during the etcd restart: {failed[:5]}"
    record("etcd restart: failed requests", 0.0, f"0 of {len(statuses)}; traffic never stopped")
    record("etcd restart: etcd up to every instance listed again in both frontends", relisted)


async def test_etcd_restart_without_its_data_workers_exit_and_re_register(cluster: Cluster) -> None:
    failures: list[tuple[float, str, int]] = []
    with trio.fail_after(TEST_BOUND):
        frontends = list(cluster.frontends.values())
        await wait_instances(frontends, _ids(cluster), timeout=30)
        async with trio.open_nursery() as nursery:
            await nursery.start(cluster.supervise)
            await cluster.stop_etcd(signal.SIGKILL)
            shutil.rmtree(cluster.root / "etcd")
            await cluster.start_etcd()
            up = time.monotonic()
            # Every lease is gone. Each sidecar finds its registration refused by an etcd that answers, says so in
            # one line and exits 1; the supervisor starts it again and it registers afresh (new lease, new id).
            await wait_until(lambda: all(w.restarts for w in cluster.workers.values()), timeout=60, interval=0.1)
            workers_back = time.monotonic() - up
            # Dynamo's frontends lose their leases too: their runtime shuts down and the process exits once the
            # keep-alive gives up; the supervisor restarts them. Watch traffic until that has played out.
            while time.monotonic() - up < 35.0:
                for name, frontend in list(cluster.frontends.items()):
                    status = await status_of(frontend.url, prompt="after etcd data loss", timeout=10)
                    if status != 200:
                        failures.append((time.monotonic() - up, name, status))
                await trio.sleep(0.1)  # not a synchronisation: the pace of the traffic watched for 35 s
            await wait_serving(list(cluster.frontends.values()), timeout=30)
            await wait_instances(list(cluster.frontends.values()), _ids(cluster), timeout=30)
            nursery.cancel_scope.cancel()
        for worker in cluster.workers.values():
            first_run = worker.sidecar.log_path.with_name(f"{worker.name}.log").read_text(errors="replace")
            assert len(re.findall(r"ERROR sidecar\.worker .*: control plane lost", first_run)) == 1, first_run[-3000:]
            assert "Traceback" not in first_run
            assert worker.sidecar.returncode is None
    normal = max((t for t, _, _ in failures), default=workers_back)
    restarts = sum(cluster.frontend_restarts.values())
    record("etcd restart without data: etcd up to every sidecar restarted and registered", workers_back)
    record(
        "etcd restart without data: etcd up to normal traffic on both frontends",
        normal,
        f"{restarts} frontend restart(s); {len(failures)} failed probes, last at {normal:.1f} s",
    )


async def test_etcd_away_longer_than_the_lease_workers_exit_and_re_register(cluster: Cluster) -> None:
    with trio.fail_after(TEST_BOUND + 30):
        frontends = list(cluster.frontends.values())
        await wait_instances(frontends, _ids(cluster), timeout=30)
        workers = list(cluster.workers.values())
        first_runs = {w.name: w.sidecar for w in workers}
        async with trio.open_nursery() as nursery:
            await nursery.start(cluster.supervise)
            await cluster.stop_etcd(signal.SIGKILL)
            down = time.monotonic()
            # Dynamo's lease keep-alive gives up after ~20-30 s without etcd and shuts the runtime down; the sidecar
            # notices (its serve task returns unasked) and exits 1 with one line; the supervisor restarts it, and the
            # new process waits for etcd (--control-plane-deadline-secs) before it registers.
            await wait_until(
                lambda: all(run.returncode is not None for run in first_runs.values()), timeout=75, interval=0.2
            )
            given_up = time.monotonic() - down
            await cluster.start_etcd()
            up = time.monotonic()
            with trio.fail_after(90):
                while True:
                    await wait_serving(list(cluster.frontends.values()), timeout=60)
                    ids = _ids(cluster)
                    current = [await frontend_instances(f.url) for f in cluster.frontends.values()]
                    if all(listed == ids for listed in current) and all(w.restarts for w in workers):
                        break
                    await trio.sleep(0.2)  # the poll interval (wait_serving inside is a wait of its own)
            normal = time.monotonic() - up
            nursery.cancel_scope.cancel()
        for name, run in first_runs.items():
            assert run.returncode == 1, name
            log = run.log()
            assert len(re.findall(r"ERROR sidecar\.worker .*: control plane lost", log)) == 1, log[-3000:]
            assert "Traceback" not in log
    record("etcd away: etcd killed to every first-run sidecar exited (lease given up)", given_up)
    record("etcd away: etcd back up to normal traffic on both frontends", normal, "workers and frontends restarted")


@pytest.mark.parametrize(
    "cluster",
    [
        pytest.param({"engine_args": ("--decode-ms-per-token", "10")}, id="kv-routed"),
        pytest.param(
            {"engine_args": ("--decode-ms-per-token", "10"), "sidecar_args": ("--kv-events", "off")}, id="round-robin"
        ),
    ],
    indirect=True,
)
async def test_nats_restart_in_flight_streams_finish_new_requests_fail_migratably_then_succeed(
    cluster: Cluster, request: pytest.FixtureRequest
) -> None:
    routing = request.node.callspec.id
    in_flight: list[Outcome] = []
    during: list[int] = []
    with trio.fail_after(TEST_BOUND):
        frontends = list(cluster.frontends.values())
        workers = list(cluster.workers.values())
        await wait_serving(frontends, timeout=30)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_streams, frontends, 6, 200, in_flight)
            await _wait_running(workers, 6)
            await cluster.stop_nats(signal.SIGKILL)

            async def dispatch(i: int) -> None:
                await trio.sleep(0.3 * i)  # not a synchronisation: the requests are spread over the outage
                during.append(await status_of(frontends[i % 2].url, prompt=f"nats away {i}", timeout=60))

            async with trio.open_nursery() as requests:
                for i in range(4):
                    requests.start_soon(dispatch, i)
                await trio.sleep(3.0)  # not a synchronisation: the outage's length
                await cluster.start_nats()
                normal = await wait_serving(frontends, timeout=30)
        # The response plane is TCP from worker to frontend: streams already flowing never touch NATS.
        assert len(in_flight) == 6
        assert all(o.succeeded and o.completion_tokens == 200 for o in in_flight), in_flight
        # A request dispatched while NATS is away fails with a migratable error (cannot_connect) and is retried on
        # another worker (--migration-limit 3): it succeeds once NATS is back. When the retries run out first, the
        # client sees 503 with round-robin; Dynamo 1.6.1's KV router reports it as 500 "no endpoints available to
        # route work".
        assert set(during) <= ({200, 503} if routing == "round-robin" else {200, 500, 503}), during
        for worker in workers:
            assert worker.sidecar.returncode is None
    record(f"NATS restart ({routing}): NATS up to normal traffic on both frontends", normal)
    failed = ", ".join(f"{during.count(code)} got {code}" for code in sorted(set(during) - {200})) or "none failed"
    record(
        f"NATS restart ({routing}): requests dispatched during the 3 s outage",
        None,
        f"{during.count(200)} of {len(during)} migrated and served, {failed}; 6/6 in-flight streams complete",
    )


@pytest.mark.parametrize("cluster", [{"engine_args": ("--decode-ms-per-token", "10")}], indirect=True)
async def test_one_frontend_dies_and_the_other_keeps_serving(cluster: Cluster) -> None:
    on_dead: list[Outcome] = []
    survivor_statuses: list[int] = []
    with trio.fail_after(TEST_BOUND):
        dead, alive = cluster.frontends["fe1"], cluster.frontends["fe2"]
        workers = list(cluster.workers.values())
        await wait_serving([dead, alive], timeout=30)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_streams, [dead], 3, 300, on_dead)
            await _wait_running(workers, 3)
            await cluster.stop_frontend("fe1", signal.SIGKILL)
            killed = time.monotonic()
            released: list[float] = []

            async def engines_idle() -> None:
                for worker in workers:
                    await wait_engine_idle(worker.engine_address, timeout=10)
                released.append(time.monotonic() - killed)

            nursery.start_soon(engines_idle)
            while time.monotonic() - killed < 3.0:
                survivor_statuses.append(await status_of(alive.url, prompt="other frontend"))
        # The dead frontend's streams end with an error, and the workers abort them on the engines.
        assert all(not o.succeeded for o in on_dead), on_dead
        for worker in workers:
            assert worker.sidecar.returncode is None
            await routed_to(alive, worker, timeout=10)
        restarting = time.monotonic()
        restarted = await cluster.restart_frontend("fe1")
        await wait_serving([restarted], timeout=30)
        await wait_instances([restarted], _ids(cluster), timeout=10)
        back = time.monotonic() - restarting
    assert survivor_statuses, "no request reached the surviving frontend"
    assert set(survivor_statuses) == {200}, survivor_statuses
    record("frontend killed: failed requests on the other frontend", 0.0, f"0 of {len(survivor_statuses)}")
    record("frontend killed: its streams released on the engines", released[0])
    record("frontend killed: restart to serving with every worker", back, "discovered from etcd")


async def _unlisted(url: str, instance_id: int | None) -> bool:
    return instance_id not in await frontend_instances(url)


async def _at_least(workers: list[ClusterWorker], count: int) -> bool:
    return await _running(workers) >= count


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z")


def _stamp(line: str) -> float | None:
    """The time a log line of the worker carries (ours or Dynamo's), as a POSIX timestamp."""
    match = _STAMP.match(line)
    if match is None:
        return None
    text = match.group(1)
    if "." in text:  # Dynamo writes microseconds, fromisoformat takes at most six digits
        head, fraction = text.split(".")
        text = f"{head}.{fraction[:6]:0<6}"
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    "cluster",
    [{"workers": ("w1", "w2")}, {"workers": ("w1", "w2"), "frontend_args": ("--router-mode", "kv")}],
    ids=["round-robin", "kv-router"],
    indirect=True,
)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["graceful", "killed"])
async def test_an_engine_restart_keeps_its_worker_out_of_routing_and_costs_no_request(
    cluster: Cluster, signum: int
) -> None:
    """Issue 31 item 5: the engine of one worker stops (gracefully: a GOAWAY; or SIGKILLed) under a steady load
    through both frontends and comes back 3 s later. The worker withdraws at once; requests the frontends still
    route to it are refused with a migratable error (and served elsewhere): every request completes. Measured: how
    long after the withdrawal such requests still arrive, and how long until both frontends stop listing it."""
    statuses: list[int] = []
    stop = trio.Event()
    with trio.fail_after(TEST_BOUND):
        frontends = list(cluster.frontends.values())
        victim, others = await _victim_and_others(cluster)
        victim_id = victim.instance_id()

        async with trio.open_nursery() as nursery:
            _steady_load(nursery, frontends, statuses, stop, max_tokens=4, per_client=2000)
            await trio.sleep(1.0)  # a pace: the load runs a while before the fault, not a synchronisation
            mark = len(victim.sidecar.log())
            stopped = time.time()
            assert await cluster.stop_engine("w1", signum) in (0, -signal.SIGKILL)
            with trio.fail_after(15):
                await _until_gone(frontends, victim_id, poll=0.01)
            gone = time.time() - stopped
            await trio.sleep(3.0)  # the outage's length
            await cluster.start_engine("w1")
            await victim.sidecar.wait_for_log(r"reconnecting[^\n]*\n(?:.*\n)*?.*registering -> serving", 30, start=mark)
            await trio.sleep(2.0)  # a pace: load after the comeback, then the end
            stop.set()
        log = victim.sidecar.log()[mark:]
    lines = log.splitlines()
    decided = next(_stamp(line) for line in lines if re.search(r"serving -> (degraded|reconnecting)", line))
    withdrawn = next(_stamp(line) for line in lines if "out of discovery" in line)
    back = next(_stamp(line) for line in lines if "registering -> serving" in line)
    assert decided is not None
    assert withdrawn is not None
    assert back is not None
    refused = [
        t for line in lines if "EngineShutdown: worker is not serving" in line and (t := _stamp(line)) is not None
    ]
    late = [t - withdrawn for t in refused if withdrawn <= t <= back]
    window = max(late, default=0.0)
    print(
        f"\nengine restart: out of serving {decided - stopped:.3f} s after the signal, out of discovery "
        f"{(withdrawn - decided) * 1000:.0f} ms later; {len(late)} request(s) refused while withdrawn, the last "
        f"{window:.3f} s after the withdrawal; gone from both frontends' lists {gone:.3f} s after the signal; "
        f"{len(statuses)} requests"
    )
    failed = [s for s in statuses if s != 200]
    assert not failed, f"{len(failed)} of {len(statuses)} failed: {sorted(set(failed))}"
    for worker in others:
        assert worker.sidecar.returncode is None
    record("engine restart: withdrawal to the last request still routed to the worker", window, f"{len(late)} refused")
