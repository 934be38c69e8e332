"""Faults on the sidecar ↔ engine path of ``bench.chaos``: ``tc netem`` where the machine has it, else a TCP proxy.

Two interchangeable links, one per aggregated worker, with the same three faults:

* ``delay(ms, jitter_ms)`` — every byte from either side arrives that much later;
* ``loss(percent)`` — packets lost. netem drops them (TCP retransmits); the proxy cannot drop bytes inside a TCP
  stream, so it does what a loss does to a TCP stream: a delivery stalls for a retransmission timeout (200–400 ms)
  and everything behind it waits (head-of-line blocking);
* ``blackhole()`` — one connection stops carrying anything, in both directions, without being closed (netem: every
  connection of the link, ``loss 100%``; tc cannot single out one connection without a classifier the proxy does not
  need). When it is lifted, held bytes flow again, as retransmissions would.

:class:`NetemLink` runs ``tc`` in the project's network namespaces (the engine in a namespace of its own: netem on
its interface delays what the engine sends, netem on the bridge port facing it delays what it receives).
:class:`ProxyLink` is a trio TCP proxy in the chaos process: the sidecar connects to the proxy, the proxy to the
engine (again for every connection, so an engine restarted on its port is reached at once). ``netem_unavailable()``
probes whether netem works here; ``bench.chaos --network auto`` takes netem when it does.

Both keep only loopback or namespace addresses, and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Protocol

import trio

#: What a lost packet costs a TCP stream before its retransmission arrives (Linux's minimum RTO is 200 ms).
_RTO_S: Final = (0.2, 0.4)
#: Bytes read per receive; also the unit the proxy delays, stalls or holds.
_CHUNK: Final = 65536
#: Chunks queued per direction before the reader waits (the proxy never buffers without bound).
_QUEUE: Final = 256
_TC_TIMEOUT_S: Final = 10.0


class Link(Protocol):
    """One sidecar ↔ engine path with faults; ``clear()`` lifts every fault."""

    kind: str

    def delay(self, ms: float, jitter_ms: float) -> None: ...

    def loss(self, percent: float) -> None: ...

    def blackhole(self, rng: random.Random) -> str: ...

    def clear(self) -> None: ...


# ---------------------------------------------------------------------------------------------------------- netem


def _tc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", *args], capture_output=True, text=True, timeout=_TC_TIMEOUT_S, check=False)


def netem_unavailable() -> str | None:
    """None when ``tc qdisc … netem`` works in a network namespace of ours; else why not."""
    if shutil.which("tc") is None or shutil.which("ip") is None:
        return "tc or ip (iproute2) is not installed"
    if os.geteuid() != 0:
        return "not root (tc and network namespaces need CAP_NET_ADMIN)"
    ns = f"oe{os.getpid()}x{random.getrandbits(16):04x}-netem"
    try:
        made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True, timeout=_TC_TIMEOUT_S)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], capture_output=True, timeout=_TC_TIMEOUT_S)
        probe = _tc("-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
        if probe.returncode != 0:
            return f"tc netem does not work here: {probe.stderr.strip() or probe.stdout.strip()}"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_TC_TIMEOUT_S)


@dataclass
class NetemLink:
    """netem on both legs of an engine's namespace: its ``eth0`` (engine → sidecar) and its bridge port (→ engine)."""

    engine_ns: str
    switch_ns: str
    switch_port: str
    kind: str = "netem"

    def _apply(self, *netem: str) -> None:
        for ns, dev in ((self.engine_ns, "eth0"), (self.switch_ns, self.switch_port)):
            done = _tc("-n", ns, "qdisc", "replace", "dev", dev, "root", "netem", *netem)
            if done.returncode != 0:
                raise RuntimeError(f"tc netem {' '.join(netem)} on {ns}/{dev}: {done.stderr.strip()}")

    def delay(self, ms: float, jitter_ms: float) -> None:
        self._apply("delay", f"{ms:.0f}ms", f"{jitter_ms:.0f}ms")

    def loss(self, percent: float) -> None:
        self._apply("loss", f"{percent:g}%")

    def blackhole(self, rng: random.Random) -> str:
        self._apply("loss", "100%")
        return "every connection (netem loss 100%)"

    def clear(self) -> None:
        for ns, dev in ((self.engine_ns, "eth0"), (self.switch_ns, self.switch_port)):
            _tc("-n", ns, "qdisc", "del", "dev", dev, "root")


