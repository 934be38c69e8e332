"""Running ``launch/*.sh`` from tests: each in a session of its own, and nothing of it left afterwards.

The launchers start every child in a process group of its own (so that a terminal's Ctrl-C reaches only the
launcher, which stops the children in order), so killing the launcher's process group is not enough: the session
is what holds all of them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import suppress
from pathlib import Path


def session_members(sid: int) -> list[str]:
    """The processes of session ``sid`` other than its leader, as ``pid command`` lines."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == sid:
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: the session; zombies are already gone
            members.append(f"{entry.name} {cmdline}")
    return members


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` but its leader (the caller's child: kill that through its Popen)."""
    for line in session_members(sid):
        with suppress(ProcessLookupError, PermissionError):
            os.kill(int(line.split()[0]), signal.SIGKILL)


def run_launcher(
    argv: list[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[int | None, str, list[str]]:
    """Run a launcher to its end in a new session; returns its status, its output and what it left running.

    On ``timeout`` the launcher gets SIGTERM (its trap stops its children in order) and 60 s; whatever is left of
    the session is then killed either way. A status of ``None`` means it had to be killed.
    """
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    ) as proc:
        status: int | None
        try:
            output, _ = proc.communicate(timeout=timeout)
            status = proc.returncode
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                output, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                kill_session(proc.pid)
                proc.kill()
                output, _ = proc.communicate()
            output += f"\n[the launcher did not finish within {timeout} s]"
            status = None
        # The launcher waits for every child; give the kernel a moment to reap them.
        deadline = time.monotonic() + 5
        while session_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # the poll interval of synchronous code (wait_until is async)
        left = session_members(proc.pid)
        kill_session(proc.pid)
        return status, output, left
