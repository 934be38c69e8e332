# Sourced by agg.sh and disagg.sh: a temporary work directory, the child-process list and its clean stop, and the
# loopback-only, file-discovery Dynamo environment. Usage: `. "$root/launch/_local.sh" NAME STOP_GRACE_TENTHS`.
work=$(mktemp -d -t "openengine-$1.XXXXXX")
stop_grace_tenths=$2
pids=()
stop_all() {
  trap - EXIT INT TERM
  # Reverse start order: sidecars first (they deregister and drain), then engines, then the frontend.
  for pid in $(printf '%s\n' "${pids[@]}" | tac); do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 "$stop_grace_tenths"); do
    alive=0; for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Everything on loopback, discovery in files under our temporary directory, caches out of $HOME.
export DYN_DISCOVERY_BACKEND=file DYN_FILE_KV="$work/discovery" DYN_REQUEST_PLANE=tcp DYN_EVENT_PLANE=zmq
export DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1 DYN_EVENT_PLANE_HOST=127.0.0.1
export DYN_HTTP_HOST=127.0.0.1 DYN_SYSTEM_HOST=127.0.0.1 HOME="$work/home" HF_HUB_OFFLINE=1
mkdir -p "$DYN_FILE_KV" "$HOME"
