# Shared by every launcher (sourced by _local.sh and cluster.sh): the --help text, one-line refusals of bad flags,
# the run's directories and the last words of a tiered stop.

# Ctrl-C (SIGINT) must stop a launcher in order. A shell cannot trap a signal that was ignored when it started, and it
# keeps a signal mask it inherits: started from the background of a non-interactive shell (`launch/agg.sh &` in a
# script) or by a process that ignores or blocks SIGINT, the `trap ... INT` below would be silently void and Ctrl-C
# would do nothing. Start once more with SIGINT's default handling (GNU env resets and unblocks it), on Linux.
if [ -z "${OPENENGINE_SIGINT_RESET:-}" ] && grep -Eqs '^Sig(Ign|Blk):.*[2367abef]$' "/proc/$$/status"; then
  OPENENGINE_SIGINT_RESET=1 exec env --default-signal=INT bash "$0" "$@"
fi
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -x "$root/.venv/bin/python" ] && . "$root/.venv/bin/activate"
script=$(basename "$0")

usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
die() { echo "$script: $*" >&2; exit 2; }

# need_value FLAG [VALUE ...]: the flag must be followed by a value (not by another flag).
need_value() { [ $# -ge 2 ] && [ -n "$2" ] && [[ $2 != --* ]] || die "$1 needs a value (see --help)"; }

# check_port FLAG VALUE [MAX]: a TCP port number (MAX 32767 for Dynamo's system port, read as a signed 16-bit number).
check_port() {
  local max=${3:-65535}
  [[ $2 =~ ^[0-9]{1,5}$ ]] && [ "$2" -ge 1 ] && [ "$2" -le "$max" ] \
    || die "$1: expected a port number 1-$max, got '$2'$([ "$max" = 32767 ] && echo ' (Dynamo reads DYN_SYSTEM_PORT as a signed 16-bit number)')"
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

# end_stop STATUS SUMMARY UNCLEAN: the end of a stop_all: what each child exited with, where the logs are, and the
# exit status: STATUS, or 1 with --once when it was 0 but some child (UNCLEAN) did not stop cleanly.
end_stop() {
  [ -n "$2" ] && echo "stopped (exit status): $2"
  echo "logs kept in $logs/"
  if [ $once = 1 ] && [ "$1" = 0 ] && [ -n "$3" ]; then
    echo "$script: not a clean stop: $3 exited non-zero (see their logs)" >&2
    exit 1
  fi
  exit "$1"
}
