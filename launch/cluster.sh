#!/usr/bin/env bash
# Scale-out on Dynamo's distributed control plane, on one machine:
#   etcd (discovery) + NATS (request and event planes), two Dynamo frontends, three openengine-sidecar workers, each
#   with its own openengine-mock engine. As root, every role runs on its own test host (a network namespace, joined
#   to the others and to this shell by veth pairs on one bridge); otherwise everything runs on loopback (the reason is
#   printed). See docs/distributed.md.
#
# usage: launch/cluster.sh [--loopback] [--frontends N] [--workers N] [--demo] [--once] [--log-dir DIR]
#                          [--etcd-port N] [--nats-port N] [--http-port N] [--system-port N] [--engine-port N]
#                          [--mock-profile NAME] [-- extra openengine-sidecar flags]
#   --loopback         do not create network namespaces even when possible
#   --frontends N      frontends (1-9, default 2)
#   --workers N        workers (1-9, default 3)
#   --demo             send one chat completion through every frontend once every worker is ready, print the answers
#   --once             with --demo: stop everything after the answers (exit status 0 if every answer came back and
#                      every process stopped cleanly)
#   --log-dir DIR      write every process's log there (default: a new temporary directory); kept on exit
#   --etcd-port N      etcd's client port (default 2379; its peer port is the next one)
#   --nats-port N      NATS's port (default 4222)
#   --http-port N      the frontends' HTTP port (default 8000)
#   --system-port N    the sidecars' system port: /health, /live, /metrics (default 8081; at most 32767)
#   --engine-port N    the engines' gRPC port (default 50051)
#                      Each host has its own address in namespaces, so every frontend, sidecar and engine uses the
#                      same port there; on loopback the k-th frontend, sidecar and engine use the port + k - 1.
#   --mock-profile NAME
#                      the engines' openengine-mock profile (docs/mock.md, "Profiles"): trtllm (default),
#                      TensorRT-LLM's merged server (guided decoding by xgrammar: JSON schema, JSON object, ...),
#                      trtllm-newer, or full (guided decoding: JSON object and choice only); KV events over gRPC
#                      in every case, so the frontends route by the cached prefix
# Like a supervisor, the script restarts any process that exits (try `kill -9` on etcd, NATS, a frontend or a
# sidecar; `ps` shows them). Ctrl-C or SIGTERM stops everything in tiers: the sidecars first (they deregister and
# drain while etcd, NATS and their engines still run), then the frontends and engines, then NATS and etcd; then the
# namespaces go. Needs: apt-get install -y etcd-server nats-server
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

frontends=2 workers=3 demo=0 once=0 loopback=0 log_dir="" extra=() mock_profile=trtllm
etcd_port=2379 nats_port=4222 http_port=8000 system_port=8081 engine_port=50051
model_path="$root/sidecar/testing/mock/model" model_name="tiny-oe"
while [ $# -gt 0 ]; do
  case "$1" in
    --loopback) loopback=1; shift ;;
    --frontends) need_value "$@"; frontends=$2; shift 2 ;;
    --workers) need_value "$@"; workers=$2; shift 2 ;;
    --demo) demo=1; shift ;;
    --once) once=1; shift ;;
    --log-dir) need_value "$@"; log_dir=$2; shift 2 ;;
    --etcd-port) need_value "$@"; check_port "$1" "$2" 65534; etcd_port=$2; shift 2 ;;
    --nats-port) need_value "$@"; check_port "$1" "$2"; nats_port=$2; shift 2 ;;
    --http-port) need_value "$@"; check_port "$1" "$2"; http_port=$2; shift 2 ;;
    --system-port) need_value "$@"; check_port "$1" "$2" 32767; system_port=$2; shift 2 ;;
    --engine-port) need_value "$@"; check_port "$1" "$2"; engine_port=$2; shift 2 ;;
    --mock-profile) need_value "$@"; check_mock_profile "$2"; mock_profile=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
[[ $frontends =~ ^[1-9]$ && $workers =~ ^[1-9]$ ]] || die "--frontends/--workers take 1-9"
[ $((http_port + frontends - 1)) -le 65535 ] || die "--http-port: $frontends frontends need ports up to $((http_port + frontends - 1))"
[ $((system_port + workers - 1)) -le 32767 ] || die "--system-port: $workers workers need ports up to $((system_port + workers - 1)) (at most 32767)"
[ $((engine_port + workers - 1)) -le 65535 ] || die "--engine-port: $workers workers need ports up to $((engine_port + workers - 1))"

