#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at .venv and install everything pinned, saying what it does
# (about two minutes on a fresh machine). Used by the README's two commands and by CI; safe to run again (pip skips
# what is installed).
#
# usage: launch/setup.sh [-h|--help]
#   takes no flags; the environment may set
#   OPENENGINE_VENV=DIR  put the environment there instead of .venv (the tests install into a scratch one)
#   PYTHON=EXE           create it with this Python 3.11 (default: python3.11, else python3)
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_usage.sh"
no_flags "$@"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=${OPENENGINE_VENV:-.venv}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
say() { echo "setup: $*"; }
"$python" - <<'PY' || { echo "setup: Python 3.11 is required" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)
PY
if [ -x "$venv/bin/python" ]; then
  say "using the virtual environment $venv"
else
  say "creating the virtual environment $venv"
  "$python" -m venv "$venv"
fi
. "$venv/bin/activate"
quiet=(-q --disable-pip-version-check)
# constraints.txt: the exact versions of the HTTP/2 stack whose internals sidecar/http2 adapts (the image uses it too).
constraints=(-c "$root/constraints.txt")
say "pinning pip"
python -m pip install "${quiet[@]}" "pip==25.3"
say "installing the project with its pinned dependencies (the longest step, about a minute)"
python -m pip install "${quiet[@]}" "${constraints[@]}" -e ".[codegen,dev]"
# The test engine is a distribution of its own (openengine-sidecar never ships it): the demo and the tests need it.
say "installing openengine-mock, the test engine (sidecar/testing, with tokenizers and msgspec)"
python -m pip install "${quiet[@]}" "${constraints[@]}" -e ./sidecar/testing

# The Dynamo frontend: `pip install ai-dynamo==1.6.1` cannot resolve on Python 3.11 (its aisimulate dependency is a
# stub that downloads from NVIDIA's own index), so it is installed without dependencies, plus the few it needs to run.
# Those go first and ai-dynamo last: pip checks the dependencies of what it installs only when it resolves them, so
# the --no-deps install adds no "dependency resolver" ERROR about the ones left out on purpose (an install after it
# would print one for every such dependency). The check below still reports any other conflict.
say "installing what the Dynamo frontend needs to run (packaging, pyyaml, msgspec)"
python -m pip install "${quiet[@]}" "${constraints[@]}" "packaging==26.4" "pyyaml==6.0.4" "msgspec==0.23.0"
say "installing the Dynamo frontend (ai-dynamo 1.6.1, without its dependencies)"
python -m pip install "${quiet[@]}" "${constraints[@]}" --no-deps "ai-dynamo==1.6.1"

# ai-dynamo's dependencies this project leaves out: the frontend runs without them.
left_out='aiohttp|aisimulate|kubernetes|pyzmq|redis|transformers|zstandard'
say "checking the installed set"
problems=$(python -m pip check 2>/dev/null | grep -Ev "^ai-dynamo 1\.6\.1 requires ($left_out), which is not installed\.$" \
  | grep -v '^No broken requirements found\.$' || true)
if [ -n "$problems" ]; then
  echo "setup: pip check found conflicts:" >&2
  echo "$problems" >&2
  exit 1
fi
# Importing dynamo.frontend runs Dynamo's logging setup, which would leave SGLang's log config in $TMPDIR/tmp*.json.
DYN_SKIP_SGLANG_LOG_FORMATTING=1 python -c "import dynamo.frontend.main, dynamo.llm, sidecar.cli, sidecar.testing.mock.server" \
  || { echo "setup: the installed packages do not import (see above)" >&2; exit 1; }
say "done: . $venv/bin/activate"
