#!/usr/bin/env bash
# Makes sure `redis-server` is on PATH for the batch-store and account tests; sourced by
# scripts/test, and runnable on its own. What it installs system-wide: Debian's `redis-server`
# package through apt-get, as root or through `sudo -n` (never a password prompt). With neither,
# it prints the one command to run by hand and fails.
#
# tests/test_install_scripts.py runs this file with a PATH that has no redis-server and a
# recording apt-get, so a broken install line fails the suite even on a machine that already has
# redis-server (a green CI once hid exactly that).

install_redis() {
  if command -v redis-server >/dev/null 2>&1; then
    return 0
  fi
  local -a as_root=()
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
      as_root=(sudo -n)
    else
      echo "tiergate: redis-server is missing, and this user is neither root nor allowed sudo without a password." >&2
      echo "tiergate: install it by hand, then run scripts/test again:  sudo apt-get install -y redis-server" >&2
      return 1
    fi
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "tiergate: redis-server is missing and there is no apt-get here: install redis-server (7 or newer) with this system's package manager, then run scripts/test again" >&2
    return 1
  fi
  echo "tiergate: installing redis-server (Debian) for the batch store tests" >&2
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq || return 1
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null || return 1
  if ! command -v redis-server >/dev/null 2>&1; then
    echo "tiergate: apt-get installed redis-server but it is not on PATH ($PATH)" >&2
    return 1
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  install_redis
fi
