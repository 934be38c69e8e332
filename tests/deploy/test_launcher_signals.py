"""Ctrl-C stops a launcher whatever signal state it inherits (issue 29 §4).

A full-suite run once failed the launch matrix's Ctrl-C case: the launcher ignored SIGINT for 120 s, then exited 143
on the test's SIGTERM. A shell cannot trap a signal that was ignored when it started, and it keeps the signal mask it
inherits; a launcher started by a process that ignores or blocks SIGINT (a test runner started in the background of a
non-interactive shell, ``launch/agg.sh &`` in a script) had a void ``trap ... INT``. ``launch/_common.sh`` now starts
the launcher once more with SIGINT's default handling.

Here a launcher reduced to its signal handling (``_common.sh`` and the traps of ``_local.sh``'s ``open_run``) runs in a
terminal of its own, as in the launch matrix, and gets the terminal's Ctrl-C.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import termios
import time
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[2] / "launch"

LAUNCHER = f"""\
. "{LAUNCH}/_common.sh"
trap 'exit 130' INT
trap 'exit 143' TERM
sleep 1000 &
echo "serving; Ctrl-C"
wait $!
"""


def _run_and_interrupt(launcher: Path, inherited: str) -> tuple[int | None, bytes]:
    master, slave = os.openpty()

    def own_terminal() -> None:  # a session whose controlling terminal is the pty, like a shell's
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        if inherited == "ignored":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        elif inherited == "blocked":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    proc = subprocess.Popen(["bash", str(launcher)], stdin=slave, stdout=slave, stderr=slave, preexec_fn=own_terminal)
    os.close(slave)
    output = b""
    try:
        deadline = time.monotonic() + 30
        while b"serving; Ctrl-C" not in output and time.monotonic() < deadline and proc.poll() is None:
            if select.select([master], [], [], 0.2)[0]:
                output += os.read(master, 4096)
        assert b"serving; Ctrl-C" in output, output
        os.write(master, b"\x03")  # what the terminal sends for Ctrl-C
        try:
            return proc.wait(timeout=10), output
        except subprocess.TimeoutExpired:
            return None, output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)


@pytest.mark.parametrize("inherited", ["default", "ignored", "blocked"])
def test_ctrl_c_stops_a_launcher_that_inherited_sigint_ignored_or_blocked(tmp_path: Path, inherited: str) -> None:
    launcher = tmp_path / "launcher.sh"
    launcher.write_text(LAUNCHER)
    status, output = _run_and_interrupt(launcher, inherited)
    assert status == 130, f"SIGINT {inherited} on entry: status {status}; output {output!r}"
