"""Process fixtures for end-to-end tests: a loopback-only Dynamo environment, a frontend launcher, a generic process
launcher with bounded waits and a guaranteed kill of the whole process group.

Rules kept here (see ``tests/conftest.py``): loopback only, ports picked by the OS, every wait bounded, every process
started is killed by whoever started it (``start_process`` is an async context manager whose exit always kills the
process group), every temp directory removed.

Typical use from a trio test::

    with dynamo_env() as denv:
        async with start_frontend(denv, migration_limit=3) as fe:
            async with start_process([sys.executable, "worker.py"], denv.env, ready="READY") as worker:
                await wait_for_model(fe.url, "tiny", timeout=20)
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from .waits import WaitTimeout, wait_until

#: How often log files and HTTP endpoints are polled while waiting.
POLL_INTERVAL = 0.02


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_low_port() -> int:
    """A free loopback port below 32768.

    Dynamo 1.6.1 parses ``DYN_SYSTEM_PORT`` as an *i16*: a port from the OS's ephemeral range (32768+) makes
    ``DistributedRuntime(...)`` fail with "expected i16 for key SYSTEM_PORT".
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768")


@dataclass
class DynamoEnv:
    """A scratch directory and the environment shared by a frontend and its workers (file discovery, TCP, ZMQ)."""

    root: Path
    env: dict[str, str]

    @property
    def file_kv(self) -> Path:
        """The file-discovery store (``DYN_FILE_KV``)."""
        return Path(self.env["DYN_FILE_KV"])

    def worker_env(self, **extra: str) -> dict[str, str]:
        """The shared environment plus a system port of its own for one worker process."""
        env = dict(self.env)
        env["DYN_SYSTEM_HOST"] = "127.0.0.1"
        env["DYN_SYSTEM_PORT"] = str(free_low_port())
        env.update(extra)
        return env

    def log_path(self, name: str) -> Path:
        """A fresh log file name under the scratch directory."""
        return fresh_log_path(self.root, name)


def fresh_log_path(root: Path, name: str) -> Path:
    """``root/logs/<name>.log``, or ``<name>.<i>.log`` when a process of that name ran before (restarts keep theirs)."""
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    for i in range(1000):
        path = logs / (f"{name}.log" if i == 0 else f"{name}.{i}.log")
        if not path.exists():
            return path
    raise RuntimeError(f"too many logs named {name}")


def dump_log_tails(root: Path, lines: int) -> None:
    """Print the tail of every process log under ``root/logs`` (the scratch directory goes away with the test)."""
    for log in sorted((root / "logs").glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"===== {log.name} (tail)\n" + "\n".join(tail))


