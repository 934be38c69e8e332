"""Disaggregated KV sessions between two mock processes, over the mock's own loopback transfer channel.

Theory of operation
-------------------
A context-only (prefill) leg ends with ``PrefillReady``; its KV blocks then stay pinned on the prefill engine, held by
a :class:`HeldSession` in the :class:`KvSessionStore`, until one of:

* a decode engine **claims** them over the transfer channel (the session's ``ctx_info_endpoint``): the "transfer"
  takes ``--kv-transfer-ms`` (model time, divided by ``--speedup``), then the blocks are released;
* ``--kv-session-timeout`` seconds pass without a claim (a stranded session: logged and counted as expired);
* the ``PrefillReady`` could not be sent at all (the prefill stream broke): released at once.

A decode leg (a request with ``kv.session``) claims its session before it generates. The claim fails, and the decode
ends with a terminal ``EngineError``, when the session is unknown, expired or already claimed
(``KV_SESSION_NOT_FOUND``), or when the transfer cannot happen: the context engine is unreachable or the decode
request's prompt is not the prefilled one (``KV_TRANSFER_FAILED``). A decode leg aborted or cancelled mid-transfer
drops its connection; the session is then held again (and may still expire) -- which is why the sidecar defers a
client's stop of a decode leg until its first token.

The channel: the prefill engine listens on a loopback TCP port of its own (reported in ``ServerInfo.kv_connector``'s
``local_endpoints`` and in each session). One connection per claim; one JSON line each way::

    → {"op": "claim", "session_id": "7", "request_id": "...", "prompt_digest": "<hex>"}
    ← {"ok": true, "blocks": 3}
    ← {"ok": false, "code": "KV_SESSION_NOT_FOUND", "message": "..."}

Both sides count what they hold: held sessions on the prefill engine, claims in flight on the decode engine
(``GetLoad.active_kv_sessions``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from openengine.v1 import error_pb2

if TYPE_CHECKING:
    from .kvcache import Allocation

__all__ = ["KvClaimError", "KvSessionStore", "claim_session", "prompt_digest"]

log = logging.getLogger("openengine_mock")

#: Bound on one claim, connection included.
CLAIM_TIMEOUT_S: Final = 30.0
#: How many claimed/expired session ids are remembered, to tell "already claimed" and "expired" from "unknown".
_HISTORY: Final = 4096
_MAX_LINE: Final = 64 * 1024


class KvClaimError(Exception):
    """A claim failed; ``code`` is the ``ErrorCode`` the decode leg ends with."""

    def __init__(self, code: error_pb2.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def prompt_digest(prompt_ids: Sequence[int], namespace: bytes = b"") -> str:
    """A digest of the prompt (and its LoRA/cache-salt namespace) that both legs compute independently."""
    h = hashlib.blake2b(digest_size=16)
    h.update(len(namespace).to_bytes(4, "little"))
    h.update(namespace)
    h.update(struct.pack(f"<{len(prompt_ids)}I", *prompt_ids))
    return h.hexdigest()


@dataclass(eq=False)
class HeldSession:
    """A prefill leg's KV blocks, waiting for a decode engine."""

    session_id: str
    request_id: str
    digest: str
    alloc: Allocation
    expiry: asyncio.TimerHandle | None = None
    claiming: bool = False
    expired_while_claiming: bool = False


