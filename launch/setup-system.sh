#!/usr/bin/env bash
# System packages the full test suite uses: Debian's Chromium (the ops page's browser test), etcd and NATS (the
# distributed control-plane tests). Needs root (CI runs as root); without it, those tests skip and say why.
#
# usage: launch/setup-system.sh [-h|--help]
#   takes no flags; as root with apt-get: apt-get update, then installs whichever of chromium, etcd-server and
#   nats-server is missing and stops the etcd and nats-server services Debian starts (the tests start their own);
#   otherwise it says what it skips and exits 0
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_usage.sh"
no_flags "$@"
packages=(chromium etcd-server nats-server)
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} = 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-system: not root (or no apt-get): skipping ${missing[*]}; the tests needing them will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Debian's packages may start their own daemons where an init system runs; the tests start private instances.
for service in etcd nats-server; do
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$service" 2>/dev/null; then
    systemctl stop "$service" || true
  fi
done