etcd_bin=$(command -v etcd || true) nats_bin=$(command -v nats-server || echo /usr/sbin/nats-server)
[ -n "$etcd_bin" ] && [ -x "$nats_bin" ] || {
  echo "cluster.sh: etcd and nats-server are needed: apt-get install -y etcd-server nats-server" >&2; exit 1; }

open_dirs cluster
tag="oe$$x$(printf '%04x' $((RANDOM % 65536)))"
namespaces=() root_link=""
declare -A pid cmd hostof code

# --- hosts ----------------------------------------------------------------------------------------------------------
hosts=(cp)
for i in $(seq 1 "$frontends"); do hosts+=("fe$i"); done
for i in $(seq 1 "$workers"); do hosts+=("w$i"); done
declare -A addr ns
octet() { case "$1" in cp) echo 1 ;; fe*) echo $((10 + ${1#fe})) ;; w*) echo $((20 + ${1#w})) ;; esac; }

netns_reason() {
  [ $loopback = 1 ] && { echo "--loopback"; return; }
  [ "$(id -u)" = 0 ] || { echo "not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"; return; }
  command -v ip >/dev/null || { echo "iproute2's ip is not installed"; return; }
  if ! { ip netns add "$tag-probe" && ip -n "$tag-probe" link add br0 type bridge; } >/dev/null 2>&1; then
    ip netns del "$tag-probe" 2>/dev/null || true; echo "cannot create network namespaces here"; return
  fi
  ip netns del "$tag-probe"
}
reason=$(netns_reason)
if [ -z "$reason" ]; then
  subnet="198.18.$((RANDOM % 254 + 1))"   # RFC 2544 benchmarking range; only our own namespaces use it
  ip netns add "$tag-sw"; namespaces+=("$tag-sw")
  ip -n "$tag-sw" link add br0 type bridge && ip -n "$tag-sw" link set br0 up
  n=0
  for h in "${hosts[@]}"; do
    ns[$h]="$tag-$h"; addr[$h]="$subnet.$(octet "$h")"
    ip netns add "${ns[$h]}"; namespaces+=("${ns[$h]}")
    ip link add eth0 netns "${ns[$h]}" type veth peer name "p$n" netns "$tag-sw"
    ip -n "$tag-sw" link set "p$n" master br0 && ip -n "$tag-sw" link set "p$n" up
    ip -n "${ns[$h]}" addr add "${addr[$h]}/24" dev eth0
    ip -n "${ns[$h]}" link set eth0 up && ip -n "${ns[$h]}" link set lo up
    n=$((n + 1))
  done
  root_link="${tag}h"
  ip link add "$root_link" type veth peer name proot netns "$tag-sw"
  ip -n "$tag-sw" link set proot master br0 && ip -n "$tag-sw" link set proot up
  ip addr add "$subnet.254/24" dev "$root_link" && ip link set "$root_link" up
  echo "hosts: network namespaces on $subnet.0/24 ($(for h in "${hosts[@]}"; do printf '%s=%s ' "$h" "${addr[$h]}"; done))"
else
  for h in "${hosts[@]}"; do ns[$h]=""; addr[$h]=127.0.0.1; done
  echo "hosts: all on loopback ($reason)"
fi

# --- ports (the same on every host inside namespaces; offsets on shared loopback) -----------------------------------
cpa=${addr[cp]}
etcd_url="http://$cpa:$etcd_port" nats_url="nats://$cpa:$nats_port" etcd_peer="http://127.0.0.1:$((etcd_port + 1))"
fe_port() { if [ -n "${ns[fe1]}" ]; then echo "$http_port"; else echo $((http_port + ${1#fe} - 1)); fi; }
sys_port() { if [ -n "${ns[w1]}" ]; then echo "$system_port"; else echo $((system_port + ${1#w} - 1)); fi; }
eng_port() { if [ -n "${ns[w1]}" ]; then echo "$engine_port"; else echo $((engine_port + ${1#w} - 1)); fi; }

# How each process is stopped cleanly: SIGTERM, except NATS, which ends with status 1 on SIGTERM and 0 on SIGINT (its
# clean stop); etcd stops on SIGTERM by re-raising it (status 143), which is its clean stop. Every other process
# ends with 0.
declare -A stop_signal=([nats]=INT) dies_by_signal=([etcd]=1)

# stop_all: in tiers, each its stop signal, up to 45 s (the sidecars' drain budget) or 10 s, then SIGKILL. The exit
# status of each decides the script's (stop_verdict, end_stop).
stop_all() {
  local status=$? p left deadline tier killed unclean="" summary="" verdict clean
  trap - EXIT INT TERM
  set +e   # a process that is already gone must not end the clean-up half-way
  local -a tier1=() tier2=() tier3=(nats etcd)
  for h in "${hosts[@]}"; do [[ $h == w* ]] && tier1+=("sidecar-$h") && tier2+=("engine-$h"); done
  for h in "${hosts[@]}"; do [[ $h == fe* ]] && tier2+=("$h"); done
  for tier in 1 2 3; do
    local -n members="tier$tier"
    for p in "${members[@]}"; do
      [ -n "${pid[$p]:-}" ] && kill -"${stop_signal[$p]:-TERM}" "${pid[$p]}" 2>/dev/null
    done
    deadline=$((SECONDS + $([ $tier = 1 ] && echo 45 || echo 10)))
    while :; do
      left=0
      for p in "${members[@]}"; do [ -n "${pid[$p]:-}" ] && kill -0 "${pid[$p]}" 2>/dev/null && left=1; done
      [ $left = 0 ] || [ $SECONDS -ge $deadline ] && break
      sleep 0.1
    done
    for p in "${members[@]}"; do
      [ -n "${pid[$p]:-}" ] || continue
      killed=0
      kill -KILL "${pid[$p]}" 2>/dev/null && killed=1 && echo "cluster.sh: $p did not stop in time; killed" >&2
      code[$p]=0; wait "${pid[$p]}" 2>/dev/null || code[$p]=$?
      stop_verdict "$p" "${code[$p]}" "${stop_signal[$p]:-TERM}" "$killed" "${dies_by_signal[$p]:-0}"
      summary+="${summary:+, }$verdict"
      [ "$clean" = 1 ] || unclean+="${unclean:+, }$verdict"
    done
    unset -n members
  done
  [ -n "$root_link" ] && ip link del "$root_link" 2>/dev/null
  for n in "${namespaces[@]}"; do ip netns del "$n" 2>/dev/null; done
  rm -rf "$work"
  end_stop "$status" "$summary" "$unclean"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Dynamo's variables, shared by every frontend and worker (each process adds its own host's listener addresses).
export DYN_DISCOVERY_BACKEND=etcd ETCD_ENDPOINTS="$etcd_url" DYN_REQUEST_PLANE=nats DYN_EVENT_PLANE=nats
export NATS_SERVER="$nats_url" HOME="$work/home" HF_HUB_OFFLINE=1
mkdir -p "$HOME"
echo "logs:  $logs/ (kept when everything stops)"

# start NAME HOST CMD...: run CMD on HOST in the background (remembered for restarts), log to $logs/NAME.log. Every
# Dynamo listener of the process binds its own host's address.
start() {
  local name=$1 host=$2; shift 2
  hostof[$name]=$host; cmd[$name]=$(printf '%q ' "$@")
  local a=${addr[$host]}
  [ -n "${ns[$host]}" ] && set -- ip netns exec "${ns[$host]}" "$@"
  # env and `ip netns exec` both exec: $! is the process itself, so signals reach it. A process group of its own
  # (set -m for this start): a Ctrl-C in the terminal reaches only this script, which stops everything in order.
  set -m
  env DYN_TCP_RPC_HOST="$a" DYN_TCP_RESPONSE_STREAM_HOST="$a" DYN_EVENT_PLANE_HOST="$a" DYN_SYSTEM_HOST="$a" \
    DYN_HTTP_HOST="$a" "$@" >>"$logs/$name.log" 2>&1 &
  pid[$name]=$!
  set +m
}
restart() {
  echo "cluster.sh: $1 exited; restarting it"
  eval "start \"\$1\" \"\${hostof[\$1]}\" ${cmd[$1]}"
}

wait_for() { local what=$1 test=$2; for _ in $(seq 1 1200); do eval "$test" && return 0; sleep 0.1; done
  echo "cluster.sh: $what did not come up; logs:" >&2; tail -n 20 "$logs"/*.log >&2; exit 1; }

start etcd cp env -u ETCD_ENDPOINTS "$etcd_bin" --name oe-cp --data-dir "$work/etcd" --listen-client-urls "$etcd_url" \
  --advertise-client-urls "$etcd_url" --listen-peer-urls "$etcd_peer" \
  --initial-advertise-peer-urls "$etcd_peer" --initial-cluster "oe-cp=$etcd_peer" \
  --logger zap --log-level warn --auto-compaction-mode periodic --auto-compaction-retention 5m
start nats cp "$nats_bin" -a "$cpa" -p "$nats_port" -js -sd "$work/nats"
wait_for etcd "curl -fsS '$etcd_url/health' 2>/dev/null | grep -q true"
wait_for NATS "(exec 3<>/dev/tcp/$cpa/$nats_port) 2>/dev/null"

# --migration-limit 3: a SIGKILLed worker stays registered until its etcd lease (30 s) runs out; with Dynamo's
# default of 0, each request routed to it in that window fails (503). With 3, the frontend retries it on another
# worker and the client sees nothing (docs/distributed.md).
for h in "${hosts[@]}"; do
  [[ $h == fe* ]] || continue
  start "$h" "$h" python -m dynamo.frontend --http-host "${addr[$h]}" --http-port "$(fe_port "$h")" \
    --discovery-backend etcd --request-plane nats --event-plane nats --migration-limit 3
done
for h in "${hosts[@]}"; do
  [[ $h == w* ]] || continue
  port=$(eng_port "$h")
  # --kv-events grpc: the engines publish KV cache events, so every frontend routes by the cached prefix.
  start "engine-$h" "$h" openengine-mock --host "${addr[$h]}" --port "$port" --served-model-name "$model_name" \
    --model-dir "$model_path" --profile "$mock_profile" --capability guided=true --kv-events grpc
  wait_for "engine on $h" "(exec 3<>/dev/tcp/${addr[$h]}/$port) 2>/dev/null"
  start "sidecar-$h" "$h" env DYN_SYSTEM_PORT="$(sys_port "$h")" openengine-sidecar --grpc-endpoint "${addr[$h]}:$port" \
    --model-path "$model_path" --served-model-name "$model_name" --discovery-backend etcd --request-plane nats \
    --event-plane nats ${extra[@]+"${extra[@]}"}
done

urls=()
for h in "${hosts[@]}"; do [[ $h == fe* ]] && urls+=("http://${addr[$h]}:$(fe_port "$h")"); done
for h in "${hosts[@]}"; do
  [[ $h == w* ]] || continue
  wait_for "the sidecar on $h (/health)" "[ \"\$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 'http://${addr[$h]}:$(sys_port "$h")/health')\" = 200 ]"
done
for url in "${urls[@]}"; do
  wait_for "model $model_name at $url" "curl -fsS '$url/v1/models' 2>/dev/null | grep -q '\"$model_name\"'"
done
request='{"model":"'"$model_name"'","messages":[{"role":"user","content":"Tell me about the river."}],"max_tokens":40}'
echo "ready: etcd $etcd_url, NATS $nats_url, frontends ${urls[*]}, $workers worker(s)"
echo "try:   curl -s ${urls[0]}/v1/chat/completions -H 'content-type: application/json' -d '$request'"
if [ $demo = 1 ]; then
  status=0
  for url in "${urls[@]}"; do
    answer=$(curl -sS --max-time 60 "$url/v1/chat/completions" -H 'content-type: application/json' -d "$request") \
      || status=1
    echo "answer from $url: $answer"
    echo "$answer" | grep -q '"choices"' || status=1
  done
  if [ $once = 1 ]; then
    [ $status = 0 ] || tail -n 30 "$logs"/*.log >&2
    exit $status
  fi
fi
echo "logs:  $logs/   pids: $(for p in "${!pid[@]}"; do printf '%s=%s ' "$p" "${pid[$p]}"; done)"
echo "       (Ctrl-C stops everything; any process that exits is restarted)"
while sleep 1; do
  for name in "${!pid[@]}"; do kill -0 "${pid[$name]}" 2>/dev/null || restart "$name"; done
done
