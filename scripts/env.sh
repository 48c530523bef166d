# shellcheck shell=bash
# Source me (`source scripts/env.sh`): the reproducible environment of hscache's tests and
# benchmarks. It
#   1. creates (or reuses) a venv at ${HSCACHE_VENV:-$HOME/.cache/hscache/venv-<hash>}, <hash>
#      being a short hash of requirements/*.txt and the Python version, with the exact pins
#      of requirements/vllm-cpu.txt plus vllm/xgrammar installed with --no-deps
#      (requirements/vllm-nodeps.txt); a stamp file marks a complete install, so a venv that
#      was interrupted half-way is rebuilt from scratch;
#   2. activates it, installs requirements/test-extra.txt and requirements/bench-plot.txt
#      once each (not part of <hash>; a stamp per file version), and exports
#      VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1;
#   3. puts this checkout's tools/ (the hscache_tools package: benchmarks, soak, test
#      fixtures; not in the wheel) first on PYTHONPATH, so that `python -m hscache bench`,
#      the tests and every venv started from this shell (the vLLM 0.32 / 0.30 ones too)
#      import them from this checkout; nothing is installed for it;
#   4. builds hscache from this checkout and installs it into the venv
#      (`maturin develop --release`); set HSCACHE_SKIP_BUILD=1 to skip this step.
#
# Knobs: HSCACHE_VENV (venv path), HSCACHE_CACHE (cache root, default $HOME/.cache/hscache),
# HSCACHE_PYTHON (interpreter for a new venv, default python3.11, else python3),
# HSCACHE_SKIP_BUILD=1, HSCACHE_VERBOSE=1 (show pip/maturin output).
#
# Fails loudly: this turns on `set -euo pipefail` in the shell that sources it.

set -euo pipefail

HSCACHE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HSCACHE_CACHE="${HSCACHE_CACHE:-$HOME/.cache/hscache}"
export HSCACHE_ROOT HSCACHE_CACHE

_hs_log() { printf '[hscache env] %s\n' "$*" >&2; }

# The quiet runner: hscache_quiet LOG TAG CMD... (output shown only on failure).
source "$HSCACHE_ROOT/scripts/quiet.sh"

_hs_python="${HSCACHE_PYTHON:-}"
if [[ -z "$_hs_python" ]]; then
    _hs_python=python3
    if command -v python3.11 >/dev/null 2>&1; then _hs_python=python3.11; fi
fi
_hs_pyver="$("$_hs_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ "$_hs_pyver" != 3.11 ]]; then
    _hs_log "warning: $_hs_python is Python $_hs_pyver; the pins were made and tested with 3.11"
fi

_hs_reqs=("$HSCACHE_ROOT/requirements/vllm-cpu.txt" "$HSCACHE_ROOT/requirements/vllm-nodeps.txt")
_hs_hash="$({ cat "${_hs_reqs[@]}"; echo "python$_hs_pyver"; } | sha256sum | cut -c1-12)"
HSCACHE_VENV="${HSCACHE_VENV:-$HSCACHE_CACHE/venv-$_hs_hash}"
export HSCACHE_VENV
_hs_stamp="$HSCACHE_VENV/.hscache-complete"

_hs_make_venv() {
    local t0=$SECONDS
    _hs_log "creating $HSCACHE_VENV (Python $_hs_pyver; ~7 GB, a few minutes on a clean machine)"
    rm -rf "$HSCACHE_VENV"
    "$_hs_python" -m venv "$HSCACHE_VENV"
    local pip=("$HSCACHE_VENV/bin/python" -m pip --disable-pip-version-check)
    local log="$HSCACHE_VENV/install.log"
    hscache_quiet "$log" "" timeout 1800 "${pip[@]}" install --no-input -r "${_hs_reqs[0]}"
    hscache_quiet "$log.nodeps" "" timeout 600 "${pip[@]}" install --no-input --no-deps -r "${_hs_reqs[1]}"
    echo "$_hs_hash" >"$_hs_stamp"
    _hs_log "venv ready in $((SECONDS - t0)) s"
}

if [[ "$(cat "$_hs_stamp" 2>/dev/null || true)" != "$_hs_hash" ]]; then
    mkdir -p "$HSCACHE_CACHE"
    # One installer at a time; a second caller waits, then finds the stamp.
    exec {_hs_lock_fd}>"$HSCACHE_CACHE/.venv.lock"
    flock "$_hs_lock_fd"
    if [[ "$(cat "$_hs_stamp" 2>/dev/null || true)" != "$_hs_hash" ]]; then
        _hs_make_venv
    fi
    flock -u "$_hs_lock_fd"
    exec {_hs_lock_fd}>&-
fi

# Activate (what bin/activate does, without its prompt handling).
export VIRTUAL_ENV="$HSCACHE_VENV"
export PATH="$HSCACHE_VENV/bin:$PATH"
unset PYTHONHOME
hash -r

# Packages beyond the vLLM pins, each file once per venv and version of that file (a stamp
# per file hash), kept out of the venv hash so that adding one does not rebuild the venv:
# requirements/test-extra.txt (Hypothesis, for the tests) and requirements/bench-plot.txt
# (matplotlib, for `python -m hscache bench --plot`; the plot test requires it).
for _hs_extra in test-extra bench-plot; do
    _hs_extra_file="$HSCACHE_ROOT/requirements/$_hs_extra.txt"
    _hs_extra_stamp="$HSCACHE_VENV/.hscache-$_hs_extra-$(sha256sum "$_hs_extra_file" | cut -c1-12)"
    if [[ ! -f "$_hs_extra_stamp" ]]; then
        _hs_log "installing $_hs_extra_file into the venv"
        hscache_quiet "$HSCACHE_VENV/$_hs_extra.log" "" python -m pip --disable-pip-version-check \
            install --no-input -r "$_hs_extra_file"
        touch "$_hs_extra_stamp"
    fi
done
unset _hs_extra _hs_extra_file _hs_extra_stamp

# hscache's tools (tools/hscache_tools), from this checkout, ahead of anything else.
case ":${PYTHONPATH:-}:" in
    *":$HSCACHE_ROOT/tools:"*) ;;
    *) PYTHONPATH="$HSCACHE_ROOT/tools${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
export PYTHONPATH

# vLLM on a CPU-only, offline machine: no device probing, no Hugging Face Hub.
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [[ "${HSCACHE_SKIP_BUILD:-0}" != 1 ]]; then
    _hs_t0=$SECONDS
    mkdir -p "$HSCACHE_CACHE"
    (cd "$HSCACHE_ROOT" && hscache_quiet "$HSCACHE_CACHE/maturin-develop.log" "" \
        timeout 1800 maturin develop --release)
    _hs_log "hscache built and installed into the venv ($((SECONDS - _hs_t0)) s)"
    unset _hs_t0
fi

unset _hs_python _hs_pyver _hs_reqs _hs_hash _hs_stamp
# Scripts started from here (tests/vllm_upstream/run.sh) need not source this again.
export HSCACHE_ENV_READY="$HSCACHE_VENV"
