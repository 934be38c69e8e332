#!/usr/bin/env bash
# The README's main job: install everything, start the aggregated demo on openengine-mock and answer one real
# request through the real Dynamo frontend. It keeps serving until Ctrl-C; pass --once to stop after the answer.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/launch/setup.sh"
exec bash "$root/launch/agg.sh" --demo "$@"
