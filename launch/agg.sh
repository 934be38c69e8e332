#!/usr/bin/env bash
# Aggregated serving on one machine, loopback only:
#   Dynamo frontend (HTTP) -> openengine-sidecar (Dynamo worker) -> OpenEngine engine (openengine-mock by default).
#
# usage: launch/agg.sh [--engine HOST:PORT --model-path DIR] [--http-port N] [--system-port N] [--demo] [--once]
#                      [-- extra openengine-sidecar flags]
#   --engine HOST:PORT  drive an external engine instead of starting openengine-mock, e.g. TensorRT-LLM:
#                       trtllm-serve MODEL --grpc --grpc-protocol openengine --host 127.0.0.1 --port 50051 --max_seq_len 4096
#                       (then also pass --model-path with that model's tokenizer directory)
#   --demo              send one chat completion with curl once the model is listed, and print the answer
#   --once              with --demo: stop everything after the answer (exit status = curl's)
# Ctrl-C or SIGTERM stops all processes (sidecar first, so it drains) and removes the temporary directory.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -x "$root/.venv/bin/python" ] && . "$root/.venv/bin/activate"

engine="" model_path="$root/sidecar/testing/mock/model" model_name="tiny-oe"
http_port=${DYN_HTTP_PORT:-8000} system_port=${DYN_SYSTEM_PORT:-8081} demo=0 once=0 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) engine=$2; shift 2 ;;
    --model-path) model_path=$2; shift 2 ;;
    --served-model-name) model_name=$2; shift 2 ;;
    --http-port) http_port=$2; shift 2 ;;
    --system-port) system_port=$2; shift 2 ;;
    --demo) demo=1; shift ;;
    --once) once=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "agg.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done

. "$root/launch/_local.sh" agg 100

python -m dynamo.frontend --http-host 127.0.0.1 --http-port "$http_port" --migration-limit 3 \
  >"$work/frontend.log" 2>&1 &
pids+=($!)

if [ -z "$engine" ]; then
  openengine-mock --host 127.0.0.1 --port 0 --port-file "$work/engine.port" --served-model-name "$model_name" \
    --model-dir "$model_path" >"$work/engine.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 300); do [ -s "$work/engine.port" ] && break; sleep 0.1; done
  [ -s "$work/engine.port" ] || { echo "agg.sh: openengine-mock did not start; log:" >&2; cat "$work/engine.log" >&2; exit 1; }
  engine=$(cat "$work/engine.port")
fi

DYN_SYSTEM_PORT=$system_port openengine-sidecar --grpc-endpoint "$engine" --model-path "$model_path" \
  --served-model-name "$model_name" "${extra[@]}" >"$work/sidecar.log" 2>&1 &
pids+=($!)

listed=0
for _ in $(seq 1 600); do
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null || { echo "agg.sh: a process exited early; logs in order frontend, engine, sidecar:" >&2;
      tail -n 30 "$work"/*.log >&2; exit 1; }
  done
  if curl -fsS "http://127.0.0.1:$http_port/v1/models" 2>/dev/null | grep -q "\"$model_name\""; then listed=1; break; fi
  sleep 0.2
done
[ $listed = 1 ] || { echo "agg.sh: model $model_name not listed within 120 s" >&2; tail -n 30 "$work"/*.log >&2; exit 1; }

request='{"model":"'"$model_name"'","messages":[{"role":"user","content":"Tell me about the river."}],"max_tokens":40}'
echo "ready: engine $engine, frontend http://127.0.0.1:$http_port, sidecar system port $system_port"
echo "try:   curl -s http://127.0.0.1:$http_port/v1/chat/completions -H 'content-type: application/json' -d '$request'"
if [ $demo = 1 ]; then
  set +e
  answer=$(curl -sS --max-time 60 "http://127.0.0.1:$http_port/v1/chat/completions" \
    -H 'content-type: application/json' -d "$request")
  status=$?
  set -e
  echo "answer: $answer"
  if [ $once = 1 ]; then
    [ $status = 0 ] && echo "$answer" | grep -q '"choices"' || { tail -n 30 "$work"/*.log >&2; exit 1; }
    exit 0
  fi
fi
echo "logs:  $work/{frontend,engine,sidecar}.log   (Ctrl-C stops everything)"
wait -n "${pids[@]}" || true
echo "agg.sh: a process exited; stopping" >&2
tail -n 30 "$work"/*.log >&2
exit 1
