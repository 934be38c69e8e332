#!/usr/bin/env bash
# Scale-out on Dynamo's distributed control plane, on one machine:
#   etcd (discovery) + NATS (request and event planes), two Dynamo frontends, three openengine-sidecar workers, each
#   with its own openengine-mock engine. As root, every role runs on its own test host (a network namespace, joined
#   to the others and to this shell by veth pairs on one bridge); otherwise everything runs on loopback (the reason is
#   printed). See docs/distributed.md.
#
# usage: launch/cluster.sh [--loopback] [--frontends N] [--workers N] [--demo] [--once] [-- extra sidecar flags]
#   --loopback     do not create network namespaces even when possible
#   --frontends N  frontends (1-9, default 2); --workers N: workers (1-9, default 3)
#   --demo         send one chat completion through every frontend once the model is listed, print the answers
#   --once         with --demo: stop everything after the answers (exit status 0 if every answer came back)
# Like a supervisor, the script restarts any process that exits (try `kill -9` on etcd, NATS, a frontend or a
# sidecar; `ps` shows them). Ctrl-C or SIGTERM stops everything (sidecars first, so they drain), removes the
# namespaces and the temporary directory. Needs: apt-get install -y etcd-server nats-server
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -x "$root/.venv/bin/python" ] && . "$root/.venv/bin/activate"

frontends=2 workers=3 demo=0 once=0 loopback=0 extra=()
model_path="$root/sidecar/testing/mock/model" model_name="tiny-oe"
while [ $# -gt 0 ]; do
  case "$1" in
    --loopback) loopback=1; shift ;;
    --frontends) frontends=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --demo) demo=1; shift ;;
    --once) once=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "cluster.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ $frontends =~ ^[1-9]$ && $workers =~ ^[1-9]$ ]] || { echo "cluster.sh: --frontends/--workers take 1-9" >&2; exit 2; }

etcd_bin=$(command -v etcd || true) nats_bin=$(command -v nats-server || echo /usr/sbin/nats-server)
[ -n "$etcd_bin" ] && [ -x "$nats_bin" ] || {
  echo "cluster.sh: etcd and nats-server are needed: apt-get install -y etcd-server nats-server" >&2; exit 1; }

work=$(mktemp -d -t openengine-cluster.XXXXXX)
tag="oe$$x$(printf '%04x' $((RANDOM % 65536)))"
namespaces=() root_link=""
declare -A pid cmd hostof

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

