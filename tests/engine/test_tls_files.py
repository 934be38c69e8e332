"""The operator's TLS files: each unusable one refused in one line naming its flag; never a passphrase prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.engine import TlsFiles, TlsFilesError, build_tls_context, tls_files_from_flags
from tests.helpers.pki import Pki, replace_atomically


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki.create(tmp_path)


def test_unusable_tls_files_are_one_line_naming_the_flag(tmp_path: Path, pki: Pki) -> None:
    no_cert = tmp_path / "empty-ca.pem"
    no_cert.write_text("not a certificate\n")
    garbage_cert = tmp_path / "garbage.crt"
    garbage_cert.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    (tmp_path / "other").mkdir()
    other = Pki.create(tmp_path / "other")
    cases: list[tuple[TlsFiles, str]] = [
        (TlsFiles(no_cert), f"--grpc-tls-ca: no PEM certificate in {no_cert}"),
        (TlsFiles(tmp_path / "missing.pem"), "--grpc-tls-ca: cannot read"),
        (TlsFiles(pki.ca_pem, pki.client_crt, other.client_key), "does not belong to the certificate"),
        (TlsFiles(pki.ca_pem, garbage_cert, pki.client_key), "are not a usable certificate and key"),
        (TlsFiles(pki.ca_pem, pki.client_key, pki.client_key), "--grpc-tls-cert: no PEM certificate"),
        (TlsFiles(pki.ca_pem, pki.client_crt, pki.client_crt), "--grpc-tls-key: no PEM private key"),
    ]
    for files, message in cases:
        with pytest.raises(TlsFilesError) as refused_files:
            build_tls_context(files)
        text = str(refused_files.value)
        assert message in text, text
        assert "\n" not in text


def test_an_encrypted_key_needs_its_passphrase_file(tmp_path: Path, pki: Pki) -> None:
    pki.write_client(passphrase=b"s3cret")
    files = TlsFiles(pki.ca_pem, pki.client_crt, pki.client_key)
    with pytest.raises(TlsFilesError, match=r"is encrypted; give its passphrase .*--grpc-tls-key-password-file"):
        build_tls_context(files)  # never a prompt on the terminal
    wrong = tmp_path / "wrong"
    wrong.write_text("nope\n")
    with pytest.raises(TlsFilesError, match=r"--grpc-tls-key-password-file: the passphrase in .* does not decrypt"):
        build_tls_context(TlsFiles(pki.ca_pem, pki.client_crt, pki.client_key, wrong))
    right = tmp_path / "right"
    right.write_text("s3cret\n")  # the trailing newline an editor adds is not part of it
    build_tls_context(TlsFiles(pki.ca_pem, pki.client_crt, pki.client_key, right))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ((None, "c", None, None), "--grpc-tls-cert and --grpc-tls-key go together"),
        ((None, "c", "k", None), "--grpc-tls-cert needs --grpc-tls-ca"),
        (("a", None, None, "p"), "--grpc-tls-key-password-file needs --grpc-tls-key"),
        (("missing.pem", None, None, None), "--grpc-tls-ca: no such file: missing.pem"),
    ],
)
def test_tls_flags_are_checked_together(flags: tuple[str | None, ...], message: str) -> None:
    with pytest.raises(TlsFilesError, match=message):
        tls_files_from_flags(*flags)


def test_tls_flags_keep_symlinked_paths_unresolved(tmp_path: Path, pki: Pki) -> None:
    # A Kubernetes secret volume: ca.pem -> ..data/ca.pem -> ..2024_01_01/ca.pem. An update re-points ..data and
    # deletes the old directory: a resolved path would keep naming a file that is gone.
    versioned = tmp_path / "..2024_01_01"
    versioned.mkdir()
    replace_atomically(versioned / "ca.pem", pki.ca_pem.read_bytes())
    (tmp_path / "..data").symlink_to(versioned.name)
    (tmp_path / "mounted-ca.pem").symlink_to("..data/ca.pem")
    files = tls_files_from_flags(str(tmp_path / "mounted-ca.pem"), None, None)
    assert files is not None
    assert files.ca == tmp_path / "mounted-ca.pem"
