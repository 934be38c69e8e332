#!/usr/bin/env bash
# Disaggregated serving (context-first, 1 prefill + 1 decode) on one machine, loopback only:
#   Dynamo frontend (HTTP) -> prefill openengine-sidecar -> prefill engine   (context phase, KV handoff)
#                          -> decode  openengine-sidecar -> decode engine    (pulls the KV cache, generates)
# The engines are two openengine-mock processes (--role prefill / --role decode) unless given.
#
# usage: launch/disagg.sh [--prefill-engine HOST:PORT --decode-engine HOST:PORT --model-path DIR]
#                         [--http-port N] [--system-ports P,D] [--demo] [--once] [-- extra openengine-sidecar flags]
#   --prefill-engine, --decode-engine  drive external engines instead of starting openengine-mock, e.g. TensorRT-LLM
#                       (each with cache_transceiver_config in its --extra_llm_api_options, which reports no role):
#                       trtllm-serve MODEL --grpc --grpc-protocol openengine --host 127.0.0.1 --port 50051|50052 ...
#                       (then also pass --model-path with that model's tokenizer directory)
#   --demo              stream one chat completion with curl once the model is listed, print it and which engine
#                       served which leg (openengine-mock's counters)
#   --once              with --demo: stop everything after the answer (exit status = the demo's)
# Ctrl-C or SIGTERM stops all processes (sidecars first, so they drain; then the engines; then the frontend) and
# removes the temporary directory.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -x "$root/.venv/bin/python" ] && . "$root/.venv/bin/activate"

prefill_engine="" decode_engine="" model_path="$root/sidecar/testing/mock/model" model_name="tiny-oe"
http_port=${DYN_HTTP_PORT:-8000} system_ports="8081,8082" demo=0 once=0 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --prefill-engine) prefill_engine=$2; shift 2 ;;
    --decode-engine) decode_engine=$2; shift 2 ;;
    --model-path) model_path=$2; shift 2 ;;
    --served-model-name) model_name=$2; shift 2 ;;
    --http-port) http_port=$2; shift 2 ;;
    --system-ports) system_ports=$2; shift 2 ;;
    --demo) demo=1; shift ;;
    --once) once=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "disagg.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
if { [ -n "$prefill_engine" ] && [ -z "$decode_engine" ]; } || { [ -z "$prefill_engine" ] && [ -n "$decode_engine" ]; }; then
  echo "disagg.sh: give both --prefill-engine and --decode-engine, or neither" >&2; exit 2
