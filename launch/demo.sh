#!/usr/bin/env bash
# The README's main job: install everything (launch/setup.sh), start the aggregated demo on openengine-mock
# (launch/agg.sh --demo) and answer one real request through the real Dynamo frontend. It keeps serving until Ctrl-C.
#
# usage: launch/demo.sh [--once] [--http-port N] [--system-port N] [--log-dir DIR] [--mock-profile NAME]
#                       [-- extra openengine-sidecar flags]
#   --once               stop everything after the answer (exit 0 only if it was right and every process stopped
#                        cleanly)
#   --http-port N        the frontend's HTTP port (default 8000, or DYN_HTTP_PORT)
#   --system-port N      the sidecar's system port: /health, /live, /metrics (default 8081; at most 32767)
#   --log-dir DIR        write every process's log there (default: a new temporary directory); kept on exit
#   --mock-profile NAME  the engine's openengine-mock profile: trtllm (default, TensorRT-LLM's merged server: the
#                        OpenAI SDK's structured output works), trtllm-newer or full (see launch/agg.sh --help)
# The flags are checked before anything is installed; launch/agg.sh --help says more about each.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --once) args+=("$1"); shift ;;
    --http-port) need_value "$@"; check_port "$1" "$2"; args+=("$1" "$2"); shift 2 ;;
    --system-port) need_value "$@"; check_port "$1" "$2" 32767; args+=("$1" "$2"); shift 2 ;;
    --log-dir) need_value "$@"; args+=("$1" "$2"); shift 2 ;;
    --mock-profile) need_value "$@"; check_mock_profile "$2"; args+=("$1" "$2"); shift 2 ;;
    --) args+=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
bash "$root/launch/setup.sh"
exec bash "$root/launch/agg.sh" --demo ${args[@]+"${args[@]}"}
