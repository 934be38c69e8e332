"""Registration stays whole after any loss in file discovery (issue 16 item 1), through a KV-router frontend.

Two ``openengine-mock`` engines with gRPC KV events and LoRA, two sidecar workers (``--registration-check-interval-
secs`` 2, adapter ``tiny-lora-a`` loaded on each), one frontend with ``--router-mode kv``. A long prompt warms one
worker's cache. Then a kind of discovery entry is deleted the way an operator or a cleanup job would, and:

* every file the workers had published is back, byte for byte the same names, within 2 × the check interval;
* the worker says so in one line and counts the restores (``openengine_sidecar_registration_restores_total``);
* routing works again: the warm prompt's repeats land on the warm worker with cached tokens, a fresh prompt's
  repeats follow it to whichever worker served it (new KV events flow through the restored channels), and the LoRA
  model answers.

A deleted tree is restored the same way, but a frontend that was running keeps watching the deleted directories
(Dynamo 1.6.1 never re-watches them): the worker says so, and a restarted frontend routes to the warm prefix. An
entry that cannot be written takes the worker out of serving with one line, back when it can be written again, and
ends the worker (exit 1) when it never can.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio

from tests.helpers.processes import DynamoEnv, Frontend, start_frontend
from tests.helpers.stack import (
    LONG_PROMPT,
    MODEL,
    Worker,
    cached_completion,
    dump_logs,
    metric_sum,
    start_engine,
    start_sidecar,
    wait_routable,
)
from tests.helpers.waits import WaitTimeout, wait_until

pytestmark = pytest.mark.e2e

INTERVAL = 2.0
LORA = "tiny-lora-a"
ENGINE_FLAGS = ("--speedup", "0", "--kv-events", "grpc", "--kv-snapshot", "--capability", "lora=true")
RESTORED = r"registration disappeared; publishing it again: restored"
# The worker found its KV publisher's entries: a loss from now on is noticed.
WATCHING = r"watching our discovery entries of kv-events rank 0: KV event source \(rank 0\)"


@dataclass
class Stack:
    denv: DynamoEnv
    frontend: Frontend
    workers: list[Worker]
    http: httpx.AsyncClient

    async def instance(self, worker: Worker) -> int:
        """The worker's Dynamo instance id (every ``dynamo_component_*`` series on its system port names it)."""
        match = re.search(r'worker_id="([0-9a-f]+)"', (await self.http.get(f"{worker.system_url}/metrics")).text)
        assert match, "the worker's metrics name its instance"
        return int(match.group(1), 16)


def published(root: Path) -> set[str]:
    """Every file in the discovery store, relative to it."""
    return {str(path.relative_to(root)) for path in root.rglob("*") if path.is_file() and ".tmp_" not in path.name}


