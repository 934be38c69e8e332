"""Nothing listens beyond loopback unless asked: every listening socket of a running stack, checked.

The stack is what ``launch/agg.sh`` runs, with the test harness's loopback environment: the real Dynamo frontend,
``openengine-mock`` (with KV events, so the worker opens both of its event publishers) and ``openengine-sidecar``
with its ops port. Sockets are read from ``/proc`` (the processes' descriptors, the kernel's TCP tables).

One exception is allowed, and only for the worker: Dynamo 1.6.1's ZMQ event-plane publishers (load metrics and KV
events) bind ``tcp://0.0.0.0:<ephemeral>`` whatever ``DYN_EVENT_PLANE_HOST`` says (it sets only the advertised
address; ``lib/runtime/src/transports/event_plane`` hard-codes the bind address). The test pins that exception to the
exact ports the worker advertises in discovery, so any other wide listener fails it (documented in
``docs/operator-guide.md``, "Listeners").
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import trio

from tests.helpers.stack import dump_logs, start_engine, start_sidecar, wait_routable

if TYPE_CHECKING:
    from tests.helpers.processes import DynamoEnv, Frontend

pytestmark = pytest.mark.e2e

_LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    pid: int
    command: str
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _group(pgid: int) -> dict[int, str]:
    """Every live process of process group ``pgid`` (a test process and whatever it spawned): pid → command name."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        command = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # state, ppid, pgrp
            out[int(entry.name)] = command
    return out


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in (Path("/proc") / str(pid) / "fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    # The kernel prints each 32-bit word of the address in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _listening_tcp() -> dict[str, tuple[str, int]]:
    """inode → (address, port) of every listening TCP socket in this network namespace."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != _LISTEN:
                continue
            hex_address, hex_port = fields[1].split(":")
            out[fields[9]] = (_address(hex_address), int(hex_port, 16))
    return out


def listeners(pgid: int) -> list[Listener]:
    table = _listening_tcp()
    found = []
    for pid, command in _group(pgid).items():
        for inode in _socket_inodes(pid):
            if inode in table:
                address, port = table[inode]
                found.append(Listener(pid, command, address, port))
    return sorted(set(found), key=lambda item: (item.pid, item.port))


def advertised_event_ports(file_kv: Path) -> set[int]:
    """The ports of the ZMQ event publishers the worker registered in file discovery."""
    ports = set()
    for path in file_kv.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            if '"zmq"' in text.lower() or "event" in str(path).lower():
                ports |= {int(port) for port in re.findall(r"tcp://[0-9.]+:(\d+)", text)}
    return ports


async def test_every_listener_of_a_running_stack_is_loopback_but_dynamos_event_publishers(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    # The worker's own defaults decide, not the harness's: nothing but the system host is set for it.
    for name in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST"):
        dynamo_env.env.pop(name, None)
    try:
        with trio.fail_after(120):
            async with (
                start_engine(dynamo_env, "--speedup", "0") as engine,
                start_sidecar(dynamo_env, engine.address, "--ops-port", "0") as worker,
            ):
                await wait_routable(frontend.url, workers=1)
                async with httpx.AsyncClient(timeout=10) as http:  # KV events flow: both publishers exist
                    body = {"model": "tiny-oe", "prompt": "The river", "max_tokens": 4}
                    assert (await http.post(f"{frontend.url}/v1/completions", json=body)).status_code == 200
                stack = {
                    "frontend": listeners(frontend.process.pid),
                    "engine": listeners(engine.process.pid),
                    "worker": listeners(worker.process.pid),
                }
                event_ports = advertised_event_ports(dynamo_env.file_kv)
                for name, found in stack.items():
                    print(f"{name}: " + ", ".join(f"{item.address}:{item.port}" for item in found))
                print(f"advertised event-plane ports: {sorted(event_ports)}")

                assert stack["worker"], "the worker listens (system port, request plane, ops port)"
                for name, found in stack.items():
                    wide = [item for item in found if not item.loopback]
                    if name != "worker":
                        assert not wide, f"{name} listens beyond loopback: {wide}"
                        continue
                    # The one documented exception: Dynamo's ZMQ PUB sockets, exactly the advertised ones.
                    assert all(item.address in ("0.0.0.0", "::") for item in wide), wide
                    assert {item.port for item in wide} <= event_ports, (wide, event_ports)
                    assert len(wide) <= 2, wide  # one load publisher, one KV event publisher
    except BaseException:
        dump_logs(dynamo_env)
        raise
