# Shared by the single-machine launchers (agg*.sh, disagg*.sh): each sources it, names its parsers (parse_flags) and
# hands the rest to run_local; a launcher is its --help header and those lines.
#
# It gives them (with _common.sh, which cluster.sh shares): one parser for the flags they share (common_flag), clear
# one-line refusals of bad flags, a log directory that outlives the run, the loopback-only file-discovery Dynamo
# environment, starters for the frontend, openengine-mock and openengine-sidecar that remember every child, readiness
# waits on each worker's /health, the one-request smoke of --demo/--once (launch/_demo.py), and a clean stop in tiers:
# sidecars first (they deregister and drain while their engines still run), then the engines, then the frontend; each
# tier gets SIGTERM, a grace period, then SIGKILL. With --once the exit status is 0 only if the answer was right, the
# engines were idle after it and every process exited 0 on SIGTERM.
[ "${BASH_SOURCE[0]}" != "$0" ] || { echo "$(basename "$0"): sourced by the launchers, not run" >&2; exit 2; }
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

# Shared flags and their defaults; each launcher adds its own.
model_path="$root/sidecar/testing/mock/model" model_given=0 model_name="" http_port=${DYN_HTTP_PORT:-8000}
log_dir="" demo=0 once=0 extra=() mock_profile_given=0
# The demo engines' openengine-mock profile (--mock-profile): TensorRT-LLM's merged server by default, whose guided
# decoding is xgrammar's (JSON schema, JSON object, regex, EBNF, structural tag), so the OpenAI SDK's structured
# output works on the demo; full is the richer engine, whose guided decoding has JSON object and choice only.
mock_profile=trtllm

# common_flag ARGS...: one of the shared flags at $1; sets `taken` to the number of words it used.
common_flag() {
  case "$1" in
    --model-path) need_value "$@"; model_path=$2; model_given=1; taken=2 ;;
    --served-model-name) need_value "$@"; model_name=$2; taken=2 ;;
    --http-port) need_value "$@"; check_port "$1" "$2"; http_port=$2; taken=2 ;;
    --log-dir) need_value "$@"; log_dir=$2; taken=2 ;;
    --mock-profile) need_value "$@"; check_mock_profile "$2"; mock_profile=$2; mock_profile_given=1; taken=2 ;;
    --demo) demo=1; taken=1 ;;
    --once) once=1; taken=1 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
}

# agg_flag ARGS...: the flags of the aggregated launchers, then the shared ones.
engine="" system_port=8081
agg_flag() {
  case "$1" in
    --engine) need_value "$@"; engine=$2; taken=2 ;;
    --system-port) need_value "$@"; check_port "$1" "$2" 32767; system_port=$2; taken=2 ;;
    *) common_flag "$@" ;;
  esac
}

# disagg_flag ARGS...: the flags of the disaggregated launchers, then the shared ones.
prefill_engine="" decode_engine="" system_ports="8081,8082"
disagg_flag() {
  case "$1" in
    --prefill-engine) need_value "$@"; prefill_engine=$2; taken=2 ;;
    --decode-engine) need_value "$@"; decode_engine=$2; taken=2 ;;
    --system-ports) need_value "$@"; system_ports=$2; taken=2 ;;
    *) common_flag "$@" ;;
  esac
}

# check_agg / check_disagg: after parsing; the ports must be free.
check_agg() {
  check_engines "$([ -n "$engine" ] && echo 1 || echo 0)"
  port_free --http-port "$http_port"
  port_free --system-port "$system_port"
}
check_disagg() {
  parse_system_ports "$system_ports"
  if [ -n "$prefill_engine$decode_engine" ] && { [ -z "$prefill_engine" ] || [ -z "$decode_engine" ]; }; then
    die "give both --prefill-engine and --decode-engine, or neither"
  fi
  check_engines "$([ -n "$prefill_engine" ] && echo 1 || echo 0)"
  port_free --http-port "$http_port"
  port_free --system-ports "$prefill_system_port"
  port_free --system-ports "$decode_system_port"
}

# check_engines GIVEN: after parsing. GIVEN=1 when real engines were named: they need the model's tokenizer directory
# and exclude --demo; otherwise the demo engines serve the packaged tiny model.
check_engines() {
  if [ "$1" = 1 ]; then
    [ $demo = 0 ] || die "--demo starts openengine-mock engines; drop it to use your own engines"
    [ $mock_profile_given = 0 ] || die "--mock-profile sets up the demo's openengine-mock engines; drop it to use your own engines"
    [ $model_given = 1 ] || die "a real engine needs --model-path DIR (its tokenizer and chat template)"
    [ -d "$model_path" ] || die "--model-path: not a directory: $model_path"
    [ -n "$model_name" ] || model_name=$(basename "$model_path")
  else
    [ -n "$model_name" ] || model_name=tiny-oe
  fi
  check_port --http-port "$http_port"
}

