"""The discovery entries of a ``bench.chaos`` run on etcd: one set per live worker at the end, none of a dead one.

Every entry a Dynamo 1.6.1 worker writes to etcd — its ``generate`` instance, its model card(s), its KV event
channel and source, its load channel, its KV query endpoint — is held by the worker's lease, and the lease id is its
instance id. So the entries group by lease into one *set* per worker process. A worker that drains deletes its
set; one that is SIGKILLed leaves it until the lease expires (30 s after its last keep-alive). The run records each
worker's set when the topology is first up (its *shape*: the keys with the instance and publisher ids replaced)
and, at the end, waits (bounded by the lease and a margin) until etcd holds exactly the shape of each live worker
under its current instance and nothing under any other lease.
"""

from __future__ import annotations

import base64
import re
from collections import Counter
from collections.abc import Mapping
from typing import Final

import httpx
import trio

#: Instance, lease and publisher ids in a key (hex, 8 digits or more).
_ID: Final = re.compile(r"(?<=[/_])[0-9a-f]{8,}(?=/|$)")
#: Dynamo 1.6.1's lease TTL, and what is added to it before entries of a dead instance count as left behind.
LEASE_S: Final = 30.0
MARGIN_S: Final = 15.0


#: The largest value a Dynamo 1.6.1 worker writes (its model card, 3,032 bytes for the soak's model), rounded up: the
#: warm-up's entries are no smaller than the workload's, so the workload never makes etcd's retained log bigger.
_WARM_VALUE_BYTES: Final = 4096


async def fill_raft_log(etcd_url: str, entries: int, *, concurrency: int = 16) -> float:
    """Bring etcd's in-memory raft log to its steady size before a soak is measured: ``entries`` puts of one
    scratch key (then its delete). etcd 3.4 keeps every entry in memory until it snapshots (every
    ``--snapshot-count``), then the last 5,000; an hour of the soak writes ~3,300, so without this its memory
    would only rise within the hour -- by design, not a leak -- and hide any real growth. Returns the seconds it
    took."""
    key, value = _b64("oe-soak/warm-up"), base64.b64encode(b"x" * _WARM_VALUE_BYTES).decode()
    started = trio.current_time()
    left = entries

    async def put(http: httpx.AsyncClient) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            answer = await http.post(f"{etcd_url}/v3/kv/put", json={"key": key, "value": value})
            answer.raise_for_status()

    async with httpx.AsyncClient(timeout=10) as http:
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(put, http)
        (await http.post(f"{etcd_url}/v3/kv/deleterange", json={"key": key})).raise_for_status()
    return trio.current_time() - started


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def etcd_entries(http: httpx.AsyncClient, etcd_url: str) -> list[tuple[str, int]]:
    """Every key under ``v1/`` with its lease (0: none)."""
    answer = await http.post(
        f"{etcd_url}/v3/kv/range", json={"key": _b64("v1/"), "range_end": _b64("v10"), "keys_only": True}
    )
    return [(base64.b64decode(kv["key"]).decode(), int(kv.get("lease", 0))) for kv in answer.json().get("kvs", [])]


def shape(key: str) -> str:
    """A key with its ids replaced: the same entry of another instance of the same worker has the same shape."""
    return _ID.sub("<id>", key)


def sets(entries: list[tuple[str, int]]) -> dict[int, Counter[str]]:
    """The entries grouped by lease, as shapes."""
    grouped: dict[int, Counter[str]] = {}
    for key, lease in entries:
        grouped.setdefault(lease, Counter())[shape(key)] += 1
    return grouped


def problems(
    entries: list[tuple[str, int]], live: Mapping[str, int], expected: Mapping[str, Counter[str]]
) -> list[str]:
    """What is wrong with ``entries`` given the live workers' instances (name → instance id) and each worker's
    expected set; empty when etcd holds exactly one set per live worker."""
    grouped = sets(entries)
    found = []
    for name, instance in sorted(live.items()):
        have = grouped.pop(instance, Counter())
        want = expected.get(name, Counter())
        missing, extra = want - have, have - want
        if missing:
            found.append(f"{name} ({instance:x}) lacks {sorted(missing)}")
        if extra:
            found.append(f"{name} ({instance:x}) has more: {sorted(extra)}")
    for lease, left in sorted(grouped.items()):
        found.append(f"lease {lease:x} of no live worker holds {sum(left.values())} entries, e.g. {sorted(left)[:2]}")
    return found


async def settled(
    etcd_url: str, live: Mapping[str, int], expected: Mapping[str, Counter[str]], bound_s: float
) -> tuple[bool, str]:
    """Wait until etcd holds one set per live worker (at most ``bound_s``); the answer and what was last seen."""
    last = ["not asked"]
    async with httpx.AsyncClient(timeout=5) as http:
        with trio.move_on_after(bound_s):
            while True:
                try:
                    last = problems(await etcd_entries(http, etcd_url), live, expected)
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    last = [f"{type(exc).__name__}: {exc}"]
                if not last:
                    return True, f"{len(live)} sets, one per live worker"
                await trio.sleep(1.0)
    return False, "; ".join(last)


__all__ = ["LEASE_S", "MARGIN_S", "etcd_entries", "problems", "sets", "settled", "shape"]
