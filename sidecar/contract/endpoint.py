"""The engine endpoint: ``host:port``, ``http://host:port``, ``grpc://host:port``, ``[v6]:port``, or a Unix-domain
socket, ``unix:///abs/path`` / ``unix:path`` (gRPC's own naming).

Plaintext h2c is the default (TensorRT-LLM's OpenEngine server has no TLS of its own). TLS is spoken when the operator
configures a CA (``tls=True``: ``https://``, ``grpcs://`` or ``host:port``); the schemes must then agree with it. A
Unix socket is always plaintext: the socket file's permissions are its access control, and TLS over it is refused.
The parser refuses every form gRPC cannot address: other schemes, userinfo, paths, queries, fragments. Each refusal
names its problem, because the text usually comes from a flag or an environment variable.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Final

__all__ = ["Endpoint", "EndpointError", "parse_endpoint"]

_PLAINTEXT_SCHEMES: Final = frozenset({"http", "grpc"})
_TLS_SCHEMES: Final = frozenset({"https", "grpcs"})
_UNIX_SCHEME: Final = "unix"
# sockaddr_un.sun_path is 108 bytes on Linux, NUL included.
_MAX_UNIX_PATH: Final = 107
_SCHEME_RE: Final = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*$")
# RFC 1123 labels; underscores are tolerated because container runtimes hand them out in service names.
_LABEL: Final = r"[A-Za-z0-9_](?:[A-Za-z0-9_\-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME_RE: Final = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?$")


class EndpointError(ValueError):
    """The endpoint text cannot be used to reach an OpenEngine server; the message names the problem."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A gRPC endpoint. ``host`` is unbracketed (``::1``, not ``[::1]``); ``tls`` when it is spoken over TLS.

    A Unix-domain socket has ``path`` set (as given: relative paths are relative to the working directory, as in
    gRPC), ``host`` ``localhost`` (the ``:authority`` gRPC sends for Unix sockets) and ``port`` 0.
    """

    host: str
    port: int
    tls: bool = False
    path: str | None = None

    @classmethod
    def unix(cls, path: str) -> Endpoint:
        """A Unix-domain socket endpoint."""
        return cls(host="localhost", port=0, path=path)

    def __str__(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(text: str, *, tls: bool = False) -> Endpoint:
    """Parse ``text`` into an :class:`Endpoint`, or raise :class:`EndpointError` naming the problem.

    Accepted: ``host:port``, ``http://host:port``, ``grpc://host:port`` (optionally with one trailing ``/``), IPv6
    literals in brackets (``[::1]:50051``), ``unix:///abs/path`` and ``unix:path``. Refused: ``https``/``grpcs``
    (TLS is not enabled), any other scheme, userinfo, a path, a query, a fragment, a missing, non-numeric or
    out-of-range port, an empty or malformed host, ``unix://`` with a relative path, an empty socket path.

    With ``tls=True`` (the operator configured a CA) the rule flips: ``https://``, ``grpcs://`` and ``host:port`` are
    accepted and mean TLS, while the plaintext schemes (``unix:`` included) are refused as a contradiction.
    """
    original = text
    text = text.strip()
    if not text:
        raise EndpointError("empty endpoint; expected host:port")
    if text[:5].lower() == f"{_UNIX_SCHEME}:":
        return _parse_unix(text[5:], original, tls=tls)
    if text.lower().startswith("unix-abstract:"):
        raise EndpointError(f"abstract Unix sockets are not supported ({original!r}); use unix:///path/to/engine.sock")
    scheme, sep, rest = text.partition("://")
    if sep:
        scheme = scheme.lower()
        if scheme in _TLS_SCHEMES and not tls:
            raise EndpointError(
                f"TLS is not enabled; {original!r} asks for {scheme}://, which needs --grpc-tls-ca (the CA that signed"
                " the engine's certificate); for plaintext h2c use http://host:port, grpc://host:port or host:port"
            )
        if scheme in _PLAINTEXT_SCHEMES and tls:
            raise EndpointError(f"{original!r} asks for plaintext {scheme}:// but TLS is configured; use https://")
        if not _SCHEME_RE.match(scheme):
            raise EndpointError(f"malformed scheme in {original!r}")
        if scheme not in _PLAINTEXT_SCHEMES | _TLS_SCHEMES:
            raise EndpointError(
                f"unsupported scheme {scheme!r} in {original!r}; use http://, grpc://, host:port or unix:///path"
            )
    else:
        rest = text
    if "#" in rest:
        raise EndpointError(f"fragment not allowed in endpoint {original!r}")
    if "?" in rest:
        raise EndpointError(f"query not allowed in endpoint {original!r}")
    authority, slash, path = rest.partition("/")
    if slash and path:
        # A single trailing "/" is what URL tools print for an empty path; anything more would be silently ignored.
        raise EndpointError(f"path not allowed in endpoint {original!r}")
    if "@" in authority:
        raise EndpointError(f"userinfo not allowed in endpoint {original!r}")
    host, port_text = _split_authority(authority, original)
    return Endpoint(host=host, port=_parse_port(port_text, original), tls=tls)


def _parse_unix(rest: str, original: str, *, tls: bool) -> Endpoint:
    # gRPC's naming: "unix:path" (relative or absolute) and "unix://absolute_path" (three slashes in all).
    if tls:
        raise EndpointError(
            f"{original!r} is a Unix socket, which is spoken in plaintext (its file permissions guard it); TLS"
            " (--grpc-tls-ca) is for engines on other hosts"
        )
    if rest.startswith("//"):
        path = rest[2:]
        if not path.startswith("/"):
            raise EndpointError(f"unix:// needs an absolute path, i.e. three slashes: unix:///path (got {original!r})")
    else:
        path = rest
    if not path:
        raise EndpointError(f"empty socket path in endpoint {original!r}; expected unix:///path/to/engine.sock")
    if "\0" in path:
        raise EndpointError(f"NUL character in socket path {original!r}")
    if len(path.encode()) > _MAX_UNIX_PATH:
        raise EndpointError(
            f"socket path of {len(path.encode())} bytes in {original!r}; Unix sockets allow at most {_MAX_UNIX_PATH}"
        )
    return Endpoint.unix(path)


def _split_authority(authority: str, original: str) -> tuple[str, str]:
    if authority.startswith("["):
        close = authority.find("]")
        if close < 0:
            raise EndpointError(f"unterminated IPv6 literal in endpoint {original!r}")
        host = authority[1:close]
        after = authority[close + 1 :]
        if not host:
            raise EndpointError(f"empty host in endpoint {original!r}")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise EndpointError(f"invalid IPv6 address {host!r} in endpoint {original!r}") from None
        if not after:
            raise EndpointError(f"missing port in endpoint {original!r}; expected [{host}]:port")
        if not after.startswith(":"):
            raise EndpointError(f"unexpected {after!r} after the IPv6 address in endpoint {original!r}")
        return host, after[1:]
    if authority.count(":") > 1:
        raise EndpointError(f"IPv6 addresses must be bracketed, e.g. [::1]:50051 (got {original!r})")
    host, colon, port_text = authority.partition(":")
    if not host:
        raise EndpointError(f"empty host in endpoint {original!r}")
    if not colon:
        raise EndpointError(f"missing port in endpoint {original!r}; expected host:port")
    if not _HOSTNAME_RE.match(host):
        raise EndpointError(f"invalid host {host!r} in endpoint {original!r}")
    return host, port_text


def _parse_port(port_text: str, original: str) -> int:
    if not port_text:
        raise EndpointError(f"missing port in endpoint {original!r}")
    # isdigit() accepts non-ASCII digits ("٣"); gRPC authorities are ASCII.
    if not (port_text.isascii() and port_text.isdigit()):
        raise EndpointError(f"bad port {port_text!r} in endpoint {original!r}; expected a number")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise EndpointError(f"port {port} out of range 1-65535 in endpoint {original!r}")
    return port
