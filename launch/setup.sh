#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at .venv and install everything pinned.
# Used by the README's two commands and by CI; safe to run again (pip skips what is installed).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
"$python" - <<'PY' || { echo "setup: Python 3.11 is required" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)
PY
[ -x .venv/bin/python ] || "$python" -m venv .venv
. .venv/bin/activate
quiet=(-q --disable-pip-version-check)
python -m pip install "${quiet[@]}" "pip==25.3"
python -m pip install "${quiet[@]}" -e ".[codegen,dev]"
# The Dynamo frontend: `pip install ai-dynamo==1.6.1` cannot resolve on Python 3.11 (its aisimulate dependency is a
# stub that downloads from NVIDIA's own index), so install it without dependencies plus the few it needs to run.
python -m pip install "${quiet[@]}" --no-deps "ai-dynamo==1.6.1"
python -m pip install "${quiet[@]}" "packaging==26.4" "pyyaml==6.0.4" "msgspec==0.23.0"
