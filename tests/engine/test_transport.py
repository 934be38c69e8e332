"""The transport's explanations: one sentence per failure, naming what to check. (The HTTP/2 layer under it is
``sidecar.http2``'s, tested in ``tests/http2``.)"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

from sidecar.engine._transport import _explain_unix


def test_unix_socket_failures_are_one_sentence_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "engine.sock"
    assert _explain_unix(FileNotFoundError(errno.ENOENT, "x"), str(missing)) == (
        f"no Unix socket at {missing} (is the engine up and listening there?)"
    )
    gone = tmp_path / "nodir" / "engine.sock"
    assert "its directory" in _explain_unix(FileNotFoundError(errno.ENOENT, "x"), str(gone))
    regular = tmp_path / "file"
    regular.write_text("")
    assert _explain_unix(ConnectionRefusedError(errno.ECONNREFUSED, "x"), str(regular)).endswith(
        "is a regular file, not a Unix socket; check --grpc-endpoint"
    )
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(stale))
    assert "nothing listens" in _explain_unix(ConnectionRefusedError(errno.ECONNREFUSED, "x"), str(stale))
    denied = _explain_unix(PermissionError(errno.EACCES, "x"), str(stale))
    assert denied.startswith(f"permission denied on the Unix socket {stale}")
