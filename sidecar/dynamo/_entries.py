"""What this worker publishes in Dynamo's file discovery store, and how each entry is put back when it is lost.

Layout (ai-dynamo-runtime 1.6.1, observed with a KV-routing worker; ``<hex>`` is an id in lower-case hex, keys are
Dynamo's file-store key encoding, see :func:`dynamo_key`)::

    $DYN_FILE_KV/v1/instances/<ns>/<component>/<endpoint>/<instance>   serve_endpoint, register_endpoint_instance
        endpoint "generate"                        our request endpoint
        endpoint "worker_kv_query_source_<pub>"    KvEventPublisher(enable_local_indexer=True): the router's recovery
                                                   target (a restarted frontend reads this worker's index through it)
        endpoint "load_lora", …                    the control endpoints (LoRA)
    $DYN_FILE_KV/v1/mdc/<ns>/<component>/<endpoint>/<instance>[/<slug>]    register_model (base card, LoRA cards)
    $DYN_FILE_KV/v1/event_channels/namespace/<ns>/component/<c>/endpoint/<e>/topic/kv-events/<pub>
                                                   KvEventPublisher: where its ZMQ publisher listens
    $DYN_FILE_KV/v1/event_channels/namespace/<ns>/component/<c>/endpoint/<e>/topic/kv_metrics/<pub>
                                                   WorkerMetricsPublisher.create_endpoint: the load channel
    $DYN_FILE_KV/v1/event_sources/namespace/<ns>/component/<c>/endpoint/<e>/topic/kv-events/<pub>
                                                   KvEventPublisher: worker id, dp rank, recovery target

Every file is JSON; Dynamo's FileStore refreshes the mtime of the files it wrote every 3.3 s (keep-alive), deletes
files of any owner older than 10 s, and never re-creates one that disappeared (checked with 1.6.1): it just
logs ``FileStore::keep_alive failed opening owned file`` every 3.3 s. It never re-creates a deleted bucket directory
either, so after ``rm -rf $DYN_FILE_KV/*`` every write of the runtime fails until the directory exists again.

How each entry comes back in-process (checked by experiment against a KV-router frontend):

* instances: ``Endpoint.register_endpoint_instance()`` on the endpoint's path writes the same file again;
* model cards: ``register_model`` again (base and LoRA cards);
* event channels and event sources: Dynamo 1.6.1 has no call that re-publishes them for a running publisher —
  creating the publisher again makes a *new* one (new id, new ZMQ port, an empty local index, the router's view of
  this worker lost). The worker keeps the bytes the runtime wrote and writes them back: the publisher, its ZMQ
  socket and its index never stopped, the runtime still lists the path as its own (its keep-alive refreshes it again
  from then on, its shutdown removes it), and the router subscribes again on the file's return.

What the worker cannot undo: a frontend that was running when a bucket directory was deleted keeps watching the
deleted directory (Dynamo 1.6.1 never re-watches it) and sees no worker until it is restarted.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "FILE_TTL",
    "Buckets",
    "Entry",
    "EntryKind",
    "RestoreReport",
    "dynamo_key",
    "fresh",
    "instance_key",
    "listening_ports",
    "read_bucket",
    "write_back",
]

#: File discovery's hard-coded lease (``lib/runtime/src/storage/kv/file.rs``): files older than this are expired.
FILE_TTL: Final = 10.0
#: Dynamo's prefix for temporary files: its watchers ignore them, so a half-written file is never read.
_TEMP_PREFIX: Final = ".tmp_"

EntryKind = Literal["instance", "card", "lora_card", "event_channel", "event_source"]


@dataclass(frozen=True, slots=True)
class Entry:
    """One file this worker published, ``what`` it is for a log line, and how it comes back: ``endpoint``
    (``ns.component.name``) for instances re-registered through Dynamo, ``lora`` for LoRA cards, ``data`` for
    entries written back byte for byte; ``owner`` groups the entries of one publisher."""

    kind: EntryKind
    path: Path
    what: str
    owner: str = ""
    endpoint: str | None = None
    lora: str | None = None
    data: bytes | None = None


@dataclass(slots=True)
class RestoreReport:
    """The outcome of one check: what was lost, what came back, what could not (with why)."""

    lost: list[Entry] = field(default_factory=list)
    restored: list[Entry] = field(default_factory=list)
    failed: list[tuple[Entry, str]] = field(default_factory=list)
    #: Bucket directories that had been deleted (created again by this worker or another one).
    recreated: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @staticmethod
    def describe(entries: Iterable[Entry]) -> str:
        return ", ".join(entry.what for entry in entries)


class Buckets:
    """The bucket directories our entries live in, each held open: a directory deleted under us has no links left
    (``st_nlink`` 0) even after someone created another one under its name — which is how a worker learns that the
    tree was deleted although another worker was quicker to create it again. Called from worker threads."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def hold(self, buckets: Iterable[Path]) -> None:
        with self._lock:
            self._hold(buckets)

    def _hold(self, buckets: Iterable[Path]) -> None:
        for bucket in buckets:
            if bucket not in self._fds:
                with contextlib.suppress(OSError):
                    self._fds[bucket] = os.open(bucket, os.O_RDONLY | os.O_DIRECTORY)

    def ensure(self, root: Path, buckets: Iterable[Path]) -> tuple[list[str], dict[Path, str]]:
        """Create the ``buckets`` that are gone (the runtime never does): the ones deleted since we first held them
        (names relative to ``root``), and the ones that cannot be created, with why."""
        with self._lock:
            return self._ensure(root, buckets)

    def _ensure(self, root: Path, buckets: Iterable[Path]) -> tuple[list[str], dict[Path, str]]:
        deleted: list[str] = []
        failed: dict[Path, str] = {}
        for bucket in sorted(set(buckets)):
            fd = self._fds.get(bucket)
            gone = fd is not None and os.fstat(fd).st_nlink == 0
            if gone:
                os.close(self._fds.pop(bucket))
            if not bucket.is_dir():
                try:
                    bucket.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    failed[bucket] = f"cannot create {bucket.relative_to(root)}: {exc.strerror or exc}"
                    continue
                gone = True
            if gone:
                deleted.append(str(bucket.relative_to(root)))
            self._hold([bucket])
        return deleted, failed

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def dynamo_key(text: str) -> str:
    """Dynamo's file-store key encoding: every byte but ASCII letters and digits as ``%XX`` (``-`` is ``%2D``,
    ``_`` is ``%5F``; ``urllib.parse.quote`` would leave those two alone and miss the file)."""
    return "".join(chr(b) if chr(b).isascii() and chr(b).isalnum() else f"%{b:02X}" for b in text.encode())


