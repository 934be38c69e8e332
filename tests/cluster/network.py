"""Test "hosts": Linux network namespaces joined by veth pairs through a bridge, or loopback when the machine can't.

Layout (one run; ``<tag>`` keeps concurrent runs apart, ``198.18.<n>.0/24`` is the RFC 2544 benchmarking range)::

    root namespace (pytest, the HTTP client)  198.18.<n>.254 ─┐
    oe<tag>-cp   etcd + NATS                  198.18.<n>.1   ─┤
    oe<tag>-fe1  frontend 1                   198.18.<n>.11  ─┤ veth pairs, one bridge
    oe<tag>-fe2  frontend 2                   198.18.<n>.12  ─┤ in oe<tag>-sw
    oe<tag>-w1…  sidecar + its mock engine    198.18.<n>.21… ─┘

Every process of a host runs under ``ip netns exec <ns>`` (which execs: signals reach the real process). Traffic
never leaves the machine: the only addresses are the namespaces' own and loopback. Everything is removed on exit,
and leftovers of a crashed run (names ``oe*-…`` with a dead owner pid) are removed before a new run.

``netns_unavailable()`` probes the capability (root, ``ip``, namespaces, veth, bridge) at test time; when any of it
is missing the topology falls back to loopback (every host is 127.0.0.1) and the reason is logged and warned.
``OPENENGINE_CLUSTER_NETNS=0`` forces the fallback.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import subprocess
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger("tests.cluster")

#: Namespaces and root-side links of this project start with this (and carry the owner's pid in their name).
PREFIX = "oe"
_IP_TIMEOUT = 10.0


@dataclass(frozen=True)
class Host:
    """One test host: a name, the address its services bind and advertise, and its namespace (None: loopback)."""

    name: str
    address: str
    netns: str | None = None

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on this host."""
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)


@dataclass
class Network:
    """The hosts of one run. ``mode`` says whether they are real namespaces; ``reason`` why not, if not."""

    mode: Literal["netns", "loopback"]
    hosts: dict[str, Host]
    reason: str = ""
    client_address: str = "127.0.0.1"
    _namespaces: list[str] = field(default_factory=list)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    @property
    def isolated(self) -> bool:
        return self.mode == "netns"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT, check=check)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale() -> None:
    """Namespaces and links left by a run that died without cleaning up (its pid is gone)."""
    owned = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+-")
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = owned.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _ip("netns", "del", name, check=False)
    links = _ip("-o", "link", "show", check=False).stdout
    for match in re.finditer(rf"^\d+: ({PREFIX}(\d+)x[0-9a-f]+h)[@:]", links, re.M):
        if not _pid_alive(int(match.group(2))):
            _ip("link", "del", match.group(1), check=False)


def netns_unavailable() -> str | None:
    """None if this process can build namespaces joined by veth pairs and a bridge; else the reason it can't."""
    if os.environ.get("OPENENGINE_CLUSTER_NETNS", "1").lower() in ("0", "false", "no", "off"):
        return "OPENENGINE_CLUSTER_NETNS=0"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    tag = f"{PREFIX}{os.getpid()}x{random.getrandbits(16):04x}"
    a, b = f"{tag}-pa", f"{tag}-pb"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", "p0", "netns", a, "type", "veth", "peer", "name", "p1", "netns", b)
        _ip("-n", b, "link", "add", "br0", "type", "bridge")
        _ip("-n", b, "link", "set", "p1", "master", "br0")
        _ip("-n", a, "link", "set", "lo", "up")
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"cannot create network namespaces here: {detail.strip()}"
    finally:
        _ip("netns", "del", a, check=False)
        _ip("netns", "del", b, check=False)