# --- ports (fixed inside namespaces; offsets on shared loopback) ----------------------------------------------------
cpa=${addr[cp]}
etcd_url="http://$cpa:2379" nats_url="nats://$cpa:4222"
fe_port() { if [ -n "${ns[fe1]}" ]; then echo 8000; else echo $((8000 + ${1#fe} - 1)); fi; }
sys_port() { if [ -n "${ns[w1]}" ]; then echo 8081; else echo $((8081 + ${1#w} - 1)); fi; }
engine_port() { if [ -n "${ns[w1]}" ]; then echo 50051; else echo $((50051 + ${1#w} - 1)); fi; }

stop_all() {
  trap - EXIT INT TERM
  local order=() p
  for h in "${hosts[@]}"; do [[ $h == w* ]] && order+=("sidecar-$h"); done
  for h in "${hosts[@]}"; do [[ $h == fe* ]] && order+=("$h"); done
  for h in "${hosts[@]}"; do [[ $h == w* ]] && order+=("engine-$h"); done
  order+=(nats etcd)
  for p in "${order[@]}"; do [ -n "${pid[$p]:-}" ] && kill -TERM "${pid[$p]}" 2>/dev/null || true; done
  for _ in $(seq 1 150); do
    local alive=0; for p in "${order[@]}"; do [ -n "${pid[$p]:-}" ] && kill -0 "${pid[$p]}" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.1
  done
  for p in "${order[@]}"; do [ -n "${pid[$p]:-}" ] && kill -KILL "${pid[$p]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -n "$root_link" ] && ip link del "$root_link" 2>/dev/null || true
  for n in "${namespaces[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  rm -rf "$work"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Dynamo's variables, shared by every frontend and worker (each process adds its own host's listener addresses).
export DYN_DISCOVERY_BACKEND=etcd ETCD_ENDPOINTS="$etcd_url" DYN_REQUEST_PLANE=nats DYN_EVENT_PLANE=nats
export NATS_SERVER="$nats_url" HOME="$work/home" HF_HUB_OFFLINE=1
mkdir -p "$HOME" "$work/logs"

# start NAME HOST CMD...: run CMD on HOST in the background (remembered for restarts), log to logs/NAME.log. Every
# Dynamo listener of the process binds its own host's address.
start() {
  local name=$1 host=$2; shift 2
  hostof[$name]=$host; cmd[$name]=$(printf '%q ' "$@")
  local a=${addr[$host]}
  [ -n "${ns[$host]}" ] && set -- ip netns exec "${ns[$host]}" "$@"
  # env and `ip netns exec` both exec: $! is the process itself, so signals reach it.
  env DYN_TCP_RPC_HOST="$a" DYN_TCP_RESPONSE_STREAM_HOST="$a" DYN_EVENT_PLANE_HOST="$a" DYN_SYSTEM_HOST="$a" \
    DYN_HTTP_HOST="$a" "$@" >>"$work/logs/$name.log" 2>&1 &
  pid[$name]=$!
}
restart() {
  echo "cluster.sh: $1 exited; restarting it"
  eval "start \"\$1\" \"\${hostof[\$1]}\" ${cmd[$1]}"
}

wait_for() { local what=$1 test=$2; for _ in $(seq 1 300); do eval "$test" && return 0; sleep 0.1; done
  echo "cluster.sh: $what did not come up; logs:" >&2; tail -n 20 "$work"/logs/*.log >&2; exit 1; }

start etcd cp "$etcd_bin" --name oe-cp --data-dir "$work/etcd" --listen-client-urls "$etcd_url" \
  --advertise-client-urls "$etcd_url" --listen-peer-urls http://127.0.0.1:2380 \
  --initial-advertise-peer-urls http://127.0.0.1:2380 --initial-cluster oe-cp=http://127.0.0.1:2380 \
  --logger zap --log-level warn
start nats cp "$nats_bin" -a "$cpa" -p 4222 -js -sd "$work/nats"
wait_for etcd "curl -fsS '$etcd_url/health' 2>/dev/null | grep -q true"
wait_for NATS "(exec 3<>/dev/tcp/$cpa/4222) 2>/dev/null"

for h in "${hosts[@]}"; do
  [[ $h == fe* ]] || continue
  start "$h" "$h" python -m dynamo.frontend --http-host "${addr[$h]}" --http-port "$(fe_port "$h")" \
    --discovery-backend etcd --request-plane nats --event-plane nats --migration-limit 3
done
for h in "${hosts[@]}"; do
  [[ $h == w* ]] || continue
  port=$(engine_port "$h")
  start "engine-$h" "$h" openengine-mock --host "${addr[$h]}" --port "$port" --served-model-name "$model_name" \
    --model-dir "$model_path"
  wait_for "engine on $h" "(exec 3<>/dev/tcp/${addr[$h]}/$port) 2>/dev/null"
  start "sidecar-$h" "$h" env DYN_SYSTEM_PORT="$(sys_port "$h")" openengine-sidecar --grpc-endpoint "${addr[$h]}:$port" \
    --model-path "$model_path" --served-model-name "$model_name" --discovery-backend etcd --request-plane nats \
    --event-plane nats ${extra[@]+"${extra[@]}"}
done

urls=()
for h in "${hosts[@]}"; do [[ $h == fe* ]] && urls+=("http://${addr[$h]}:$(fe_port "$h")"); done
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
    [ $status = 0 ] || tail -n 30 "$work"/logs/*.log >&2
    exit $status
  fi
fi
echo "logs:  $work/logs/   pids: $(for p in "${!pid[@]}"; do printf '%s=%s ' "$p" "${pid[$p]}"; done)"
echo "       (Ctrl-C stops everything; any process that exits is restarted)"
while sleep 1; do
  for name in "${!pid[@]}"; do kill -0 "${pid[$name]}" 2>/dev/null || restart "$name"; done
done