async def worker_metric(http: httpx.AsyncClient, worker: Worker, name: str) -> float:
    """A counter of the worker's own (``openengine_sidecar_<name>_total``, one series: Dynamo's labels on it) from its
    system port."""
    text = (await http.get(f"{worker.system_url}/metrics")).text
    match = re.search(rf"^openengine_sidecar_{name}_total(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    # Every counter is exported from the start (at 0): a missing one means this pattern no longer reads the page.
    assert match, f"openengine_sidecar_{name}_total is not on {worker.system_url}/metrics"
    return float(match.group(1))


async def served(http: httpx.AsyncClient, worker: Worker) -> int:
    return int(await worker_metric(http, worker, "requests_received"))


async def landings(stack: Stack, prompt: str, count: int) -> tuple[list[int], int]:
    """Send ``prompt`` ``count`` times in a row: requests per worker, and how many found cached tokens."""
    before = [await served(stack.http, w) for w in stack.workers]
    cached = 0
    for _ in range(count):
        cached += (await cached_completion(stack.http, stack.frontend.url, prompt)) > 0
    after = [await served(stack.http, w) for w in stack.workers]
    return [b - a for a, b in zip(before, after, strict=True)], cached


async def follows(stack: Stack, prompt: str, timeout: float = 20.0) -> int:
    """Once ``prompt`` has been served, its repeats go to the worker that served it (its KV events reached the
    router): that worker's index. Retried with fresh prompts derived from ``prompt`` until ``timeout``."""
    with trio.fail_after(timeout):
        for attempt in range(1000):
            text = f"{prompt} (take {attempt})"
            stored = await stored_events(stack)
            first, _ = await landings(stack, text, 1)
            warm = first.index(1)
            # The stored events travel to the router (the frontend counts those it applied); if they do not come,
            # the retry takes a fresh prompt.
            with suppress(WaitTimeout):
                await wait_until(lambda: _more_than(stored_events(stack), stored), timeout=2)  # noqa: B023
            repeats, cached = await landings(stack, text, 4)
            if repeats[warm] == 4 and cached == 4:
                return warm
            await trio.sleep(0.2)  # not a synchronisation: the retry's pace
    raise AssertionError("unreachable")


async def load_lora(worker: Worker, root: Path) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        body = {"lora_name": LORA, "source_path": str(root / LORA)}
        answer = (await http.post(f"{worker.system_url}/engine/load_lora", json=body)).json()
    assert answer.get("status") == "ok", answer


@pytest.fixture
def lora_root(tmp_path: Path) -> Path:
    adapter = tmp_path / "loras" / LORA
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA"}))
    return adapter.parent


@asynccontextmanager
async def kv_stack(denv: DynamoEnv, lora_root: Path, *, interval: float = INTERVAL) -> AsyncIterator[Stack]:
    async with AsyncExitStack() as stack, httpx.AsyncClient(timeout=30) as http:
        frontend = await stack.enter_async_context(start_frontend(denv, extra_args=["--router-mode", "kv"]))
        workers = []
        for i in range(2):
            engine = await stack.enter_async_context(start_engine(denv, *ENGINE_FLAGS, name=f"engine{i}"))
            flags = ("--registration-check-interval-secs", str(interval), "--lora-root", str(lora_root))
            workers.append(await stack.enter_async_context(start_sidecar(denv, engine.address, *flags, name=f"w{i}")))
        for worker in workers:
            await worker.process.wait_for_log(WATCHING, 20)
            await load_lora(worker, lora_root)
        await wait_routable(frontend.url, workers=2)
        try:
            yield Stack(denv, frontend, workers, http)
        except BaseException:
            dump_logs(denv)
            raise


async def warm_up(stack: Stack) -> int:
    """Serve LONG_PROMPT until the router sends its repeats where it is cached; that worker's index."""
    return await follows(stack, LONG_PROMPT)


async def wait_restored(root: Path, expected: set[str], timeout: float) -> float:
    """Seconds until every file of ``expected`` is back (fails after ``timeout``)."""
    start = trio.current_time()
    await wait_until(lambda: expected <= published(root), timeout=timeout, interval=0.02, what="every entry back")
    return trio.current_time() - start


async def routing_works_again(stack: Stack, warm: int, prompt: str) -> None:
    """New KV events reach the router again (a fresh prompt's repeats follow it), then the warm prompt goes to the
    warm worker from its cache — at the first try: a request sent to the cold worker would warm it too and make the
    check meaningless — and the LoRA model answers."""
    await follows(stack, prompt)
    counts, cached = await landings(stack, LONG_PROMPT, 4)
    assert (counts[warm], cached) == (4, 4), f"warm prompt sent {counts} (warm worker {warm}), {cached} cached"
    body = {"model": LORA, "prompt": "The river", "max_tokens": 4}
    assert (await stack.http.post(f"{stack.frontend.url}/v1/completions", json=body)).status_code == 200


# -- what a loss deletes --------------------------------------------------------------------------------------------


async def one_channel(stack: Stack, warm: int) -> list[Path]:
    """The warm worker's KV event channel: the one file whose loss silently cuts its events from the router."""
    root = stack.denv.file_kv / "v1"
    iid = await stack.instance(stack.workers[warm])
    for source in (root / "event_sources").iterdir():
        if json.loads(source.read_text())["metadata"]["worker"]["worker_id"] == iid:
            return [root / "event_channels" / source.name]
    raise AssertionError("no event source of the warm worker")


def bucket(name: str) -> Callable[[Stack, int], Awaitable[list[Path]]]:
    async def files(stack: Stack, warm: int) -> list[Path]:
        return sorted((stack.denv.file_kv / "v1" / name).iterdir())

    return files


async def every_file(stack: Stack, warm: int) -> list[Path]:
    """``find "$DYN_FILE_KV" -type f -delete``."""
    return sorted(path for path in stack.denv.file_kv.rglob("*") if path.is_file())


LOSSES: dict[str, Callable[[Stack, int], Awaitable[list[Path]]]] = {
    "one-file": one_channel,
    "instances": bucket("instances"),
    "cards": bucket("mdc"),
    "event-channels": bucket("event_channels"),
    "event-sources": bucket("event_sources"),
    "every-file": every_file,
}


@pytest.mark.parametrize("loss", list(LOSSES))
async def test_each_kind_of_loss_is_restored_and_routing_to_the_warm_prefix_works_again(
    loss: str, dynamo_env: DynamoEnv, lora_root: Path
) -> None:
    root = dynamo_env.file_kv
    with trio.fail_after(180):
        async with kv_stack(dynamo_env, lora_root) as stack:
            warm = await warm_up(stack)
            before = published(root)
            kinds = {path.split("/")[1] for path in before}
            assert kinds == {"instances", "mdc", "event_channels", "event_sources"}, before
            doomed = await LOSSES[loss](stack, warm)
            assert doomed
            for path in doomed:
                path.unlink()
            took = await wait_restored(root, before, timeout=10)
            print(f"\n{loss}: {len(doomed)} file(s) deleted, all back after {took:.2f} s (interval {INTERVAL:g} s)")
            assert published(root) == before
            assert took <= 2 * INTERVAL
            ids = [f"{await stack.instance(w):x}" for w in stack.workers]
            owners = [w for w, iid in zip(stack.workers, ids, strict=True) if any(iid in p.name for p in doomed)]
            for worker in owners or stack.workers[warm : warm + 1]:
                await worker.process.wait_for_log(RESTORED, 5)
            restores = sum([await worker_metric(stack.http, w, "registration_restores") for w in stack.workers])
            assert restores >= len(doomed)
            assert [await worker_metric(stack.http, w, "registration_restore_failures") for w in stack.workers] == [
                0,
                0,
            ]
            await routing_works_again(stack, warm, f"A fresh prompt after losing {loss}: the mill and the bridge.")
            assert all(w.process.returncode is None for w in stack.workers)
            assert all("worker serving -> degraded" not in w.process.log() for w in stack.workers)


async def test_a_deleted_discovery_tree_is_restored_and_a_restarted_frontend_routes_to_the_warm_prefix(
    dynamo_env: DynamoEnv, lora_root: Path
) -> None:
    """``rm -rf "$DYN_FILE_KV"/*``: the workers create the directories again and restore every entry. The frontend
    that was running watches the deleted directories for good (Dynamo 1.6.1); restarted, it finds both workers and
    the warm worker's cache (through the KV recovery endpoint that was restored with the rest)."""
    root = dynamo_env.file_kv
    with trio.fail_after(180):
        async with kv_stack(dynamo_env, lora_root) as stack:
            warm = await warm_up(stack)
            before = published(root)
            for path in root.iterdir():
                shutil.rmtree(path)
            took = await wait_restored(root, before, timeout=10)
            print(f"\ntree: {len(before)} files back after {took:.2f} s (interval {INTERVAL:g} s)")
            assert published(root) == before
            assert took <= 2 * INTERVAL
            for worker in stack.workers:
                line = await worker.process.wait_for_log(RESTORED + r".*had been deleted.*restarted", 5)
                assert "v1/instances" in line.group(0)
            async with start_frontend(dynamo_env, extra_args=["--router-mode", "kv"]) as fresh:
                stack.frontend = fresh
                await wait_routable(fresh.url, workers=2)
                await routing_works_again(stack, warm, "A fresh prompt after losing the whole tree: the quiet town.")


# -- what cannot be restored ----------------------------------------------------------------------------------------


@asynccontextmanager
async def one_worker(denv: DynamoEnv, interval: float) -> AsyncIterator[tuple[Frontend, Worker]]:
    async with (
        start_frontend(denv, extra_args=["--router-mode", "kv"]) as frontend,
        start_engine(denv, *ENGINE_FLAGS) as engine,
        start_sidecar(denv, engine.address, "--registration-check-interval-secs", str(interval)) as worker,
    ):
        await worker.process.wait_for_log(WATCHING, 20)
        await wait_routable(frontend.url, workers=1)
        try:
            yield frontend, worker
        except BaseException:
            dump_logs(denv)
            raise


def occupy_event_source(root: Path) -> Path:
    """Something else takes our event source's key: a directory where the file was. Neither the runtime nor the
    worker can write the file while it is there (and a running frontend's watch is not disturbed)."""
    [source] = (root / "v1" / "event_sources").iterdir()
    source.unlink()
    source.mkdir()
    (source / "squatter").write_text("not a discovery entry")
    return source


LEFT = r"cannot be published again \(KV event source \(rank 0\): "


async def test_an_entry_that_cannot_be_written_takes_the_worker_out_of_serving_until_it_can(
    dynamo_env: DynamoEnv,
) -> None:
    root = dynamo_env.file_kv
    with trio.fail_after(120):
        async with one_worker(dynamo_env, INTERVAL) as (frontend, worker), httpx.AsyncClient(timeout=30) as http:
            [instance] = (root / "v1" / "instances").glob("*generate*")
            source = occupy_event_source(root)
            started = trio.current_time()
            await worker.process.wait_for_log(LEFT, 10)
            took = trio.current_time() - started
            print(f"\nout of serving {took:.2f} s after the entry became unwritable (interval {INTERVAL:g} s)")
            assert took <= 2 * INTERVAL
            await worker.process.wait_for_log(r"worker serving -> degraded \(degrade\)", 5)
            # Withdrawn: the frontend stops routing here.
            await wait_until(lambda: not instance.exists(), timeout=5, interval=0.02)

            async def three_checks_failed() -> bool:
                return await worker_metric(http, worker, "registration_restore_failures") >= 3

            await wait_until(three_checks_failed, timeout=10 * INTERVAL + 5)
            assert len(re.findall(LEFT, worker.process.log())) == 1, "one line, not one per check"
            shutil.rmtree(source)
            started = trio.current_time()
            mark = len(worker.process.log())
            await worker.process.wait_for_log(r"worker registering -> serving \(registered\)", 10, start=mark)
            took = trio.current_time() - started
            print(f"back to serving {took:.2f} s after the entry could be written again")
            assert took <= 2 * INTERVAL
            assert source.is_file()
            assert instance.is_file()
            body = {"model": MODEL, "prompt": "The river", "max_tokens": 4}
            assert (await http.post(f"{frontend.url}/v1/completions", json=body)).status_code == 200
            assert worker.process.returncode is None


async def test_an_entry_that_can_never_be_written_ends_the_worker(dynamo_env: DynamoEnv) -> None:
    interval = 0.3
    with trio.fail_after(120):
        async with one_worker(dynamo_env, interval) as (_, worker):
            occupy_event_source(dynamo_env.file_kv)
            await worker.process.wait_for_log(LEFT, 10)
            assert await worker.process.wait(30) == 1
            log = worker.process.log()
            assert "discovery registration not restored in 12 checks" in log
            assert "exiting so that a supervisor starts a fresh worker" in log
            assert "Traceback" not in log


async def stored_events(stack: Stack) -> float:
    """KV "stored" events the frontend's router has applied."""
    page = (await stack.http.get(f"{stack.frontend.url}/metrics")).text
    return metric_sum(page, "dynamo_component_kv_cache_events_applied", event_type="stored", status="ok")


async def _more_than(count: Awaitable[float], before: float) -> bool:
    return await count > before
