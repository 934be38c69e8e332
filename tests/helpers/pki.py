"""Certificates for the TLS tests (trustme), written as PEM files the way an operator's secret mount holds them."""

from __future__ import annotations

import datetime
import os
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trustme
from cryptography.hazmat.primitives import serialization

if TYPE_CHECKING:
    from pathlib import Path


def ago(**delta: float) -> datetime.datetime:
    return _now() - datetime.timedelta(**delta)


def ahead(**delta: float) -> datetime.datetime:
    return _now() + datetime.timedelta(**delta)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def replace_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` the way secret updaters do: a new file renamed over the old one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass
class Pki:
    """A CA and the files of one TLS deployment under ``root``: ``ca.pem``, ``server.pem`` (cert and key),
    ``client.crt`` / ``client.key`` (mutual TLS)."""

    root: Path
    ca: trustme.CA

    @classmethod
    def create(cls, root: Path, host: str = "127.0.0.1") -> Pki:
        pki = cls(root, trustme.CA())
        pki.ca.cert_pem.write_to_path(str(pki.ca_pem))
        pki.write_server(host)
        pki.write_client()
        return pki

    @property
    def ca_pem(self) -> Path:
        return self.root / "ca.pem"

    @property
    def server_pem(self) -> Path:
        return self.root / "server.pem"

    @property
    def client_crt(self) -> Path:
        return self.root / "client.crt"

    @property
    def client_key(self) -> Path:
        return self.root / "client.key"

    def write_server(
        self,
        host: str = "127.0.0.1",
        *,
        ca: trustme.CA | None = None,
        not_before: datetime.datetime | None = None,
        not_after: datetime.datetime | None = None,
    ) -> None:
        cert = (ca or self.ca).issue_cert(host, not_before=not_before, not_after=not_after)
        replace_atomically(self.server_pem, cert.private_key_and_cert_chain_pem.bytes())

    def write_client(
        self, *, ca: trustme.CA | None = None, not_after: datetime.datetime | None = None, passphrase: bytes = b""
    ) -> None:
        cert = (ca or self.ca).issue_cert("sidecar.client", not_after=not_after)
        key = cert.private_key_pem.bytes()
        if passphrase:
            loaded = serialization.load_pem_private_key(key, None)
            key = loaded.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.BestAvailableEncryption(passphrase),
            )
        # The key first: a reader that sees the new certificate must find its key.
        replace_atomically(self.client_key, key)
        replace_atomically(self.client_crt, b"".join(pem.bytes() for pem in cert.cert_chain_pems))

    def server_context(self, client_ca: trustme.CA | None = None) -> ssl.SSLContext:
        """The engine's TLS context; with ``client_ca``, client certificates it signed are required."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(self.server_pem))
        context.set_alpn_protocols(["h2"])
        if client_ca is not None:
            client_ca.configure_trust(context)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def mock_flags(self, client_ca: Path | None = None) -> list[str]:
        """``openengine-mock`` flags serving this PKI's server certificate."""
        flags = ["--tls-cert", str(self.server_pem), "--tls-key", str(self.server_pem)]
        return [*flags, "--tls-client-ca", str(client_ca)] if client_ca is not None else flags