# port_free FLAG PORT: refuse a port that something on this machine already listens on.
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$2") 2>/dev/null || die "$1: port $2 is already in use on 127.0.0.1"; }

# open_run NAME: the scratch directory (discovery files, HOME; removed at the end), the log directory (kept), the
# traps and the Dynamo environment.
open_run() {
  open_dirs "$1"
  trap stop_all EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  # Everything on loopback, discovery in files under the scratch directory, caches out of $HOME.
  export DYN_DISCOVERY_BACKEND=file DYN_FILE_KV="$work/discovery" DYN_REQUEST_PLANE=tcp DYN_EVENT_PLANE=zmq
  export DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1 DYN_EVENT_PLANE_HOST=127.0.0.1
  export DYN_HTTP_HOST=127.0.0.1 DYN_SYSTEM_HOST=127.0.0.1 HOME="$work/home" HF_HUB_OFFLINE=1
  mkdir -p "$DYN_FILE_KV" "$HOME"
  echo "logs:  $logs/ (kept when everything stops)"
}

# Children, in start order: name, pid, stop tier (1 sidecars, 2 engines, 3 frontend), exit status once known.
names=() pids=() tiers=() codes=()
tier_grace=(0 45 10 10)   # seconds per tier; a sidecar's default drain budget is 30 s (+ 2 s of aborts)

# spawn NAME TIER CMD...: start CMD in the background; its output goes to $logs/NAME.log. Each child gets a process
# group of its own (set -m, for that one start): a Ctrl-C in the terminal then reaches only this script, whose
# stop_all stops the children in order -- otherwise the sidecars and their engines would all get it at once, and a
# sidecar could not confirm its engine idle before the engine was gone.
spawn() {
  local name=$1 tier=$2; shift 2
  set -m
  "$@" >"$logs/$name.log" 2>&1 &
  set +m
  names+=("$name") pids+=($!) tiers+=("$tier") codes+=("")
}

stop_all() {
  local status=$? tier i left deadline summary="" unclean="" verdict clean
  local -a killed=()
  trap - EXIT INT TERM
  set +e   # a child that is already gone must not end the clean-up half-way
  for tier in 1 2 3; do
    for i in "${!pids[@]}"; do
      [ "${tiers[$i]}" = "$tier" ] && [ -z "${codes[$i]}" ] && kill -TERM "${pids[$i]}" 2>/dev/null
    done
    deadline=$((SECONDS + ${tier_grace[$tier]}))
    while :; do
      left=0
      for i in "${!pids[@]}"; do
        [ "${tiers[$i]}" = "$tier" ] && [ -z "${codes[$i]}" ] && kill -0 "${pids[$i]}" 2>/dev/null && left=1
      done
      [ $left = 0 ] || [ $SECONDS -ge $deadline ] && break
      sleep 0.1
    done
    for i in "${!pids[@]}"; do
      [ "${tiers[$i]}" = "$tier" ] && [ -z "${codes[$i]}" ] || continue
      killed[$i]=0
      if kill -KILL "${pids[$i]}" 2>/dev/null; then
        killed[$i]=1
        echo "$script: ${names[$i]} did not stop within ${tier_grace[$tier]} s; killed" >&2
      fi
      codes[$i]=0; wait "${pids[$i]}" 2>/dev/null || codes[$i]=$?
    done
  done
  rm -rf "$work"
  for i in "${!pids[@]}"; do
    # Every child here stops with status 0 on SIGTERM; one that ended before the stop (killed[i] unset) is judged
    # by its status alone.
    stop_verdict "${names[$i]}" "${codes[$i]}" TERM "${killed[$i]:-0}"
    summary+="${summary:+, }$verdict"
    [ "$clean" = 1 ] || unclean+="${unclean:+, }$verdict"
    echo "${names[$i]} ${codes[$i]}" >>"$logs/exit-status"
  done
  end_stop "$status" "$summary" "$unclean"
}

tail_logs() { for i in "${!names[@]}"; do echo "----- ${names[$i]} ($logs/${names[$i]}.log)"; tail -n 25 "$logs/${names[$i]}.log"; done; }