def base_env(root: Path) -> dict[str, str]:
    """Loopback-only Dynamo variables rooted in ``root``: Dynamo 1.6.1 without etcd and NATS (discovery in files,
    requests over TCP, events over ZMQ)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "HF_"))}
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    (root / "kv").mkdir(exist_ok=True)
    (root / "tmp").mkdir(exist_ok=True)
    env.update(
        {
            "HOME": str(home),
            "TMPDIR": str(root / "tmp"),
            "HF_HOME": str(home / "hf"),
            "HF_HUB_OFFLINE": "1",
            "DYN_FILE_KV": str(root / "kv"),
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq",
            "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1",
            "DYN_HTTP_HOST": "127.0.0.1",
            "DYN_SYSTEM_HOST": "127.0.0.1",
            "DYN_SELF_HOST_METADATA": "0",
            # Dynamo's logging setup would write SGLang's log config to a new $TMPDIR/tmp*.json on every start.
            "DYN_SKIP_SGLANG_LOG_FORMATTING": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@contextmanager
def dynamo_env() -> Iterator[DynamoEnv]:
    """A temp directory with ``DYN_FILE_KV``, ``HOME``, ``TMPDIR`` inside; removed on exit."""
    with tempfile.TemporaryDirectory(prefix="dynamo-e2e-") as tmp:
        root = Path(tmp)
        yield DynamoEnv(root=root, env=base_env(root))


@dataclass
class Process:
    """A child process started by :func:`start_process`; its stdout and stderr go to ``log_path``."""

    argv: Sequence[str]
    log_path: Path
    proc: trio.Process
    _stdin_lock: trio.Lock = field(default_factory=trio.Lock)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def log(self) -> str:
        """Everything the process wrote so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    async def wait_for_log(self, pattern: str, timeout: float, *, start: int = 0) -> re.Match[str]:
        """Wait until ``pattern`` (a regex) appears in the log after character offset ``start``."""
        regex = re.compile(pattern, re.MULTILINE)

        def seen() -> re.Match[str] | None:
            exited = self.proc.poll() is not None  # read before the log: a last line written on exit is seen
            match = regex.search(self.log(), start)
            if match is None and exited:
                raise ProcessExited(self, f"exited with {self.proc.returncode} before {pattern!r}")
            return match

        try:
            match = await wait_until(seen, timeout=timeout, interval=POLL_INTERVAL)
            assert match is not None  # wait_until returns only a truthy value
            return match
        except WaitTimeout:
            raise TimeoutError(
                f"{self.argv[:3]}: {pattern!r} not seen in {timeout} s; log tail:\n{self.log_tail()}"
            ) from None

    async def send_line(self, line: str) -> None:
        """Write one line to the process's stdin (started with ``stdin=True``)."""
        if self.proc.stdin is None:
            raise RuntimeError("process was started without stdin")
        async with self._stdin_lock:
            await self.proc.stdin.send_all(line.encode() + b"\n")

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the process (not its group)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    async def wait(self, timeout: float) -> int:
        """Wait for the exit code, at most ``timeout`` seconds."""
        with trio.fail_after(timeout):
            return await self.proc.wait()


class ProcessExited(RuntimeError):
    """A child process ended while a test was waiting for it."""

    def __init__(self, process: Process, what: str) -> None:
        super().__init__(f"{process.argv[:3]} {what}; log tail:\n{process.log_tail()}")


Ready = str | Callable[[Process], Awaitable[bool]] | None


