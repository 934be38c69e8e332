# Shared by every launcher (sourced by _local.sh, cluster.sh and demo.sh): the --help text and one-line refusals of
# bad flags (_usage.sh), the run's directories and the last words of a tiered stop.
[ "${BASH_SOURCE[0]}" != "$0" ] || { echo "$(basename "$0"): sourced by the launchers, not run" >&2; exit 2; }

# Ctrl-C (SIGINT) must stop a launcher in order. A shell cannot trap a signal that was ignored when it started, and it
# keeps a signal mask it inherits: started from the background of a non-interactive shell (`launch/agg.sh &` in a
# script) or by a process that ignores or blocks SIGINT, the `trap ... INT` below would be silently void and Ctrl-C
# would do nothing. Start once more with SIGINT's default handling (GNU env resets and unblocks it), on Linux.
if [ -z "${OPENENGINE_SIGINT_RESET:-}" ] && grep -Eqs '^Sig(Ign|Blk):.*[2367abef]$' "/proc/$$/status"; then
  OPENENGINE_SIGINT_RESET=1 exec env --default-signal=INT bash "$0" "$@"
fi
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_usage.sh"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Dynamo's logging setup writes SGLang's log config to a new $TMPDIR/tmp*.json on every frontend start, never removed;
# nothing here runs SGLang.
export DYN_SKIP_SGLANG_LOG_FORMATTING=1
[ -x "$root/.venv/bin/python" ] && . "$root/.venv/bin/activate"

# need_value FLAG [VALUE ...]: the flag must be followed by a value (not by another flag).
need_value() { [ $# -ge 2 ] && [ -n "$2" ] && [[ $2 != --* ]] || die "$1 needs a value (see --help)"; }

# check_port FLAG VALUE [MAX]: a TCP port number (MAX 32767 for Dynamo's system port, read as a signed 16-bit number).
check_port() {
  local max=${3:-65535}
  [[ $2 =~ ^[0-9]{1,5}$ ]] && [ "$2" -ge 1 ] && [ "$2" -le "$max" ] \
    || die "$1: expected a port number 1-$max, got '$2'$([ "$max" = 32767 ] && echo ' (Dynamo reads DYN_SYSTEM_PORT as a signed 16-bit number)')"
}

# check_mock_profile NAME: one of openengine-mock's profiles (docs/mock.md, "Profiles").
mock_profiles="trtllm trtllm-newer full"
check_mock_profile() {
  [[ " $mock_profiles " == *" $1 "* ]] || die "--mock-profile: expected one of ${mock_profiles// /, }, got '$1'"
}

# open_dirs NAME: `work`, the scratch directory (removed at the end), and `logs`, --log-dir or a new temporary
# directory (kept).
open_dirs() {
  work=$(mktemp -d -t "openengine-$1.XXXXXX")
  if [ -n "$log_dir" ]; then
    mkdir -p "$log_dir" || { rm -rf "$work"; die "--log-dir: cannot create $log_dir"; }
    logs=$(cd "$log_dir" && pwd)
  else
    logs=$(mktemp -d -t "openengine-$1-logs.XXXXXX")
  fi
}

# stop_verdict NAME STATUS SIGNAL KILLED [DIES]: how a child the launcher stopped (with SIG<SIGNAL>, then SIGKILL
# when KILLED=1) ended, for the summary: sets `verdict` (NAME STATUS, and why when it is not 0) and `clean` (1/0).
# Status 0 is clean; so is 128 + SIGNAL for a program that stops by re-raising the signal it was stopped with (DIES=1:
# etcd ends with 143 on SIGTERM, by design). Anything else -- a SIGKILL after the grace, another signal, an error
# status -- is not.
stop_verdict() {
  local name=$1 status=$2 sig=$3 killed=$4 dies=${5:-0}
  clean=0
  if [ "$killed" = 1 ]; then
    verdict="$name $status (did not stop on SIG$sig within its grace period: killed)"
  elif [ "$status" = 0 ]; then
    verdict="$name 0" clean=1
  elif [ "$dies" = 1 ] && [ "$status" = $((128 + $(kill -l "$sig"))) ]; then
    verdict="$name $status (ended by the SIG$sig that stopped it, as $name does)" clean=1
  elif [ "$status" -gt 128 ] && kill -l $((status - 128)) >/dev/null 2>&1; then
    verdict="$name $status (killed by SIG$(kill -l $((status - 128))), not a clean stop)"
  else
    verdict="$name $status (exited with an error on SIG$sig, not a clean stop)"
  fi
}

# end_stop STATUS SUMMARY UNCLEAN: the end of a stop_all: what each child exited with (and why, when not 0), where
# the logs are, and the exit status: STATUS, or 1 when it was 0 but some child did not stop cleanly (UNCLEAN, its
# verdicts). A run ended by a signal keeps its status (130, 143) and still names the unclean children.
end_stop() {
  [ -n "$2" ] && echo "stopped (exit status): $2"
  echo "logs kept in $logs/"
  if [ -n "$3" ]; then
    echo "$script: not a clean stop: $3 (see their logs)" >&2
    [ "$1" = 0 ] && exit 1
  fi
  exit "$1"
}
