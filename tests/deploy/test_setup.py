"""``launch/setup.sh`` into a fresh virtual environment: it says what it does, and a successful install prints no
``ERROR`` line (pip's resolver used to list every dependency of ai-dynamo left out on purpose as an ERROR after the
``--no-deps`` install). A second run reuses the environment, just as quietly, and it brings the test engine.

The mock is a tool beside the product (issue 29): the project's own wheel, installed as the image installs it
(``pip install .``), carries neither ``sidecar.testing`` nor ``tokenizers``, and its ``openengine-mock`` says in one
line how to get the mock; the image's build context leaves ``sidecar/testing`` out."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sidecar.mock_command import NOT_INSTALLED

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "launch" / "setup.sh"
#: What a copy of the source tree leaves out: environments, caches and build output, never part of a checkout.
_NOT_SOURCE = shutil.ignore_patterns(
    ".venv", ".git", "__pycache__", "*.egg-info", "build", "dist", ".mypy_cache", ".ruff_cache", ".pytest_cache"
)
# pytest.mark.timeout: a fresh install (900 s bound) and a second run of setup
pytestmark = [pytest.mark.timeout(1080)]


def install(venv: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["OPENENGINE_VENV"] = str(venv)
    return subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, env=env, timeout=900, check=False)


def source_copy(tmp_path: Path) -> Path:
    """The checkout's source, copied: pip builds in the tree it is given, and this one must stay clean."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT, copy, ignore=_NOT_SOURCE)
    return copy


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``argv`` outside this checkout (``python -c`` would import the checkout's own ``sidecar`` from the cwd)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False, env=env, cwd=cwd)


def test_the_projects_wheel_carries_no_mock_and_no_tokenizers(tmp_path: Path) -> None:
    """The wheel the image installs: no ``sidecar/testing`` file, no ``tokenizers`` requirement, and the
    ``openengine-mock`` command pointing at the one-line explainer."""
    built = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "w"), str(source_copy(tmp_path))],
        tmp_path,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "w").glob("openengine_sidecar-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "sidecar/cli.py" in names
    assert "sidecar/mock_command.py" in names
    assert not [n for n in names if n.startswith("sidecar/testing")], "the mock is in the product's wheel"
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert requires, metadata
    assert not [line for line in requires if "tokenizers" in line or "msgspec" in line], requires
    assert "openengine-mock = sidecar.mock_command:main" in entry_points


def test_the_image_context_leaves_the_mock_out() -> None:
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    assert "sidecar/testing" in ignored
    containerfile = (ROOT / "deploy" / "Containerfile").read_text()
    assert "COPY sidecar/ sidecar/" in containerfile
    assert "find_spec('sidecar.testing') is not None" in containerfile, "the image checks the mock is absent"


@pytest.mark.slow
def test_pip_install_dot_gives_a_working_sidecar_without_the_mock_or_tokenizers(tmp_path: Path) -> None:
    """``pip install .`` (no extras) into a fresh environment, as the image does."""
    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", str(venv)], tmp_path).returncode == 0
    python, bin_dir = str(venv / "bin" / "python"), venv / "bin"
    source = source_copy(tmp_path)
    installed = run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(source)], tmp_path)
    assert installed.returncode == 0, installed.stderr[-4000:]
    helped = run([str(bin_dir / "openengine-sidecar"), "--help"], tmp_path)
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "usage: openengine-sidecar" in helped.stdout
    for module in ("tokenizers", "sidecar.testing", "sidecar.testing.mock", "sidecar.cli"):
        code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        found = run([python, "-c", code], tmp_path).returncode == 0
        assert found == (module == "sidecar.cli"), f"{module}: {'installed' if found else 'missing'}"
    mock = run([str(bin_dir / "openengine-mock"), "--help"], tmp_path)
    assert (mock.returncode, mock.stdout, mock.stderr) == (1, "", NOT_INSTALLED + "\n")


@pytest.mark.slow
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
        [str(venv / "bin" / "python"), "-c", "import dynamo.frontend.main, sidecar.cli, sidecar.testing.mock.lm"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        # Importing dynamo.frontend would leave SGLang's log config in $TMPDIR/tmp*.json (issue 36 §3).
        env={**os.environ, "DYN_SKIP_SGLANG_LOG_FORMATTING": "1"},
    )
    assert imported.returncode == 0, imported.stderr
    # The test engine came with it (its own distribution), and its command runs it.
    mock = subprocess.run(
        [str(venv / "bin" / "openengine-mock"), "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert mock.returncode == 0, mock.stderr
    assert mock.stdout.startswith("usage: openengine-mock"), mock.stdout
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