# check_alive: stop, with the logs, when a child exited before its time.
check_alive() {
  local i
  for i in "${!pids[@]}"; do
    [ -z "${codes[$i]}" ] && ! kill -0 "${pids[$i]}" 2>/dev/null || continue
    codes[$i]=0; wait "${pids[$i]}" 2>/dev/null || codes[$i]=$?
    echo "$script: ${names[$i]} exited early (status ${codes[$i]}); the logs:" >&2
    tail_logs >&2
    exit 1
  done
}

# wait_until WHAT SECONDS CMD...: poll CMD every 0.2 s while every child lives.
wait_until() {
  local what=$1 limit=$2 deadline=$((SECONDS + $2)); shift 2
  until "$@"; do
    check_alive
    [ $SECONDS -lt $deadline ] || { echo "$script: $what: not within $limit s; the logs:" >&2; tail_logs >&2; exit 1; }
    sleep 0.2
  done
}

healthy() { [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$1/health")" = 200 ]; }
# routes_to COMPONENT: the frontend's /health lists a generate endpoint of that component (e.g. prefill workers).
routes_to() {
  curl -fsS --max-time 2 "http://127.0.0.1:$http_port/health" 2>/dev/null \
    | grep -q "\"component\":\"$1\",\"endpoint\":\"generate\""
}
listed() { curl -fsS --max-time 2 "http://127.0.0.1:$http_port/v1/models" 2>/dev/null | grep -q "\"id\":\"$1\""; }

# The frontend retries a request whose worker fails mid-way on another worker up to --migration-limit times.
# Dynamo's default, 0, turns every worker crash into client errors: a SIGKILLed worker stays registered until its
# lease runs out, and each request routed to it in that window fails (docs/distributed.md).
start_frontend() {
  spawn frontend 3 python -m dynamo.frontend --http-host 127.0.0.1 --http-port "$http_port" --migration-limit 3 "$@"
}

# start_mock NAME [openengine-mock flags...]: an openengine-mock on an OS-picked loopback port; sets `engine`. Every
# demo engine has guided decoding on (its profile's modes) and --load-report full: the smoke's check that the engines
# hold nothing after the answer reads queued requests and KV sessions, which TensorRT-LLM's GetLoad (running requests
# only) does not report (docs/mock.md, "Profiles").
start_mock() {
  local name=$1; shift
  spawn "$name" 2 openengine-mock --host 127.0.0.1 --port 0 --port-file "$work/$name.port" \
    --served-model-name "$model_name" --model-dir "$model_path" \
    --profile "$mock_profile" --capability guided=true --load-report full "$@"
  wait_until "$name listening" 60 test -s "$work/$name.port"
  engine=$(cat "$work/$name.port")
}

# start_sidecar NAME SYSTEM_PORT ENGINE [openengine-sidecar flags...]: the worker; extra flags after `--` come last.
start_sidecar() {
  local name=$1 port=$2 address=$3; shift 3
  spawn "$name" 1 env DYN_SYSTEM_PORT="$port" openengine-sidecar --grpc-endpoint "$address" \
    --model-path "$model_path" --served-model-name "$model_name" "$@" ${extra[@]+"${extra[@]}"}
}

