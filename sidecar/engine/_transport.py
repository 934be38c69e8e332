"""The connection under each pooled channel: graceful GOAWAY, TLS files re-read on (re)connect, failures explained.

grpclib 0.4.9 gets three things wrong for an engine we must not lose requests to; this module subclasses its
``Channel``, ``H2Protocol`` and ``EventsProcessor`` (``tests/engine/test_transport.py`` fails if the grpclib or h2
internals used here change, and checks that stock grpclib still needs every part of it):

* **GOAWAY.** TensorRT-LLM stops with grpc-core's ``server.stop(grace=5)``: a GOAWAY with last-stream-id 2^31-1, then
  the real one, while open streams run until the grace ends (``tensorrt-llm-openengine.md`` §3). Stock grpclib closes
  the whole connection on the first GOAWAY (``EventsProcessor.process_connection_terminated``), and h2 moves the
  connection to ``CLOSED`` on it, after which h2 refuses every frame of the streams still open. Here a GOAWAY only
  (a) takes the connection out of its channel, so the next call connects anew, (b) refuses new streams on it
  (:class:`GoawayRefused`, raised before anything is sent, so the caller may retry on a fresh connection),
  (c) fails the streams above the GOAWAY's last-stream-id (never processed by the engine), and (d) keeps delivering
  the others until they end (the drained connection is then closed) or the engine closes the connection; streams cut
  then fail with a reason that says so. The pool's listener hears of each draining connection and of its end.
* **TLS files** are read on every connection attempt that finds one of them changed (device, inode, size, mtime), so
  a rotated client certificate or CA (cert-manager, Vault agent, a Kubernetes secret) is used without a restart.
* **Why.** A TLS handshake refusal, an engine that closed a TLS connection before HTTP/2 began (the usual sign of a
  rejected client certificate: the alert itself rarely reaches the client before the reset), a plaintext client
  talking to a TLS engine and a bad Unix socket path become one sentence naming the flag or file to check, logged
  once as a WARNING (then at most every 30 s) and carried by the RPC's ``UNAVAILABLE`` error.

Everything here runs on the edge loop's thread.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import ssl
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from grpclib.client import Channel, Handler
from grpclib.protocol import EventsProcessor, H2Protocol
from h2.errors import ErrorCodes
from h2.events import ConnectionTerminated, DataReceived
from h2.exceptions import ProtocolError
from hyperframe.frame import GoAwayFrame

if TYPE_CHECKING:
    from collections.abc import Callable

    from grpclib.config import Configuration
    from grpclib.encoding.base import CodecBase

    from ._endpoint import Endpoint

__all__ = [
    "DirectSink",
    "GoawayRefused",
    "PoolListener",
    "PooledChannel",
    "TlsFiles",
    "TlsFilesError",
    "TlsSource",
    "TransportError",
    "build_tls_context",
    "tls_files_from_flags",
    "unix_path_problem",
]

log = logging.getLogger("sidecar.engine")

#: A transport problem (same text) is logged as a WARNING at most this often.
_WARN_EVERY_S: Final = 30.0
_warned_at: dict[str, float] = {}  # edge loop only
# An HTTP/2 frame header: 24-bit length (16 + 8 bits here), type, flags, stream id (RFC 9113 §4.1).
_FRAME_HEADER: Final = struct.Struct(">HBBBL")
_DATA_FRAME: Final = 0
# The first two bytes of a TLS record carrying an alert (0x15) or a handshake (0x16), TLS 1.x. An HTTP/2 server's
# first frame is SETTINGS, whose 3-byte length starts with 0x00, so the two never look alike.
_TLS_RECORD_STARTS: Final = (b"\x15\x03", b"\x16\x03")


class TransportError(ConnectionError):
    """No connection could be made, or it was refused, for the reason in the message (meant for the operator)."""


class GoawayRefused(TransportError):
    """A stream was about to open on a connection the engine is closing (GOAWAY); nothing was sent, so retrying the
    call on a fresh connection is safe."""


class TlsFilesError(ValueError):
    """A TLS file the operator gave is unusable; the message names its flag and the file."""


class PoolListener(Protocol):
    """Told (on the edge loop) when a connection starts draining after a GOAWAY, and when such a connection closed."""

    def going_away(self, reason: str) -> None: ...

    def drained(self) -> None: ...


def _warn(reason: str) -> None:
    now = time.monotonic()
    if now - _warned_at.get(reason, -math.inf) >= _WARN_EVERY_S:
        _warned_at[reason] = now
        log.warning("OpenEngine connection: %s (repeated at most every %gs)", reason, _WARN_EVERY_S)


# ---------------------------------------------------------------------------------------------- TLS files


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The operator's TLS files: the CA that signed the engine's certificate and, for mutual TLS, a client pair.

    The paths are kept as given (symlinks unresolved): Kubernetes rotates a mounted secret by re-pointing a symlink.
    """

    ca: Path
    cert: Path | None = None
    key: Path | None = None
    key_password_file: Path | None = None

    def paths(self) -> tuple[Path, ...]:
        """Every file of the set."""
        return tuple(p for p in (self.ca, self.cert, self.key, self.key_password_file) if p is not None)