# ---------------------------------------------------------------------------------------------------------- proxy


@dataclass
class _Conn:
    number: int
    frozen: trio.Event | None = None  # set while blackholed; waited on by both pumps


@dataclass
class ProxyLink:
    """A TCP proxy ``listen_host:port`` → ``upstream()`` with delay, loss-like stalls and a blackholed connection.

    Run it with ``nursery.start(link.run)``; it stops when its nursery is cancelled (every connection closed).
    """

    listen_host: str
    port: int
    upstream: Callable[[], tuple[str, int]]
    kind: str = "proxy"
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss_p: float = 0.0
    connections: dict[int, _Conn] = field(default_factory=dict)
    accepted: int = 0
    _rng: random.Random = field(default_factory=lambda: random.Random(0))

    # -- faults -------------------------------------------------------------------------------------------------

    def delay(self, ms: float, jitter_ms: float) -> None:
        self.delay_s, self.jitter_s = ms / 1000, jitter_ms / 1000

    def loss(self, percent: float) -> None:
        self.loss_p = percent / 100

    def blackhole(self, rng: random.Random) -> str:
        if not self.connections:
            return "no open connection"
        conn = self.connections[rng.choice(sorted(self.connections))]
        if conn.frozen is None:
            conn.frozen = trio.Event()
        return f"connection #{conn.number} of {len(self.connections)}"

    def clear(self) -> None:
        self.delay_s = self.jitter_s = self.loss_p = 0.0
        for conn in self.connections.values():
            if conn.frozen is not None:
                conn.frozen.set()
                conn.frozen = None

    # -- serving ------------------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host=self.listen_host)
        self.port = listeners[0].socket.getsockname()[1]  # port 0: the OS picked one
        async with trio.open_nursery() as nursery:
            task_status.started()
            await trio.serve_listeners(self._serve, listeners, handler_nursery=nursery)

    async def _serve(self, downstream: trio.SocketStream) -> None:
        self.accepted += 1
        conn = _Conn(self.accepted)
        host, port = self.upstream()
        try:
            with trio.fail_after(5):
                upstream = await trio.open_tcp_stream(host, port)
        except (OSError, trio.TooSlowError):
            await downstream.aclose()  # the engine is down: the sidecar sees the connection refused-like close
            return
        self.connections[conn.number] = conn
        try:
            async with downstream, upstream, trio.open_nursery() as nursery:
                nursery.start_soon(self._direction, conn, downstream, upstream, nursery.cancel_scope)
                nursery.start_soon(self._direction, conn, upstream, downstream, nursery.cancel_scope)
        except* (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # a connection reset under the proxy ends that connection, never the proxy
        finally:
            del self.connections[conn.number]

    async def _direction(
        self, conn: _Conn, source: trio.SocketStream, sink: trio.SocketStream, scope: trio.CancelScope
    ) -> None:
        """One direction: read, stamp each chunk with its delivery time, deliver in order. Either side closing or
        failing closes both (``scope``), as a TCP connection through a middlebox would end."""
        send, receive = trio.open_memory_channel[tuple[float, bytes]](_QUEUE)

        async def reader() -> None:
            async with send:
                while True:
                    try:
                        data = await source.receive_some(_CHUNK)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""
                    if not data:
                        return
                    due = trio.current_time() + self._added_delay()
                    try:
                        await send.send((due, data))
                    except trio.BrokenResourceError:  # the writer's side closed: the connection is over
                        return

        async def writer() -> None:
            async with receive:
                async for due, data in receive:
                    while conn.frozen is not None:
                        await conn.frozen.wait()
                    await trio.sleep_until(due)
                    try:
                        await sink.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        return
            closed = (trio.BrokenResourceError, trio.ClosedResourceError)
            with trio.CancelScope(shield=True), trio.move_on_after(1), contextlib.suppress(*closed):
                await sink.send_eof()

        try:
            async with trio.open_nursery() as inner:
                inner.start_soon(reader)
                inner.start_soon(writer)
        finally:
            scope.cancel()

    def _added_delay(self) -> float:
        delay = self.delay_s
        if self.jitter_s:
            delay = max(0.0, self._rng.gauss(delay, self.jitter_s))
        if self.loss_p and self._rng.random() < self.loss_p:
            delay += self._rng.uniform(*_RTO_S)
        return delay if math.isfinite(delay) else 0.0
