"""``launch/setup.sh`` into a fresh virtual environment: it says what it does, and a successful install prints no
``ERROR`` line (pip's resolver used to list every dependency of ai-dynamo left out on purpose as an ERROR after the
``--no-deps`` install). A second run reuses the environment, just as quietly."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[2] / "launch" / "setup.sh"

pytestmark = pytest.mark.slow


def install(venv: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["OPENENGINE_VENV"] = str(venv)
    return subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, env=env, timeout=900, check=False)


def test_a_fresh_install_says_what_it_does_and_prints_no_error(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    for run in ("fresh", "again"):
        done = install(venv)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-4000:]
        errors = [line for line in output.splitlines() if line.lstrip().startswith("ERROR")]
        assert not errors, f"{run}: {errors}"
        steps = [line for line in done.stdout.splitlines() if line.startswith("setup: ")]
        assert len(steps) >= 6, done.stdout
        assert steps[0] == f"setup: {'creating' if run == 'fresh' else 'using'} the virtual environment {venv}"
        assert any("Dynamo frontend" in step for step in steps)
        assert steps[-1] == f"setup: done: . {venv}/bin/activate"
    imported = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import dynamo.frontend.main, sidecar.cli"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert imported.returncode == 0, imported.stderr
    # The HTTP/2 layer's canaries pass on what constraints.txt installed.
    canaries = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/http2/test_canaries.py"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=SETUP.parents[1],
    )
    assert canaries.returncode == 0, canaries.stdout[-4000:]
