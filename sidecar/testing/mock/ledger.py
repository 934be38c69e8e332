"""Where each request came from, and what it asked for, as the engine saw it (``ServerInfo.extra.mock_stats``).

With ``--frontends N`` (``frontends.py``) an RPC reaches the engine either on the launcher's own listener or forwarded
by an attached frontend, which names itself, its process and the client connection in private metadata.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from grpclib.server import Stream
    from multidict import MultiDict

    from .validate import RequestPlan

__all__ = [
    "DROP_KEY",
    "FRONTEND_KEY",
    "PEER_KEY",
    "PID_KEY",
    "Origin",
    "RequestLedger",
    "peer_of",
    "private_origin",
    "public_origin",
]

#: Private metadata an attached frontend adds to what it forwards: its index, its process id, the client connection.
FRONTEND_KEY: Final = "x-openengine-mock-frontend"
PID_KEY: Final = "x-openengine-mock-frontend-pid"
PEER_KEY: Final = "x-openengine-mock-peer"
#: Private trailing metadata: the request's fault dropped the connection; the frontend closes the client's.
DROP_KEY: Final = "x-openengine-mock-drop-connection"
#: Requests whose frontend ``mock_stats.served_by`` (and ``aborted_from``) remembers (the latest).
_SERVED_BY_KEPT: Final = 512
#: Distinct ``extra.conversation_id`` values counted (``mock_stats.conversation_ids``).
_CONVERSATIONS_KEPT: Final = 512


@dataclasses.dataclass(frozen=True, slots=True)
class Origin:
    """Where one RPC came in: the frontend (0 = the launcher), its process id, the client connection (host:port)."""

    frontend: int
    pid: int
    peer: str


def peer_of(stream: Stream[Any, Any]) -> str:
    """The client connection under a server ``stream``, as ``host:port`` (``unix`` on a Unix socket)."""
    address = stream.peer.addr()
    if not address:
        return "unix"
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def public_origin(stream: Stream[Any, Any]) -> Origin:
    """An RPC the launcher's own public listener took."""
    return Origin(0, os.getpid(), peer_of(stream))


def private_origin(metadata: MultiDict[str | bytes] | None) -> Origin:
    """An RPC an attached frontend forwarded (its private metadata); frontend -1 when it carries none."""

    def value(key: str) -> str:
        raw = metadata.get(key) if metadata is not None else None
        return raw.decode() if isinstance(raw, bytes) else (raw or "")

    index, pid = value(FRONTEND_KEY), value(PID_KEY)
    return Origin(int(index) if index.isdecimal() else -1, int(pid) if pid.isdecimal() else 0, value(PEER_KEY))


class RequestLedger:
    """What the engine received, and from where (``mock_stats``): per frontend and client connection, the
    ``Generate`` streams and control calls; which frontend served the latest requests; the DP ranks targeted; the
    conversation ids; the longest request id."""

    def __init__(self) -> None:
        self._pids: dict[int, int] = {0: os.getpid()}
        self._streams: collections.Counter[tuple[int, str]] = collections.Counter()
        self._controls: collections.Counter[tuple[int, str]] = collections.Counter()
        self._served_by: collections.OrderedDict[str, Origin] = collections.OrderedDict()
        self._aborts: collections.OrderedDict[str, Origin] = collections.OrderedDict()
        self._ranks: collections.Counter[int] = collections.Counter()
        self._conversations: collections.Counter[str] = collections.Counter()
        self._longest_id = 0

    def note_pid(self, frontend: int, pid: int) -> None:
        """The process id of an attached frontend."""
        self._pids[frontend] = pid

    def note_generate(self, plan: RequestPlan, origin: Origin) -> None:
        """An accepted ``Generate``."""
        self._pids.setdefault(origin.frontend, origin.pid)
        self._streams[origin.frontend, origin.peer] += 1
        _remember(self._served_by, plan.request_id, origin)
        if plan.target_dp_rank is not None:
            self._ranks[plan.target_dp_rank] += 1
        conversation = plan.conversation_id
        known = self._conversations
        if conversation is not None and (conversation in known or len(known) < _CONVERSATIONS_KEPT):
            known[conversation] += 1
        self._longest_id = max(self._longest_id, len(plan.request_id.encode()))

    def note_abort(self, request_id: str, origin: Origin) -> None:
        """An ``Abort{request_id}``: which frontend it came in on."""
        _remember(self._aborts, request_id, origin)

    def note_control(self, origin: Origin) -> None:
        """A control RPC (any but ``Generate``); an attached frontend's own start-up check (no client) is not one."""
        if not origin.peer:
            return
        self._pids.setdefault(origin.frontend, origin.pid)
        self._controls[origin.frontend, origin.peer] += 1

    def stats(self) -> dict[str, object]:
        """The ``mock_stats`` entries: ``frontends``, ``served_by``, ``aborted_from``, ``target_dp_ranks``,
        ``conversation_ids``, ``max_request_id_bytes``."""
        frontends: dict[str, dict[str, object]] = {}
        for index in sorted({*self._pids, *(k for k, _ in self._streams), *(k for k, _ in self._controls)}):
            connections: dict[str, dict[str, int]] = {}
            for (frontend, peer), count in self._streams.items():
                if frontend == index:
                    connections.setdefault(peer, {"generate": 0, "control": 0})["generate"] = count
            for (frontend, peer), count in self._controls.items():
                if frontend == index:
                    connections.setdefault(peer, {"generate": 0, "control": 0})["control"] = count
            frontends[str(index)] = {
                "pid": self._pids.get(index, 0),
                "generate_streams": sum(c["generate"] for c in connections.values()),
                "connections": connections,
            }
        return {
            "frontends": frontends,
            "served_by": {rid: {"frontend": o.frontend, "peer": o.peer} for rid, o in self._served_by.items()},
            "aborted_from": {rid: {"frontend": o.frontend, "peer": o.peer} for rid, o in self._aborts.items()},
            "target_dp_ranks": {str(rank): count for rank, count in sorted(self._ranks.items())},
            "conversation_ids": dict(self._conversations),
            "max_request_id_bytes": self._longest_id,
        }


def _remember(kept: collections.OrderedDict[str, Origin], request_id: str, origin: Origin) -> None:
    kept[request_id] = origin
    kept.move_to_end(request_id)
    while len(kept) > _SERVED_BY_KEPT:
        kept.popitem(last=False)
