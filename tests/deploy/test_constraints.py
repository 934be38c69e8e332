"""``constraints.txt``: one source of the exact versions of the HTTP/2 stack whose internals ``sidecar/http2`` adapts,
obeyed by ``launch/setup.sh`` (hence CI) and ``deploy/Containerfile``, whose build runs the layer's canaries."""

from __future__ import annotations

import re
import shlex
import tomllib
from importlib.metadata import version
from pathlib import Path

from tests.http2.test_room import LAYER_MAY_IMPORT

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)==(?P<version>[^\s;#]+)$")


def _pins(lines: list[str]) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in lines:
        match = _PIN.match(line.strip())
        if match:
            pins[match["name"].lower()] = match["version"]
    return pins


def constraints() -> dict[str, str]:
    lines = [line for line in CONSTRAINTS.read_text().splitlines() if line.strip() and not line.startswith("#")]
    pins = _pins(lines)
    assert len(pins) == len(lines), f"every line of constraints.txt is an exact pin (name==version): {lines}"
    return pins


def pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    return _pins([re.sub(r"\[[^]]*\]", "", r) for r in requirements])


def containerfile_steps() -> list[str]:
    text = (ROOT / "deploy" / "Containerfile").read_text()
    lines = [line.strip() for line in text.replace("\\\n", " ").splitlines() if line.strip()]
    return [line for line in lines if not line.startswith("#")]


def test_every_library_of_the_http2_layer_is_pinned_exactly() -> None:
    assert set(constraints()) >= LAYER_MAY_IMPORT


def test_this_environment_runs_the_pinned_versions() -> None:
    for name, pinned in constraints().items():
        assert version(name) == pinned, f"{name} {version(name)} is installed, constraints.txt says {pinned}"


def test_pyproject_agrees_with_the_constraints() -> None:
    ours, pinned = pyproject_pins(), constraints()
    for name in set(ours) & set(pinned):
        assert ours[name] == pinned[name], f"{name}: pyproject.toml {ours[name]}, constraints.txt {pinned[name]}"


def test_setup_installs_everything_under_the_constraints() -> None:
    script = (ROOT / "launch" / "setup.sh").read_text()
    assert '-c "$root/constraints.txt"' in script
    commands = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    installs = [line for line in commands if re.search(r"pip install\b", line) and "pip==" not in line]
    assert installs
    for line in installs:
        assert '"${constraints[@]}"' in line, f"launch/setup.sh installs without constraints.txt: {line.strip()}"


def test_the_image_installs_under_the_constraints_and_runs_the_canaries_before_its_runtime_stage() -> None:
    steps = containerfile_steps()
    runtime = max(i for i, step in enumerate(steps) if step.startswith("FROM "))
    build = steps[:runtime]
    assert any(step.startswith("COPY ") and "constraints.txt" in step.split() for step in build)
    runs = [shlex.split(step.removeprefix("RUN ")) for step in build if step.startswith("RUN ")]
    installs = [words for words in runs for i, w in enumerate(words) if w == "install" and words[i - 1] == "pip"]
    wheel = [words for words in installs if any(w.startswith("/wheels/") for w in words)]
    assert wheel, "the image installs the project's wheel"
    assert all("-c" in words and "constraints.txt" in words for words in wheel), wheel
    (canaries,) = [words for words in runs if "tests/http2/test_canaries.py" in words]
    assert "pytest" in canaries
    assert not {"||", ";"} & set(canaries), "a failing canary must fail the build"
    pytest_pin = [w for w in canaries if w.startswith("pytest==")]
    assert pytest_pin == [f"pytest=={pyproject_pins()['pytest']}"]
    assert any("tests/http2/" in step for step in build if step.startswith("COPY "))
    # The runtime stage copies what was installed, never the canaries or their pytest.
    assert not any("canar" in step for step in steps[runtime:])