def instance_key(root: Path, namespace: str, component: str, endpoint: str, instance_id: int) -> Path:
    return root / "v1" / "instances" / dynamo_key(f"{namespace}/{component}/{endpoint}/{instance_id:x}")


def fresh(path: Path) -> bool:
    """Is ``path`` a file younger than the TTL (an older one is about to be deleted as expired)?"""
    try:
        status = path.stat()
    except OSError:  # gone, or not readable any more: either way not there for a frontend
        return False
    return stat.S_ISREG(status.st_mode) and time.time() - status.st_mtime < FILE_TTL


def read_bucket(bucket: Path) -> dict[Path, tuple[bytes, dict[str, Any]]]:
    """Every readable JSON object in one bucket directory (nothing when the directory is missing)."""
    found: dict[Path, tuple[bytes, dict[str, Any]]] = {}
    try:
        paths = list(bucket.iterdir())
    except OSError:
        return found
    for path in paths:
        if path.name.startswith(_TEMP_PREFIX):
            continue
        try:
            data = path.read_bytes()
            value = json.loads(data)
        except (OSError, ValueError):
            continue
        if isinstance(value, dict):
            found[path] = (data, value)
    return found


def write_back(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, as the runtime does (a temporary file its watchers ignore, renamed)."""
    temp = path.with_name(f"{_TEMP_PREFIX}{secrets.token_hex(8)}")
    try:
        temp.write_bytes(data)
        os.replace(temp, path)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {path.parent.name}/{path.name}: {exc.strerror}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()


def zmq_port(channel: dict[str, Any]) -> int | None:
    """The TCP port of an event channel's ZMQ transport (``{"kind": "Zmq", "config": {"endpoint": …}}``)."""
    transport = channel.get("transport")
    if not isinstance(transport, dict) or transport.get("kind") != "Zmq":
        return None
    config = transport.get("config")
    endpoint = config.get("endpoint") if isinstance(config, dict) else None
    if not isinstance(endpoint, str):
        return None
    try:
        return urlsplit(endpoint).port
    except ValueError:
        return None


def listening_ports() -> set[int] | None:
    """The TCP ports this process listens on (Linux ``/proc``); ``None`` where that cannot be read.

    An event channel carries no id of ours, only its ZMQ publisher's port; two processes cannot both listen on one
    port, so the port tells whose channel it is.
    """
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    sockets: set[str] = set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed while listed
            continue
        if link.startswith("socket:["):
            sockets.add(link[8:-1])
    ports: set[int] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local address "HEX_IP:HEX_PORT", state 0A = LISTEN, inode
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in sockets:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
