"""Every test runs under a wall-clock bound (pytest-timeout, set in pyproject.toml): a hang fails, never blocks CI.

A virtual clock cannot bound what never blocks: under ``autojump_clock`` a loop that keeps checkpointing without ever
waiting (a reconnect loop whose every attempt fails at once) never lets virtual time advance, so its ``fail_after``
never fires. Here two tests that hang on purpose run in a pytest of their own with the project's configuration and a
2-second bound; both must fail, named, within seconds, and the run must go on to the next test. (Inside trio the
timeout lands in trio's run loop and reaches the test as a ``TrioInternalError`` caused by pytest-timeout's failure:
the test is failed, the process goes on.)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

HANGING = """
import time

import trio


async def test_spins_in_virtual_time(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(1):  # virtual: never fires, nothing ever blocks
        while True:
            await trio.lowlevel.checkpoint()


def test_blocks_in_real_time() -> None:
    time.sleep(120)


def test_passes() -> None:
    pass
"""


def test_the_default_bound_is_configured(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert float(pytestconfig.getini("timeout")) == 300


def test_a_hanging_test_fails_on_its_wall_clock_bound(tmp_path: Path) -> None:
    (tmp_path / "test_hangs.py").write_text(HANGING)
    started = time.monotonic()
    config = ["-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), "-p", "no:cacheprovider"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *config, "-o", "timeout=2", str(tmp_path / "test_hangs.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 failed, 1 passed" in run.stdout, run.stdout[-3000:]
    # Each hanging test's own failure says it was the wall-clock bound (the short summary may repeat it: -ra).
    for name in ("test_spins_in_virtual_time", "test_blocks_in_real_time"):
        _, found, rest = run.stdout.partition(f"_ {name} _")
        assert found, run.stdout[-3000:]
        section = rest.split("\n_", 1)[0]
        assert "Failed: Timeout (>2.0s) from pytest-timeout" in section, run.stdout[-3000:]
    assert elapsed < 60, f"the bound did not hold: {elapsed:.0f} s"