@dataclass
class KvSessionStore:
    """The prefill side: held sessions, their timeouts and the claim listener; also counts claims in flight."""

    timeout_s: float
    transfer_s: float
    #: Called after blocks were released (the engine re-runs admission: queued requests may fit now).
    on_release: Callable[[], None] = lambda: None
    sessions: dict[str, HeldSession] = field(default_factory=dict)
    stats: collections.Counter[str] = field(default_factory=collections.Counter)
    #: Decode legs of this engine currently pulling a session from a context engine.
    claims_in_flight: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    _claimed: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)
    _expired: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)
    _server: asyncio.Server | None = None

    @property
    def active(self) -> int:
        """``GetLoad.active_kv_sessions``: sessions held here plus sessions being pulled by this engine."""
        return len(self.sessions) + self.claims_in_flight

    # -- listener ----------------------------------------------------------------------------------------------------

    async def start(self, host: str) -> int:
        """Listen for claims on ``host`` (an OS-picked port); returns the port."""
        self._server = await asyncio.start_server(self._serve, host, 0, limit=_MAX_LINE)
        self.host = host
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        """Stop listening and release every held session."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for session_id in list(self.sessions):
            self.release(session_id, "engine shutting down")

    # -- the prefill side ----------------------------------------------------------------------------------------------

    def hold(self, session_id: str, request_id: str, digest: str, alloc: Allocation) -> None:
        """Keep ``alloc`` pinned for ``session_id`` until it is claimed, released or expires."""
        held = HeldSession(session_id, request_id, digest, alloc)
        if self.timeout_s > 0:
            held.expiry = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, session_id)
        self.sessions[session_id] = held
        self.stats["kv_sessions_created"] += 1

    def release(self, session_id: str, why: str) -> None:
        """Free a held session's blocks (no claim will come)."""
        held = self.sessions.pop(session_id, None)
        if held is None:
            return
        self._free(held)
        self.stats["kv_sessions_released"] += 1
        log.info("KV session %s (request %r) released: %s", session_id, held.request_id, why)

    def _free(self, held: HeldSession) -> None:
        if held.expiry is not None:
            held.expiry.cancel()
        held.alloc.release()
        self.on_release()

    def _remember(self, history: collections.OrderedDict[str, None], session_id: str) -> None:
        history[session_id] = None
        while len(history) > _HISTORY:
            history.popitem(last=False)

    def _expire(self, session_id: str) -> None:
        held = self.sessions.get(session_id)
        if held is None:
            return
        if held.claiming:  # a transfer is running: let it finish (or fail, then expire)
            held.expired_while_claiming = True
            return
        del self.sessions[session_id]
        self._free(held)
        self._remember(self._expired, session_id)
        self.stats["kv_sessions_expired"] += 1
        log.warning(
            "KV session %s (request %r) expired after %gs without a decode claim: its blocks were stranded until now",
            session_id,
            held.request_id,
            self.timeout_s,
        )

    def _refusal(self, session_id: str) -> tuple[str, str]:
        if session_id in self._claimed:
            return "KV_SESSION_NOT_FOUND", f"KV session {session_id} was already claimed by another decode request"
        if session_id in self._expired:
            return "KV_SESSION_NOT_FOUND", f"KV session {session_id} expired after {self.timeout_s:g}s without a claim"
        return "KV_SESSION_NOT_FOUND", f"KV session {session_id} is unknown to this context engine"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                line = await asyncio.wait_for(reader.readline(), CLAIM_TIMEOUT_S)
                message = json.loads(line)
                session_id = str(message["session_id"])
                digest = str(message["prompt_digest"])
            except (ValueError, KeyError, TypeError, TimeoutError, asyncio.LimitOverrunError) as exc:
                await _reply(writer, {"ok": False, "code": "KV_TRANSFER_FAILED", "message": f"bad claim: {exc!r}"})
                return
            await self._claim(session_id, digest, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _claim(
        self, session_id: str, digest: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        held = self.sessions.get(session_id)
        if held is None:
            code, text = self._refusal(session_id)
            await _reply(writer, {"ok": False, "code": code, "message": text})
            return
        if held.claiming:
            text = f"KV session {session_id} is being claimed by another decode request"
            await _reply(writer, {"ok": False, "code": "KV_SESSION_NOT_FOUND", "message": text})
            return
        if held.digest != digest:
            message = f"KV session {session_id} holds another prompt than the decode request's (send the full prompt)"
            await _reply(writer, {"ok": False, "code": "KV_TRANSFER_FAILED", "message": message})
            return
        held.claiming = True
        try:
            # The "transfer". A decode side that goes away meanwhile (abort, cancellation) closes the connection:
            # reading EOF ends the wait early and the session stays held.
            if self.transfer_s > 0:
                try:
                    gone = await asyncio.wait_for(reader.read(1), self.transfer_s)
                except TimeoutError:
                    gone = None
                if gone == b"":
                    log.info("KV session %s: the decode side left mid-transfer; the session stays held", session_id)
                    return
            else:
                await asyncio.sleep(0)
            del self.sessions[session_id]
            self._free(held)
            self._remember(self._claimed, session_id)
            self.stats["kv_sessions_claimed"] += 1
            blocks = len(held.alloc.blocks)
            await _reply(writer, {"ok": True, "blocks": blocks})
        finally:
            held.claiming = False
            if held.expired_while_claiming and session_id in self.sessions:
                self._expire(session_id)


async def _reply(writer: asyncio.StreamWriter, message: Mapping[str, object]) -> None:
    writer.write(json.dumps(message).encode() + b"\n")
    await writer.drain()


async def claim_session(host: str, port: int, session_id: str, request_id: str, digest: str) -> int:
    """The decode side: claim ``session_id`` from the context engine at ``host:port``; returns the blocks received.

    Raises :class:`KvClaimError` (``KV_SESSION_NOT_FOUND`` / ``KV_TRANSFER_FAILED``); cancellation closes the
    connection, which hands the session back to the context engine.
    """
    where = f"{host}:{port}"
    try:
        async with asyncio.timeout(CLAIM_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(host, port, limit=_MAX_LINE)
            try:
                claim = {"op": "claim", "session_id": session_id, "request_id": request_id, "prompt_digest": digest}
                await _reply(writer, claim)
                line = await reader.readline()
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
    except TimeoutError:
        raise KvClaimError(
            error_pb2.ERROR_CODE_KV_TRANSFER_FAILED, f"KV transfer from {where} timed out after {CLAIM_TIMEOUT_S:g}s"
        ) from None
    except OSError as exc:
        raise KvClaimError(
            error_pb2.ERROR_CODE_KV_TRANSFER_FAILED, f"cannot reach the context engine's KV endpoint {where}: {exc}"
        ) from None
    try:
        answer = json.loads(line)
    except ValueError:
        raise KvClaimError(
            error_pb2.ERROR_CODE_KV_TRANSFER_FAILED, f"the context engine at {where} closed the KV transfer"
        ) from None
    if answer.get("ok") is True:
        return int(answer.get("blocks", 0))
    code = error_pb2.ErrorCode.Value(f"ERROR_CODE_{answer.get('code', 'KV_TRANSFER_FAILED')}")
    raise KvClaimError(code, str(answer.get("message", "KV transfer refused")))