def _kill_group(pid: int, signum: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


async def stop_process(process: Process, *, grace: float = 5.0, signum: int = signal.SIGTERM) -> None:
    """Signal the process group, wait up to ``grace`` seconds, then SIGKILL the group. Never raises, never blocks
    longer than ``grace`` + 5 s, runs even inside a cancelled scope."""
    with trio.CancelScope(shield=True):
        if process.proc.poll() is None:
            _kill_group(process.pid, signum)
            with trio.move_on_after(grace):
                await process.proc.wait()
        # Children that outlived the leader (same session, same group) die too.
        _kill_group(process.pid, signal.SIGKILL)
        with trio.move_on_after(5):
            await process.proc.wait()


@asynccontextmanager
async def start_process(
    argv: Sequence[str],
    env: dict[str, str],
    *,
    log_path: Path,
    ready: Ready = None,
    ready_timeout: float = 30.0,
    stop_grace: float = 5.0,
    stdin: bool = False,
    cwd: Path | None = None,
) -> AsyncIterator[Process]:
    """Start ``argv`` in a new session (its own process group) and yield it once ``ready``.

    ``ready`` is a regex awaited in the combined stdout/stderr log, or an async predicate polled every
    :data:`POLL_INTERVAL`, or ``None``. Waiting is bounded by ``ready_timeout``; an early exit fails at once with
    the log tail. On exit — normal, failure or cancellation — the group gets SIGTERM, ``stop_grace`` seconds,
    then SIGKILL.
    """
    log = log_path.open("ab")
    try:
        proc = await trio.lowlevel.open_process(
            list(argv),
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()
    process = Process(argv=argv, log_path=log_path, proc=proc)
    try:
        if isinstance(ready, str):
            await process.wait_for_log(ready, ready_timeout)
        elif ready is not None:
            probe = ready

            async def is_ready() -> bool:
                if await probe(process):
                    return True
                if proc.poll() is not None:
                    raise ProcessExited(process, f"exited with {proc.returncode} before it was ready")
                return False

            try:
                await wait_until(is_ready, timeout=ready_timeout, interval=POLL_INTERVAL)
            except WaitTimeout:
                raise TimeoutError(
                    f"{argv[:3]} not ready in {ready_timeout} s; log tail:\n{process.log_tail()}"
                ) from None
        yield process
    finally:
        await stop_process(process, grace=stop_grace)
        if proc.stdin is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await proc.stdin.aclose()


# --- HTTP probes --------------------------------------------------------------------------------------------------


async def http_ok(url: str) -> bool:
    """True if GET ``url`` answers 200 (connection errors are False)."""
    try:
        async with httpx.AsyncClient(timeout=2.0) as client:
            return (await client.get(url)).status_code == 200
    except httpx.HTTPError:
        return False


async def list_models(url: str) -> list[str]:
    """Model ids in the frontend's ``/v1/models``."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        response = await client.get(f"{url}/v1/models")
        response.raise_for_status()
        return [str(m["id"]) for m in response.json().get("data", [])]


async def wait_for_model(url: str, name: str, timeout: float, *, present: bool = True) -> float:
    """Wait until ``name`` is listed (``present``) or gone from the frontend at ``url``; returns the seconds waited."""
    start = time.monotonic()

    async def listed() -> bool:
        return (name in await list_models(url)) is present

    state = "listed" if present else "gone"
    what = f"model {name!r} {state} at {url}"
    await wait_until(listed, timeout=timeout, interval=POLL_INTERVAL, what=what, retry_on=(httpx.HTTPError,))
    return time.monotonic() - start


async def frontend_instances(url: str, endpoint: str = "generate") -> list[int]:
    """Instance ids the frontend's ``/health`` lists for ``endpoint`` (what its router can route to)."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        health = (await client.get(f"{url}/health")).json()
    return [int(i["instance_id"]) for i in health.get("instances", []) if i.get("endpoint") == endpoint]


async def wait_for_instances(url: str, count: int, timeout: float) -> list[int]:
    """Wait until the frontend at ``url`` knows ``count`` generate instances (or more); returns their ids.

    A worker's model being listed does not mean the frontend knows every instance yet: a request sent in between may
    only reach the first."""

    async def known() -> list[int]:
        ids = await frontend_instances(url)
        return ids if len(ids) >= count else []

    what = f"{count} instances known to the frontend at {url}"
    return await wait_until(known, timeout=timeout, what=what, retry_on=(httpx.HTTPError, ValueError))


# --- the frontend ------------------------------------------------------------------------------------------------


@dataclass
class Frontend:
    """A running ``python -m dynamo.frontend``."""

    url: str
    port: int
    migration_limit: int
    process: Process


@asynccontextmanager
async def start_frontend(
    denv: DynamoEnv,
    *,
    migration_limit: int = 0,
    extra_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
    ready_timeout: float = 30.0,
) -> AsyncIterator[Frontend]:
    """Start the real Dynamo frontend on a free loopback port; yields once ``/live`` answers; always killed.

    A client's ``traceparent`` reaches a worker's context only with tracing on in the frontend and the worker
    (``DYN_LOGGING_JSONL=1`` or ``OTEL_EXPORT_ENABLED=1`` in both); ``tracestate`` is never forwarded.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "dynamo.frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(port),
        "--discovery-backend",
        "file",
        "--request-plane",
        "tcp",
        "--event-plane",
        "zmq",
        "--migration-limit",
        str(migration_limit),
        *extra_args,
    ]

    async def healthy(_: Process) -> bool:
        return await http_ok(f"{url}/live")

    env = {**denv.env, **(extra_env or {})}
    async with start_process(
        argv, env, log_path=denv.log_path("frontend"), ready=healthy, ready_timeout=ready_timeout
    ) as process:
        yield Frontend(url=url, port=port, migration_limit=migration_limit, process=process)
