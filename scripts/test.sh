#!/usr/bin/env bash
# The project's test command: install, then every check CI runs, in order of cost.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash launch/setup.sh
bash launch/setup-system.sh
. .venv/bin/activate
echo "== generated code drift"
python protos/generate.py --check
echo "== state-diagram docs drift"
python scripts/gen_state_docs.py --check
echo "== mock profile table drift"
python scripts/gen_mock_profiles.py --check
echo "== ruff"
ruff check .
ruff format --check sidecar statemachines tests bench scripts protos/generate.py
echo "== mypy --strict"
mypy
echo "== pytest"
python -m pytest "$@"