@contextmanager
def open_network(names: Sequence[str], *, addresses: dict[str, int] | None = None) -> Iterator[Network]:
    """Hosts named ``names`` (last octet from ``addresses``, else 1, 2, …): namespaces if possible, else loopback."""
    reason = netns_unavailable()
    if reason is not None:
        message = f"cluster tests run on loopback, not in network namespaces: {reason}"
        log.warning(message)
        warnings.warn(message, stacklevel=2)
        yield Network("loopback", {n: Host(n, "127.0.0.1") for n in names}, reason=reason)
        return
    _remove_stale()
    tag = f"{PREFIX}{os.getpid()}x{random.getrandbits(16):04x}"
    subnet = f"198.18.{random.randrange(1, 255)}"
    switch = f"{tag}-sw"
    root_link = f"{tag}h"[:15]
    octets = addresses or {n: i + 1 for i, n in enumerate(names)}
    network = Network("netns", {}, client_address=f"{subnet}.254")
    try:
        _ip("netns", "add", switch)
        network._namespaces.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for index, name in enumerate(names):
            ns = f"{tag}-{name}"
            _ip("netns", "add", ns)
            network._namespaces.append(ns)
            port = f"p{index}"
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", switch)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            address = f"{subnet}.{octets[name]}"
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            network.hosts[name] = Host(name, address, ns)
        # The test process (root namespace) reaches the hosts through one more leg on the bridge.
        _ip("link", "add", root_link, "type", "veth", "peer", "name", "proot", "netns", switch)
        _ip("-n", switch, "link", "set", "proot", "master", "br0")
        _ip("-n", switch, "link", "set", "proot", "up")
        _ip("addr", "add", f"{network.client_address}/24", "dev", root_link)
        _ip("link", "set", root_link, "up")
        log.info("cluster network: %s", ", ".join(f"{h.name}={h.address}" for h in network.hosts.values()))
        yield network
    finally:
        _ip("link", "del", root_link, check=False)
        for ns in reversed(network._namespaces):
            _ip("netns", "del", ns, check=False)


# ---------------------------------------------------------------------- partitions

#: The last octet of a next hop no host answers for: traffic routed through it dies at the failed neighbour lookup.
_NOWHERE = 253


def _nowhere(network: Network, octet: int = _NOWHERE) -> str:
    return network.client_address.rsplit(".", 1)[0] + f".{octet}"


def _routes(network: Network, a: str, b: str) -> list[tuple[str, str]]:
    """``(namespace, destination)`` of the routes that cut ``a`` from ``b`` (``"client"``: the root namespace's leg,
    whose routes are never touched: the other side's route alone stops every exchange, as a reply never comes)."""
    routes = []
    for here, there in ((a, b), (b, a)):
        if here == "client":
            continue
        ns = network.hosts[here].netns
        target = network.client_address if there == "client" else network.hosts[there].address
        if ns is not None:
            routes.append((ns, target))
    return routes


def partition_unavailable(network: Network) -> str | None:
    """None if :func:`cut` works on this network (namespaces, and a route through a dead next hop); else why not."""
    if not network.isolated:
        return f"hosts are not in network namespaces ({network.reason or 'loopback'})"
    host = next((h for h in network.hosts.values() if h.netns), None)
    if host is None:
        return "no host in a namespace"
    ns, probe_target = host.netns or "", f"{_nowhere(network, _NOWHERE - 1)}/32"
    probe = _ip("-n", ns, "route", "add", probe_target, "via", _nowhere(network), check=False)
    if probe.returncode != 0:
        return f"`ip route add … via` refused: {probe.stderr.strip()}"
    _ip("-n", ns, "route", "del", probe_target, check=False)
    return None


def cut(network: Network, a: str, b: str) -> None:
    """Partition hosts ``a`` and ``b``: in each one's namespace, the other's address routed to a next hop nobody
    answers for. Packets of open connections are dropped without a reset (TCP retransmits, the peer hears nothing);
    a new connection fails with "no route to host" once the neighbour lookup has failed (≈ 3 s the first time).
    Everything else of both hosts is untouched. :func:`mend` undoes it; held data then flows again."""
    for ns, target in _routes(network, a, b):
        _ip("-n", ns, "route", "replace", f"{target}/32", "via", _nowhere(network))


def mend(network: Network, a: str, b: str) -> None:
    """Undo :func:`cut` (idempotent)."""
    for ns, target in _routes(network, a, b):
        _ip("-n", ns, "route", "del", f"{target}/32", check=False)
