#!/usr/bin/env bash
# Makes sure the system programs the tests need are on PATH, installing the missing ones from
# Debian in one apt-get call; sourced by scripts/test, and runnable on its own. What it installs
# system-wide, each only when its program is not on PATH:
#   redis-server                  the Batch API and account tests against a real Redis;
#   chromium and chromium-driver  the dashboard's test in a real (headless) browser;
#   espeak-ng                     real speech, made offline, for the voice activity detector's tests.
# It runs apt-get as root or through `sudo -n` (never a password prompt). With neither, or
# without apt-get, it prints what to install by hand and fails.
#
# tests/test_install_scripts.py runs this file with a PATH that has none of these programs and a
# recording apt-get, so a broken install line fails the suite even on a machine that already has
# them all (a green CI once hid exactly that).

# program on PATH:the Debian package that provides it
SYSTEM_PACKAGES=(redis-server:redis-server chromium:chromium chromedriver:chromium-driver espeak-ng:espeak-ng)

install_system() {
  local -a missing=() as_root=()
  local entry
  for entry in "${SYSTEM_PACKAGES[@]}"; do
    command -v "${entry%%:*}" >/dev/null 2>&1 || missing+=("${entry#*:}")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    return 0
  fi
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
      as_root=(sudo -n)
    else
      echo "tiergate: ${missing[*]} missing, and this user is neither root nor allowed sudo without a password." >&2
      echo "tiergate: install by hand, then run scripts/test again:  sudo apt-get install -y ${missing[*]}" >&2
      return 1
    fi
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "tiergate: ${missing[*]} missing and there is no apt-get here: install them (Redis 7 or newer; Chromium with its matching chromedriver; espeak-ng) with this system's package manager, then run scripts/test again" >&2
    return 1
  fi
  echo "tiergate: installing ${missing[*]} (Debian) for the tests" >&2
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq || return 1
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null || return 1
  for entry in "${SYSTEM_PACKAGES[@]}"; do
    if ! command -v "${entry%%:*}" >/dev/null 2>&1; then
      echo "tiergate: apt-get installed ${entry#*:} but ${entry%%:*} is not on PATH ($PATH)" >&2
      return 1
    fi
  done
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  install_system
fi
