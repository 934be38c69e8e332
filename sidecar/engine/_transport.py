"""The connection under each pooled channel: TLS files re-read on (re)connect, failures explained, GOAWAY heard.

The HTTP/2 part -- draining a connection on the engine's GOAWAY rather than failing every stream on it -- is
``sidecar.http2``'s (:class:`~sidecar.http2.Http2Channel`); this module adds what is about reaching *this* engine:

* **TLS files** are read on every connection attempt that finds one of them changed (device, inode, size, mtime), so
  a rotated client certificate or CA (cert-manager, Vault agent, a Kubernetes secret) is used without a restart.
* **Why.** A TLS handshake refusal, an engine that closed a TLS connection before HTTP/2 began (the usual sign of a
  rejected client certificate: the alert itself rarely reaches the client before the reset), a plaintext client
  talking to a TLS engine and a bad Unix socket path become one sentence naming the flag or file to check, logged
  once as a WARNING (then at most every 30 s) and carried by the RPC's ``UNAVAILABLE`` error; so do streams cut by
  an engine that closed the connection after its GOAWAY.
* **GOAWAY news.** The pool's listener hears of each connection's first GOAWAY and of the end of every draining
  connection.

Everything here runs on the edge loop's thread.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import ssl
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Protocol

from sidecar.http2 import Http2Channel

if TYPE_CHECKING:
    from collections.abc import Callable

    from grpclib.config import Configuration
    from grpclib.encoding.base import CodecBase

    from sidecar.contract import Endpoint
    from sidecar.http2 import ClientProtocol, Goaway

__all__ = [
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
# The first two bytes of a TLS record carrying an alert (0x15) or a handshake (0x16), TLS 1.x. An HTTP/2 server's
# first frame is SETTINGS, whose 3-byte length starts with 0x00, so the two never look alike.
_TLS_RECORD_STARTS: Final = (b"\x15\x03", b"\x16\x03")


class TransportError(ConnectionError):
    """No connection could be made, or it was refused, for the reason in the message (meant for the operator)."""


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


class PooledChannel(Http2Channel):
    """A channel to ``endpoint`` (TCP, TLS or a Unix socket) whose connections drain on GOAWAY (``sidecar.http2``),
    telling ``listener``; TLS files are re-read per connection, and every failure says why.

    ``direct=True``: its connections also carry ``Generate`` streams received straight from the HTTP/2 events
    (``_direct.py``), which engages the layer's frame splitter; off, grpclib receives every stream its own way.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        codec: CodecBase,
        config: Configuration,
        tls: TlsSource | None,
        listener: PoolListener,
        direct: bool = False,
    ) -> None:
        if endpoint.path is not None:
            super().__init__(path=endpoint.path, codec=codec, config=config, direct=direct)
            self.authority = "localhost"  # what gRPC sends for Unix sockets (grpclib would send 127.0.0.1:50051)
        else:
            super().__init__(endpoint.host, endpoint.port, codec=codec, config=config, direct=direct)
        if tls is not None:
            self.scheme = "https"  # grpclib derives it from a context fixed at construction; ours is per connection
        self.endpoint = endpoint
        self.tls = tls
        #: Some connection of this channel got bytes from the engine (the TLS hints assume it never did).
        self.answered = False
        self._listener = listener

    async def open_connection(self, factory: Callable[[], ClientProtocol]) -> ClientProtocol:
        endpoint = self.endpoint
        loop = self.loop
        protocol: ClientProtocol
        if endpoint.path is not None:
            try:
                _, protocol = await loop.create_unix_connection(factory, endpoint.path)
            except OSError as exc:
                reason = _explain_unix(exc, endpoint.path)
                if not isinstance(exc, FileNotFoundError | ConnectionRefusedError):
                    _warn(reason)  # a wrong path or mode does not fix itself while the engine starts
                raise TransportError(reason) from exc
            return protocol
        if self.tls is None:
            _, protocol = await loop.create_connection(factory, endpoint.host, endpoint.port)
            return protocol
        try:
            context = self.tls.context()
        except TlsFilesError as exc:
            reason = f"TLS files unusable: {exc}"
            _warn(reason)
            raise TransportError(reason) from None
        try:
            _, protocol = await loop.create_connection(
                factory,
                endpoint.host,
                endpoint.port,
                ssl=context,
                server_hostname=self.config.ssl_target_name_override,
            )
        except (ssl.SSLError, ConnectionResetError, ConnectionAbortedError) as exc:
            reason = _explain_handshake(exc, endpoint, self.tls.files)
            _warn(reason)
            raise TransportError(reason) from exc
        return protocol

    def refuse_first_bytes(self, data: bytes) -> str | None:
        self.answered = True
        if self.tls is None and data[:2] in _TLS_RECORD_STARTS:
            reason = "the engine answers in TLS; pass --grpc-tls-ca and use an https:// endpoint"
            _warn(reason)
            return reason
        return None

    def lost_reason(self, protocol: ClientProtocol, exc: BaseException | None) -> str:
        goaway = protocol.goaway
        if goaway is not None:
            return (
                f"the engine closed the connection after its GOAWAY ({goaway.code_name}) before this stream ended"
                " (it is stopping); retry elsewhere"
            )
        tls = self.tls
        reason = None
        if isinstance(exc, ssl.SSLError) and tls is not None and "ALERT" in (exc.reason or ""):
            reason = _explain_alert(exc.reason, tls.files)
        elif not protocol.received and self.answered:
            # It answered on this endpoint before: a restart closing its port, not a TLS or certificate mismatch.
            return "the engine closed the connection before HTTP/2 began (it answered here before: restarting?)"
        elif not protocol.received:
            reason = _explain_early_close(tls.files if tls is not None else None)
        if reason is None:
            return "Connection lost"  # grpclib's own words
        _warn(reason)
        return reason

    def heard_goaway(self, protocol: ClientProtocol, goaway: Goaway) -> None:
        """New calls of this channel connect anew; the listener hears of each connection's first GOAWAY."""
        super().heard_goaway(protocol, goaway)
        if goaway.first and not protocol.closing:
            extra = f", {goaway.additional_data.decode(errors='replace')}" if goaway.additional_data else ""
            self._listener.going_away(f"GOAWAY {goaway.code_name}{extra}")

    def connection_closed(self, protocol: ClientProtocol) -> bool:
        drained = super().connection_closed(protocol)
        if drained:
            self._listener.drained()
        return drained

    closed_reason = "the engine client is closed"

    def close_draining(self, reason: str = "the engine kept its connection open too long after GOAWAY") -> None:
        """Close the connections that had a GOAWAY (their streams fail with ``reason``)."""
        super().close_draining(reason)