fi
prefill_system_port=${system_ports%,*} decode_system_port=${system_ports#*,}

. "$root/launch/_local.sh" disagg 150

python -m dynamo.frontend --http-host 127.0.0.1 --http-port "$http_port" --migration-limit 3 \
  >"$work/frontend.log" 2>&1 &
pids+=($!)

start_mock() {  # role -> prints HOST:PORT
  local role=$1
  openengine-mock --host 127.0.0.1 --port 0 --port-file "$work/$role-engine.port" --role "$role" \
    --served-model-name "$model_name" --model-dir "$model_path" >"$work/$role-engine.log" 2>&1 &
  pids+=($!)
}
if [ -z "$prefill_engine" ]; then
  start_mock prefill
  start_mock decode
  for _ in $(seq 1 300); do [ -s "$work/prefill-engine.port" ] && [ -s "$work/decode-engine.port" ] && break; sleep 0.1; done
  for role in prefill decode; do
    [ -s "$work/$role-engine.port" ] || { echo "disagg.sh: the $role openengine-mock did not start; log:" >&2;
      cat "$work/$role-engine.log" >&2; exit 1; }
  done
  prefill_engine=$(cat "$work/prefill-engine.port") decode_engine=$(cat "$work/decode-engine.port")
fi

# --disaggregation-mode gives the role to engines that report none (TensorRT-LLM); an engine that reports one must
# agree with it. The prefill worker registers under the `prefill` component, the decode worker under `backend`.
DYN_SYSTEM_PORT=$decode_system_port openengine-sidecar --grpc-endpoint "$decode_engine" --model-path "$model_path" \
  --served-model-name "$model_name" --disaggregation-mode decode "${extra[@]}" >"$work/decode-sidecar.log" 2>&1 &
pids+=($!)
DYN_SYSTEM_PORT=$prefill_system_port openengine-sidecar --grpc-endpoint "$prefill_engine" --model-path "$model_path" \
  --served-model-name "$model_name" --disaggregation-mode prefill "${extra[@]}" >"$work/prefill-sidecar.log" 2>&1 &
pids+=($!)

logs_in_order() { for f in frontend prefill-engine decode-engine decode-sidecar prefill-sidecar; do
  [ -f "$work/$f.log" ] && { echo "----- $f"; tail -n 30 "$work/$f.log"; }; done; }

request='{"model":"'"$model_name"'","messages":[{"role":"user","content":"Tell me about the river."}],"max_tokens":40,"stream":true}'
served=0
for _ in $(seq 1 600); do
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null || { echo "disagg.sh: a process exited early:" >&2; logs_in_order >&2; exit 1; }
  done
  # Listed is not enough: the model appears with the decode worker; a request needs the prefill worker too.
  if curl -fsS "http://127.0.0.1:$http_port/v1/models" 2>/dev/null | grep -q "\"$model_name\"" \
     && curl -fsS --max-time 10 "http://127.0.0.1:$http_port/v1/chat/completions" -H 'content-type: application/json' \
          -d '{"model":"'"$model_name"'","messages":[{"role":"user","content":"hi"}],"max_tokens":1}' >/dev/null 2>&1
  then served=1; break; fi
  sleep 0.2
done
[ $served = 1 ] || { echo "disagg.sh: model $model_name not served within 120 s" >&2; logs_in_order >&2; exit 1; }

echo "ready: prefill engine $prefill_engine, decode engine $decode_engine, frontend http://127.0.0.1:$http_port"
echo "       sidecar system ports: prefill $prefill_system_port, decode $decode_system_port"
echo "try:   curl -sN http://127.0.0.1:$http_port/v1/chat/completions -H 'content-type: application/json' -d '$request'"
if [ $demo = 1 ]; then
  set +e
  answer=$(curl -sSN --max-time 60 "http://127.0.0.1:$http_port/v1/chat/completions" \
    -H 'content-type: application/json' -d "$request")
  status=$?
  set -e
  text=$(printf '%s\n' "$answer" | sed -n 's/^data: //p' | grep -v '^\[DONE\]' \
    | python -c 'import json,sys; print("".join((c.get("delta") or {}).get("content") or "" for l in sys.stdin for c in json.loads(l).get("choices", [])))' 2>/dev/null || true)
  echo "answer (streamed): $text"
  if [ -n "$(ls "$work"/prefill-engine.port 2>/dev/null)" ]; then
    python - "$prefill_engine" "$decode_engine" <<'EOF' || status=1
import sys

import trio

from sidecar.convert.structjson import bp_struct_to_json
from sidecar.edge import open_edge
from sidecar.engine import EngineClientConfig, open_engine_client, parse_endpoint


async def main() -> None:
    for name, address in (("prefill engine", sys.argv[1]), ("decode engine", sys.argv[2])):
        config = EngineClientConfig(endpoint=parse_endpoint(address), connections=1)
        async with open_edge() as edge, open_engine_client(edge, config) as client:
            info, load = await client.get_server_info(), await client.get_load()
        stats = bp_struct_to_json(info.extra).get("mock_stats") if info.extra else {}
        legs = {k: v for k, v in (stats or {}).items() if k in ("prefill_legs", "decode_legs", "requests")}
        print(f"{name} {address}: {legs}, running {load.running_requests}, KV sessions {load.active_kv_sessions}")


trio.run(main)
EOF
  fi
  if [ $once = 1 ]; then
    { [ $status = 0 ] && [ -n "$text" ]; } || { logs_in_order >&2; exit 1; }
    exit 0
  fi
fi
echo "logs:  $work/{frontend,prefill-engine,decode-engine,prefill-sidecar,decode-sidecar}.log   (Ctrl-C stops everything)"
wait -n "${pids[@]}" || true
echo "disagg.sh: a process exited; stopping" >&2
logs_in_order >&2
exit 1