# parse_system_ports P,D: the disaggregated launchers' two system ports.
parse_system_ports() {
  [[ $1 == *,* ]] || die "--system-ports: expected PREFILL,DECODE (two port numbers), got '$1'"
  prefill_system_port=${1%%,*} decode_system_port=${1#*,}
  check_port --system-ports "$prefill_system_port" 32767
  check_port --system-ports "$decode_system_port" 32767
  [ "$prefill_system_port" != "$decode_system_port" ] || die "--system-ports: the two ports must differ, got '$1'"
}

# Feature flags of the launcher for every demo engine and every sidecar (e.g. --capability lora=true, --lora-root).
mock_args=() sidecar_args=()

# start_agg_worker ENGINE SYSTEM_PORT: one engine (openengine-mock when ENGINE is empty) and its sidecar; sets
# `engine`.
mock_engines=0
start_agg_worker() {
  engine=$1
  [ -n "$engine" ] || { start_mock engine ${mock_args[@]+"${mock_args[@]}"}; mock_engines=1; }
  start_sidecar sidecar "$2" "$engine" ${sidecar_args[@]+"${sidecar_args[@]}"}
  wait_until "the sidecar's /health on port $2" 120 healthy "$2"
  wait_until "model $model_name listed by the frontend" 60 listed "$model_name"
}

# start_disagg_workers: a prefill and a decode engine (openengine-mock unless given) and a sidecar for each, ready
# when both sidecars' /health say so and the frontend knows both workers.
start_disagg_workers() {
  if [ -z "$prefill_engine" ]; then
    start_mock prefill-engine --role prefill ${mock_args[@]+"${mock_args[@]}"}
    prefill_engine=$engine
    start_mock decode-engine --role decode ${mock_args[@]+"${mock_args[@]}"}
    decode_engine=$engine
    mock_engines=1
  fi
  # --disaggregation-mode gives the role to engines that report none (TensorRT-LLM); an engine that reports one
  # must agree with it. The prefill worker registers under the `prefill` component, the decode worker under `backend`.
  start_sidecar decode-sidecar "$decode_system_port" "$decode_engine" --disaggregation-mode decode \
    ${sidecar_args[@]+"${sidecar_args[@]}"}
  start_sidecar prefill-sidecar "$prefill_system_port" "$prefill_engine" --disaggregation-mode prefill \
    ${sidecar_args[@]+"${sidecar_args[@]}"}
  wait_until "the decode sidecar's /health on port $decode_system_port" 120 healthy "$decode_system_port"
  wait_until "the prefill sidecar's /health on port $prefill_system_port" 120 healthy "$prefill_system_port"
  wait_until "model $model_name listed by the frontend" 60 listed "$model_name"
  # The model is listed with the decode worker; a request also needs the frontend to know a prefill worker.
  wait_until "the frontend discovering the prefill worker" 60 routes_to prefill
}

url() { echo "http://127.0.0.1:$http_port"; }

# LoRA launchers: --lora-root DIR, --adapter DIR, --adapter-name NAME (lora_flag), checked by check_lora; the demo
# makes a tiny adapter on the spot (make_demo_adapter); load_adapter loads it through each worker's documented
# control, POST /engine/load_lora on its system port (docs/lora.md), and waits until the frontend lists it.
lora_root="" adapter="" adapter_name=""
lora_flag() {
  case "$1" in
    --lora-root) need_value "$@"; lora_root=$2; taken=2 ;;
    --adapter) need_value "$@"; adapter=$2; taken=2 ;;
    --adapter-name) need_value "$@"; adapter_name=$2; taken=2 ;;
    *) taken=0 ;;
  esac
}
check_lora() {  # REAL: 1 when real engines were named
  if [ "$1" = 1 ]; then
    [ -n "$lora_root" ] || die "a real engine needs --lora-root DIR (the directory adapters are loaded from)"
    [ -n "$adapter" ] || die "a real engine needs --adapter DIR (an adapter directory inside --lora-root)"
  fi
  if [ -n "$lora_root" ]; then
    [ -d "$lora_root" ] || die "--lora-root: not a directory: $lora_root"
    lora_root=$(cd "$lora_root" && pwd)
  fi
  if [ -n "$adapter" ]; then
    [ -f "$adapter/adapter_config.json" ] || die "--adapter: no adapter_config.json in $adapter"
    adapter=$(cd "$adapter" && pwd)
    [ -n "$lora_root" ] || die "--adapter needs --lora-root (the sidecar loads adapters only from inside it)"
  fi
}
make_demo_adapter() {  # after open_run
  [ -n "$lora_root" ] || { lora_root="$work/loras"; mkdir -p "$lora_root"; }
  [ -n "$adapter" ] || { adapter="$lora_root/tiny-lora"; demo_py adapter "$adapter"; }
  [ -n "$adapter_name" ] || adapter_name=$(basename "$adapter")
}
load_adapter() {  # SYSTEM_PORT...
  local port
  for port in "$@"; do
    demo_py load-lora "http://127.0.0.1:$port" "$adapter_name" "$adapter" || exit 1
  done
  wait_until "adapter $adapter_name listed by the frontend" 60 listed "$adapter_name"
}

# print_ready KIND: where everything is and a request to try.
print_ready() {
  if [ -n "$prefill_engine" ]; then
    echo "ready: prefill engine $prefill_engine, decode engine $decode_engine, frontend $(url)"
    echo "       sidecar system ports: prefill $prefill_system_port, decode $decode_system_port"
  else
    echo "ready: engine $engine, frontend $(url), sidecar system port $system_port"
  fi
  case "$1" in
    text) echo "try:   curl -sN $(url)/v1/chat/completions -H 'content-type: application/json' \\"
          echo "         -d '{\"model\":\"$2\",\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"Tell me about the river.\"}]}'"
          echo "       structured output (OpenAI's response_format; json_schema needs an engine with xgrammar's modes):"
          echo "       curl -s $(url)/v1/chat/completions -H 'content-type: application/json' \\"
          echo "         -d '{\"model\":\"$2\",\"max_tokens\":200,\"messages\":[{\"role\":\"user\",\"content\":\"Where is the river?\"}],\"response_format\":{\"type\":\"json_object\"}}'" ;;
    image-video|audio) echo "try:   python launch/_demo.py ask $(url) $2 --kind $1$([ $mock_engines = 1 ] && echo ' --placeholders')" ;;
  esac
}

