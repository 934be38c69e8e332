# Sourced by every script of launch/ (through _common.sh for the launchers): --help prints the script's header
# comment, and a bad flag is one line on stderr with exit status 2 -- before the script does anything else.
[ "${BASH_SOURCE[0]}" != "$0" ] || { echo "$(basename "$0"): sourced by the scripts of launch/, not run" >&2; exit 2; }
script=$(basename "$0")

# usage: the script's header comment (from its second line to the first line that is not a comment).
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
die() { echo "$script: $*" >&2; exit 2; }

# no_flags ARGS...: for a script that takes none: -h/--help prints its usage and exits 0, anything else is refused.
no_flags() {
  [ $# = 0 ] && return
  case "$1" in
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
}