class _NoPassphrase(Exception):
    pass


def _read_text(path: Path, flag: str) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError as exc:
        raise TlsFilesError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None


def build_tls_context(files: TlsFiles) -> ssl.SSLContext:
    """A client context verifying the engine with ``files.ca``; with a client pair, mutual TLS.

    Raises :class:`TlsFilesError` naming the flag (``--grpc-tls-ca``, ``--grpc-tls-cert``, ``--grpc-tls-key``,
    ``--grpc-tls-key-password-file``) for a missing, unreadable or unusable file. Never prompts: an encrypted key
    without ``key_password_file`` is refused (OpenSSL would otherwise ask for a passphrase on the terminal).
    """
    ca_text = _read_text(files.ca, "--grpc-tls-ca")
    if "-----BEGIN CERTIFICATE-----" not in ca_text:
        raise TlsFilesError(f"--grpc-tls-ca: no PEM certificate in {files.ca}")
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(files.ca))
    except ssl.SSLError as exc:
        raise TlsFilesError(f"--grpc-tls-ca: no usable CA certificate in {files.ca} ({_ssl_reason(exc)})") from None
    except OSError as exc:
        raise TlsFilesError(f"--grpc-tls-ca: cannot read {files.ca}: {exc.strerror or exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # gRPC is HTTP/2 only: without ALPN h2 a conforming server refuses the connection.
    context.set_alpn_protocols(["h2"])
    if files.cert is not None and files.key is not None:
        _load_client_pair(context, files, files.cert, files.key)
    return context


def _load_client_pair(context: ssl.SSLContext, files: TlsFiles, cert: Path, key: Path) -> None:
    if "-----BEGIN CERTIFICATE-----" not in _read_text(cert, "--grpc-tls-cert"):
        raise TlsFilesError(f"--grpc-tls-cert: no PEM certificate in {cert}")
    if "PRIVATE KEY-----" not in _read_text(key, "--grpc-tls-key"):
        raise TlsFilesError(f"--grpc-tls-key: no PEM private key in {key}")
    asked = False

    def passphrase() -> bytes:
        # Called by OpenSSL only for an encrypted key.
        nonlocal asked
        asked = True
        if files.key_password_file is None:
            raise _NoPassphrase
        text = _read_text(files.key_password_file, "--grpc-tls-key-password-file")
        # One trailing newline is what `echo` and editors add; it is not part of the passphrase.
        text = text[:-1] if text.endswith("\n") else text
        text = text[:-1] if text.endswith("\r") else text
        if not text:
            raise TlsFilesError(f"--grpc-tls-key-password-file: {files.key_password_file} is empty")
        return text.encode()

    try:
        context.load_cert_chain(str(cert), str(key), password=passphrase)
    except _NoPassphrase:
        raise TlsFilesError(
            f"--grpc-tls-key: {key} is encrypted; give its passphrase in a file with --grpc-tls-key-password-file"
        ) from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TlsFilesError(
                f"--grpc-tls-key: the key in {key} does not belong to the certificate in {cert} (--grpc-tls-cert)"
            ) from None
        if asked:
            raise TlsFilesError(
                f"--grpc-tls-key-password-file: the passphrase in {files.key_password_file} does not decrypt {key}"
            ) from None
        raise TlsFilesError(
            f"--grpc-tls-cert/--grpc-tls-key: {cert} and {key} are not a usable certificate and key"
            f" ({_ssl_reason(exc)})"
        ) from None
    except OSError as exc:
        raise TlsFilesError(f"--grpc-tls-cert/--grpc-tls-key: cannot read {cert} or {key}: {exc}") from None


def tls_files_from_flags(
    ca: str | None, cert: str | None, key: str | None, key_password_file: str | None = None
) -> TlsFiles | None:
    """Check the ``--grpc-tls-*`` flags and the files they name; ``None`` without ``--grpc-tls-ca`` (plaintext).

    Raises :class:`TlsFilesError` (one line naming the flag) for a missing partner flag, a missing file or one
    :func:`build_tls_context` cannot use. The paths are made absolute but not resolved (see :class:`TlsFiles`).
    """
    if (cert is None) != (key is None):
        raise TlsFilesError("--grpc-tls-cert and --grpc-tls-key go together (mutual TLS)")
    if cert is not None and ca is None:
        raise TlsFilesError("--grpc-tls-cert needs --grpc-tls-ca: mutual TLS verifies the engine too")
    if key_password_file is not None and key is None:
        raise TlsFilesError("--grpc-tls-key-password-file needs --grpc-tls-key (the encrypted key it unlocks)")
    if ca is None:
        return None
    paths: dict[str, Path] = {}
    for flag, raw in (
        ("--grpc-tls-ca", ca),
        ("--grpc-tls-cert", cert),
        ("--grpc-tls-key", key),
        ("--grpc-tls-key-password-file", key_password_file),
    ):
        if raw is None:
            continue
        path = Path(raw).absolute()
        if not path.is_file():
            raise TlsFilesError(f"{flag}: no such file: {raw}")
        paths[flag] = path
    files = TlsFiles(
        paths["--grpc-tls-ca"],
        paths.get("--grpc-tls-cert"),
        paths.get("--grpc-tls-key"),
        paths.get("--grpc-tls-key-password-file"),
    )
    build_tls_context(files)
    return files


def _ssl_reason(exc: ssl.SSLError) -> str:
    return str(exc.reason or exc.strerror or exc).replace("_", " ").lower()


class TlsSource:
    """The client TLS context of a pool, rebuilt when a file changed since the last connection attempt."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._context: ssl.SSLContext | None = None
        self._seen: tuple[tuple[int, int, int, int] | None, ...] = ()

    def _signature(self) -> tuple[tuple[int, int, int, int] | None, ...]:
        signature: list[tuple[int, int, int, int] | None] = []
        for path in self.files.paths():
            try:
                st = os.stat(path)  # follows symlinks: a re-pointed secret mount reads as a change
            except OSError:
                signature.append(None)
            else:
                signature.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(signature)

    def context(self) -> ssl.SSLContext:
        """The current context; re-reads the files first if any of them changed. Raises :class:`TlsFilesError`."""
        signature = self._signature()
        if self._context is None or signature != self._seen:
            context = build_tls_context(self.files)
            if self._context is not None:
                log.info("TLS files changed on disk; new OpenEngine connections use them")
            self._context, self._seen = context, signature
        return self._context


# ---------------------------------------------------------------------------------------------- explanations


def _explain_handshake(exc: BaseException, endpoint: Endpoint, files: TlsFiles) -> str:
    """Why the TLS handshake with the engine failed, naming what to check."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = str(exc.verify_message or exc.reason or exc).rstrip(".")
        lowered = why.lower()
        if "hostname mismatch" in lowered or "ip address mismatch" in lowered:
            hint = f"the engine's certificate does not name {endpoint.host} (the host in --grpc-endpoint)"
        elif "expired" in lowered:
            hint = "the engine's certificate has expired"
        elif "not yet valid" in lowered:
            hint = "the engine's certificate is not valid yet (check both clocks)"
        elif "issuer" in lowered or "self-signed" in lowered or "self signed" in lowered:
            hint = f"the engine's certificate is not signed by the CA in --grpc-tls-ca ({files.ca})"
        else:
            hint = f"the engine's certificate was refused; check it against --grpc-tls-ca ({files.ca})"
        return f"TLS: {hint} [{why}]"
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or ""
        if "ALERT" in reason:
            return _explain_alert(reason, files)
        if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"):
            return (
                f"TLS: the engine at {endpoint} does not answer in TLS ({_ssl_reason(exc)}); if it serves plaintext"
                " h2c, drop --grpc-tls-ca and use http://host:port"
            )
        return f"TLS handshake with {endpoint} failed: {_ssl_reason(exc)}; check --grpc-tls-ca ({files.ca})"
    return (
        f"TLS: the engine at {endpoint} dropped the connection during the handshake ({type(exc).__name__}); if it"
        " serves plaintext h2c, drop --grpc-tls-ca and use http://host:port"
    )


def _explain_alert(reason: str, files: TlsFiles) -> str:
    alert = reason.split("ALERT_", 1)[1].replace("_", " ").lower()
    if files.cert is None:
        return (
            f"TLS: the engine refused the connection with alert '{alert}': it requires a client certificate; pass"
            " --grpc-tls-cert and --grpc-tls-key"
        )
    return (
        f"TLS: the engine refused our client certificate with alert '{alert}': check --grpc-tls-cert ({files.cert}):"
        " is it signed by a CA the engine trusts, and still valid?"
    )


def _explain_early_close(files: TlsFiles | None) -> str:
    """The engine closed the connection before its first HTTP/2 frame."""
    if files is None:
        return (
            "the engine closed the connection before HTTP/2 began; if it serves TLS, pass --grpc-tls-ca and use an"
            " https:// endpoint"
        )
    if files.cert is None:
        return (
            "TLS: the engine closed the connection right after the handshake, before HTTP/2 began: it most likely"
            " requires a client certificate (mutual TLS); pass --grpc-tls-cert and --grpc-tls-key"
        )
    return (
        "TLS: the engine closed the connection right after the handshake, before HTTP/2 began: it most likely"
        f" rejected our client certificate; check --grpc-tls-cert ({files.cert}): is it signed by a CA the engine"
        " trusts, and still valid?"
    )


def unix_path_problem(path: str) -> str | None:
    """What is wrong with ``path`` as the engine's Unix socket, or ``None``. A socket that does not exist yet is not a
    problem (the engine may start later); a missing directory, another kind of file or a socket this process may not
    write to are."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        return None if os.path.isdir(parent) else f"{path}: its directory {parent} does not exist"
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    if not stat.S_ISSOCK(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "not a socket"
        return f"{path} is {kind}, not a Unix socket"
    if not os.access(path, os.W_OK):
        return f"{path}: permission denied (connecting needs write permission on the socket; uid {os.getuid()})"
    return None


def _explain_unix(exc: OSError, path: str) -> str:
    """Why connecting to the Unix socket ``path`` failed."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            return f"no Unix socket at {path}: its directory {parent} does not exist"
        return f"no Unix socket at {path} (is the engine up and listening there?)"
    except OSError as stat_exc:
        return f"cannot reach the Unix socket {path}: {stat_exc.strerror or stat_exc}"
    if not stat.S_ISSOCK(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "not a socket"
        return f"{path} is {kind}, not a Unix socket; check --grpc-endpoint"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"permission denied on the Unix socket {path}: this process (uid {os.getuid()}) needs write permission on"
            " it and search permission on its directories"
        )
    if exc.errno == errno.ECONNREFUSED:
        return f"nothing listens on the Unix socket {path} (a stale socket file of a stopped engine?)"
    return f"cannot connect to the Unix socket {path}: {exc.strerror or exc}"


# ---------------------------------------------------------------------------------------------- connection


class DirectSink:
    """A stream whose HTTP/2 events the processor hands over as they are, instead of to a grpclib ``Stream``.

    Registered in ``processor.streams`` under its stream id like grpclib's streams (so that GOAWAY, a lost
    connection, the stream-limit log and ``release`` treat both alike); ``_direct.DirectStream`` is the one kind.
    ``window_updated`` is what grpclib sets on every stream when the peer grants send window.
    """

    __slots__ = ()

    window_updated: Any

    def on_headers(self, headers: list[tuple[str, str]]) -> None:
        raise NotImplementedError

    def on_data(self, data: bytes, flow_controlled_length: int) -> None:
        raise NotImplementedError

    def on_trailers(self, headers: list[tuple[str, str]]) -> None:
        raise NotImplementedError

    def on_end(self) -> None:
        raise NotImplementedError

    def on_reset(self, reason: str) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """After the reads of one loop iteration: hand over what they brought (one post per stream)."""
        raise NotImplementedError

    def after_round(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the loop once trio has taken in what this stream handed over so far."""
        raise NotImplementedError

    def take_data_frame(self, length: int) -> bool:
        """Whether a plain DATA frame (no flags) of ``length`` bytes for this stream may skip h2; if so, its flow
        control is accounted here and now, as h2 would, and its payload goes to :meth:`on_data` next."""
        raise NotImplementedError

    def __terminated__(self, reason: str) -> None:
        raise NotImplementedError


class _ReleaseHook(asyncio.Event):
    """Stands in for a draining connection's ``stream_close_waiter``: grpclib sets it whenever a stream is released,
    which is the moment to see whether the connection has nothing left to deliver."""

    def __init__(self, on_set: Callable[[], None]) -> None:
        super().__init__()
        self._on_set = on_set

    def set(self) -> None:
        super().set()
        self._on_set()


def _refuse_new_stream() -> int:
    raise GoawayRefused("the engine is closing this connection (GOAWAY); no new stream is opened on it")


class GracefulProcessor(EventsProcessor):
    """grpclib's events processor, except that a GOAWAY drains the connection instead of closing it."""

    def __init__(self, handler: Any, connection: Any, protocol: GracefulProtocol) -> None:
        super().__init__(handler, connection)
        self._protocol = protocol
        self.goaway: ConnectionTerminated | None = None
        self.closed_because: str | None = None

    def close(self, reason: str = "Connection closed") -> None:
        # The first reason is why the streams ended; the transport's own "connection lost" that follows must not
        # replace it (grpclib's stream raises the last reason it was given).
        if self.closed_because is None:
            self.closed_because = reason
        super().close(self.closed_because)

    def process_connection_terminated(self, event: ConnectionTerminated) -> None:
        first = self.goaway is None
        self.goaway = event
        last = event.last_stream_id if event.last_stream_id is not None else (1 << 31) - 1
        for stream_id, stream in list(self.streams.items()):
            if stream_id > last:
                # Above the last-stream-id the engine never processed the stream: failing it is safe to retry.
                stream.__terminated__("refused by the engine's GOAWAY before it was processed; retry")
        if first:
            connection = self.connection
            # From now on grpclib's next-stream-id call refuses, before anything goes on the wire.
            connection._connection.get_next_available_stream_id = _refuse_new_stream  # type: ignore[method-assign]
            parked = connection.stream_close_waiter
            connection.stream_close_waiter = _ReleaseHook(self._close_if_idle)
            parked.set()  # streams waiting for a slot under MAX_CONCURRENT_STREAMS wake up and are refused
        self._protocol.on_goaway(event, first)
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self.goaway is not None and not self.streams:
            asyncio.get_running_loop().call_soon(self._close_drained)

    def _close_drained(self) -> None:
        if not self.streams and not self.connection.is_closing():
            self.close("closed after the engine's GOAWAY, every stream ended")

    # Direct streams (``DirectSink``) get their events as they are; grpclib's own streams go the usual way.

    def process_response_received(self, event: Any) -> None:
        stream: Any = self.streams.get(event.stream_id)
        if isinstance(stream, DirectSink):
            stream.on_headers(event.headers)
        else:
            super().process_response_received(event)

    def process_data_received(self, event: DataReceived) -> None:
        stream: Any = self.streams.get(event.stream_id)
        if isinstance(stream, DirectSink):
            stream.on_data(event.data, event.flow_controlled_length)
        else:
            super().process_data_received(event)

    def process_trailers_received(self, event: Any) -> None:
        stream: Any = self.streams.get(event.stream_id)
        if isinstance(stream, DirectSink):
            stream.on_trailers(event.headers)
        else:
            super().process_trailers_received(event)

    def process_stream_ended(self, event: Any) -> None:
        stream: Any = self.streams.get(event.stream_id)
        if isinstance(stream, DirectSink):
            self.connection.streams_succeeded += 1
            stream.on_end()
        else:
            super().process_stream_ended(event)

    def process_stream_reset(self, event: Any) -> None:
        stream: Any = self.streams.get(event.stream_id)
        if isinstance(stream, DirectSink):
            self.connection.streams_failed += 1
            if event.remote_reset:
                stream.on_reset(f"Stream reset by remote party, error_code: {event.error_code}")  # grpclib's words
            else:
                stream.on_reset("Protocol error")
        else:
            super().process_stream_reset(event)


class GracefulProtocol(H2Protocol):
    """grpclib's HTTP/2 protocol with :class:`GracefulProcessor`, h2 kept open after a GOAWAY, and reasons."""

    processor: GracefulProcessor

    def __init__(self, handler: Handler, config: Configuration, h2_config: Any, channel: PooledChannel) -> None:
        super().__init__(handler, config, h2_config)
        self._channel = channel
        self._received = False
        #: Direct streams that got data during the current ``data_received`` (each flushes once at its end).
        self.dirty: list[DirectSink] = []
        self._rx = b""  # the start of a frame whose end has not arrived yet
        self._flush_due = False  # _flush_dirty is scheduled for the end of this loop iteration
        self._awaiting_trio = False  # the last hand-over is not in trio's hands yet (see _flush_dirty)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.processor = GracefulProcessor(self.handler, self.connection, self)
        # h2's own GOAWAY handler moves the whole connection to CLOSED; every later frame of the streams still open
        # would then be a ProtocolError. The dispatch table holds bound methods, hence replaced per connection.
        self.connection._connection._frame_dispatch_table[GoAwayFrame] = self._receive_goaway

    def data_received(self, data: bytes) -> None:
        if not self._received:
            self._received = True
            self._channel.answered = True
            if self._channel.tls is None and data[:2] in _TLS_RECORD_STARTS:
                reason = "the engine answers in TLS; pass --grpc-tls-ca and use an https:// endpoint"
                _warn(reason)
                self.processor.close(reason)
                return
        # grpclib's H2Protocol.data_received, with two changes for direct streams. (1) A plain DATA frame (no
        # END_STREAM, no padding) of a direct stream skips h2 when h2 would only have accounted its flow control and
        # handed its payload on (DirectSink.take_data_frame checks that and does the accounting): h2's per-frame
        # work was the largest cost per engine message left. Every other frame goes to h2 in order, in runs of
        # complete frames (a partial frame waits here, so h2's buffer never holds one). (2) What the reads of one
        # loop iteration brought for a direct stream is handed over once, after them (call_soon runs after every
        # read of the iteration): under load a stream's messages arrive in several reads, and one batch for them
        # means one wakeup of its request task and one chunk for Dynamo instead of one per read.
        if self._rx:
            data = self._rx + data
            self._rx = b""
        streams: dict[int, Any] = self.processor.streams  # grpclib's streams and DirectSinks
        size = len(data)
        position = slow = 0
        max_frame = self.connection._connection.max_inbound_frame_size
        try:
            while size - position >= 9:
                high, low, kind, flags, stream_id = _FRAME_HEADER.unpack_from(data, position)
                length = high << 8 | low
                if length > max_frame:
                    break  # h2 refuses it (FRAME_SIZE_ERROR): hand it over at once rather than buffer it
                end = position + 9 + length
                if end > size:
                    break
                if kind == _DATA_FRAME and flags == 0 and isinstance(streams.get(stream_id), DirectSink):
                    if slow < position:
                        if not self._receive(data[slow:position]):
                            return
                        slow = position
                    stream = streams.get(stream_id)
                    if isinstance(stream, DirectSink) and stream.take_data_frame(length):
                        stream.on_data(data[position + 9 : end], length)
                        slow = end
                position = end
            else:
                length = 0
            if length > max_frame:
                position = size
            if slow < position:
                self._receive(data[slow:position])
            if position < size:
                self._rx = data[position:]
        finally:
            if self.dirty and not self._flush_due and not self._awaiting_trio:
                self._flush_due = True
                asyncio.get_running_loop().call_soon(self._flush_dirty)
            if not self.connection.is_closing():
                self.connection.flush()

    def _flush_dirty(self) -> None:
        self._flush_due = False
        dirty, self.dirty = self.dirty, []
        for sink in dirty:
            sink.flush()
        if not self.connection.is_closing():
            self.connection.flush()  # the WINDOW_UPDATEs of what was acknowledged
        if dirty:
            # The next hand-over waits until trio has taken this one in (its next round). Idle, that is at once;
            # busy, the reads in between add up, per stream, to one bigger batch: one wakeup of the request task and
            # one chunk for Dynamo (whose cost is per chunk) for several engine messages, with no timer.
            self._awaiting_trio = True
            dirty[-1].after_round(self._trio_caught_up)

    def _trio_caught_up(self) -> None:
        self._awaiting_trio = False
        if self.dirty and not self._flush_due:
            self._flush_dirty()

    def _receive(self, frames: bytes) -> bool:
        """Complete frames through h2 and the processor; False once the connection is closed."""
        connection = self.connection
        try:
            events = connection.feed(frames)
        except ProtocolError:
            log.debug("Protocol error", exc_info=True)
            self.processor.close("Protocol error")
            return False
        connection.flush()
        process = self.processor.process
        for event in events:
            process(event)
        return not connection.is_closing()

    @staticmethod
    def _receive_goaway(frame: GoAwayFrame) -> tuple[list[Any], list[Any]]:
        event = ConnectionTerminated()
        try:
            event.error_code = ErrorCodes(frame.error_code)
        except ValueError:
            event.error_code = frame.error_code
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]

    def on_goaway(self, event: ConnectionTerminated, first: bool) -> None:
        self._channel.on_goaway(self, event, first)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.processor.close(reason=self._lost_reason(exc))
        self._channel.on_closed(self)

    def _lost_reason(self, exc: BaseException | None) -> str:
        goaway = self.processor.goaway
        if goaway is not None:
            return (
                f"the engine closed the connection after its GOAWAY ({_code_name(goaway.error_code)}) before this"
                " stream ended (it is stopping); retry elsewhere"
            )
        tls = self._channel.tls
        reason = None
        if isinstance(exc, ssl.SSLError) and tls is not None and "ALERT" in (exc.reason or ""):
            reason = _explain_alert(exc.reason, tls.files)
        elif not self._received and self._channel.answered:
            # It answered on this endpoint before: a restart closing its port, not a TLS or certificate mismatch.
            return "the engine closed the connection before HTTP/2 began (it answered here before: restarting?)"
        elif not self._received:
            reason = _explain_early_close(tls.files if tls is not None else None)
        if reason is None:
            return "Connection lost"  # grpclib's own words
        _warn(reason)
        return reason


def _code_name(code: Any) -> str:
    return code.name if isinstance(code, ErrorCodes) else str(code)


class PooledChannel(Channel):
    """A grpclib channel to ``endpoint`` (TCP, TLS or a Unix socket) whose connections drain on GOAWAY."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        codec: CodecBase,
        config: Configuration,
        tls: TlsSource | None,
        listener: PoolListener,
    ) -> None:
        if endpoint.path is not None:
            super().__init__(path=endpoint.path, codec=codec, config=config)
            self._authority = "localhost"  # what gRPC sends for Unix sockets (grpclib would send 127.0.0.1:50051)
        else:
            super().__init__(endpoint.host, endpoint.port, codec=codec, config=config)
        if tls is not None:
            self._scheme = "https"  # grpclib derives it from a context fixed at construction; ours is per connection
        self.endpoint = endpoint
        self.tls = tls
        #: Some connection of this channel got bytes from the engine (the TLS hints assume it never did).
        self.answered = False
        self._listener = listener
        self._draining: set[GracefulProtocol] = set()

    @property
    def draining(self) -> int:
        """Connections of this channel that had a GOAWAY and still deliver streams."""
        return len(self._draining)

    @property
    def _connected(self) -> bool:
        # grpclib's test plus "no GOAWAY": a connection that heard one before it was handed to the channel must not
        # be reused for new calls either.
        protocol = self._protocol
        return (
            protocol is not None
            and not getattr(protocol.handler, "connection_lost", False)
            and getattr(protocol.processor, "goaway", None) is None
        )

    def _protocol_factory(self) -> H2Protocol:
        return GracefulProtocol(Handler(), self._config, self._h2_config, self)

    async def _create_connection(self) -> H2Protocol:
        endpoint = self.endpoint
        protocol: H2Protocol
        if endpoint.path is not None:
            try:
                _, protocol = await self._loop.create_unix_connection(self._protocol_factory, endpoint.path)
            except OSError as exc:
                reason = _explain_unix(exc, endpoint.path)
                if not isinstance(exc, FileNotFoundError | ConnectionRefusedError):
                    _warn(reason)  # a wrong path or mode does not fix itself while the engine starts
                raise TransportError(reason) from exc
            return protocol
        if self.tls is None:
            _, protocol = await self._loop.create_connection(self._protocol_factory, endpoint.host, endpoint.port)
            return protocol
        try:
            context = self.tls.context()
        except TlsFilesError as exc:
            reason = f"TLS files unusable: {exc}"
            _warn(reason)
            raise TransportError(reason) from None
        try:
            _, protocol = await self._loop.create_connection(
                self._protocol_factory,
                endpoint.host,
                endpoint.port,
                ssl=context,
                server_hostname=self._config.ssl_target_name_override,
            )
        except (ssl.SSLError, ConnectionResetError, ConnectionAbortedError) as exc:
            reason = _explain_handshake(exc, endpoint, self.tls.files)
            _warn(reason)
            raise TransportError(reason) from exc
        return protocol

    def on_goaway(self, protocol: GracefulProtocol, event: ConnectionTerminated, first: bool) -> None:
        """A GOAWAY on ``protocol``: new calls of this channel connect anew; the listener hears of the first one."""
        if self._protocol is protocol:
            self._protocol = None
        if first and not protocol.connection.is_closing():
            self._draining.add(protocol)
            extra = f", {event.additional_data.decode(errors='replace')}" if event.additional_data else ""
            self._listener.going_away(f"GOAWAY {_code_name(event.error_code)}{extra}")

    def on_closed(self, protocol: GracefulProtocol) -> None:
        """``protocol``'s connection is gone."""
        if protocol in self._draining:
            self._draining.discard(protocol)
            self._listener.drained()

    def close_draining(self, reason: str = "the engine kept its connection open too long after GOAWAY") -> None:
        """Close the connections that had a GOAWAY (their streams fail with ``reason``)."""
        for protocol in list(self._draining):
            protocol.processor.close(reason)

    def close(self) -> None:
        """Close the current connection and every draining one (their streams fail)."""
        self.close_draining("the engine client is closed")
        super().close()