# smoke KIND [MODEL [LABEL]]: one fitting request through the frontend, printed (launch/_demo.py ask).
smoke() {
  local placeholders=()
  [ $mock_engines = 1 ] && placeholders=(--placeholders)
  demo_py ask "$(url)" "${2:-$model_name}" --kind "$1" --label "${3:-answer}" ${placeholders[@]+"${placeholders[@]}"}
}

# engines_idle: each engine's own view after the answer; fails unless nothing runs and no KV session is held.
engines_idle() {
  if [ -n "$prefill_engine" ]; then
    demo_py engines prefill-engine="$prefill_engine" decode-engine="$decode_engine"
  else
    demo_py engines engine="$engine"
  fi
}

# serve: keep running until Ctrl-C/SIGTERM, or until a child exits by itself.
serve() {
  echo "serving; Ctrl-C stops everything (sidecars first, so they drain)"
  local gone="" status=0 i
  wait -n -p gone "${pids[@]}" || status=$?
  for i in "${!pids[@]}"; do
    [ "${pids[$i]}" = "$gone" ] || continue
    codes[$i]=$status
    echo "$script: ${names[$i]} exited by itself (status $status); the logs:" >&2
  done
  tail_logs >&2
  exit 1
}

demo_py() { python "$root/launch/_demo.py" --report "$logs/report.json" "$@"; }

# parse_flags PARSER... -- ARGS...: each argument goes to the first PARSER that takes it (lora_flag passes on what
# it does not know; agg_flag and disagg_flag refuse it); words after a `--` in ARGS are extra sidecar flags.
parse_flags() {
  local -a parsers=()
  local parser
  while [ "$1" != -- ]; do parsers+=("$1"); shift; done
  shift
  while [ $# -gt 0 ]; do
    [ "$1" != -- ] || { shift; extra=("$@"); return; }
    for parser in "${parsers[@]}"; do
      taken=0
      "$parser" "$@"
      [ "$taken" = 0 ] || break
    done
    shift "$taken"
  done
}

# run_local agg|disagg NAME KIND [--lora]: the run after parse_flags: check the flags, open the run NAME, start the
# frontend, the engines (openengine-mock with mock_args unless given) and their sidecars. --lora: with an adapter
# (lora_flag's flags; the demo makes one) loaded on every worker. --demo/--once: one KIND request (text, image-video,
# audio) through the frontend, under the adapter's name with --lora; --lora --once then asks the base model too (the
# answers must differ on openengine-mock); the engines must then be idle (not checked for --lora --demo). --once
# stops there; otherwise serve until Ctrl-C.
run_local() {
  local mode=$1 name=$2 kind=$3 lora="" served
  local -a ports
  [ "${4:-}" != --lora ] || lora=1
  if [ "$mode" = agg ]; then
    check_agg
    ports=("$system_port")
  else
    check_disagg
    ports=("$prefill_system_port" "$decode_system_port")
  fi
  [ -z "$lora" ] || check_lora "$([ -n "$engine$prefill_engine" ] && echo 1 || echo 0)"
  open_run "$name"
  if [ -n "$lora" ]; then
    make_demo_adapter
    mock_args=(--capability lora=true)
    sidecar_args=(--lora-root "$lora_root")
  fi
  start_frontend
  if [ "$mode" = agg ]; then start_agg_worker "$engine" "$system_port"; else start_disagg_workers; fi
  served=$model_name
  if [ -n "$lora" ]; then
    load_adapter "${ports[@]}"
    served=$adapter_name
  fi
  print_ready "$kind" "$served"
  if [ $demo = 1 ] || [ $once = 1 ]; then
    smoke "$kind" "$served" ${lora:+adapter} || exit 1
    if [ -z "$lora" ]; then
      engines_idle || exit 1
    elif [ $once = 1 ]; then
      smoke "$kind" "$model_name" base || exit 1
      demo_py differs adapter base $([ $mock_engines = 1 ] && echo --required) || exit 1
      engines_idle || exit 1
    fi
  fi
  [ $once = 1 ] && exit 0
  serve
}
