# shellcheck shell=bash
# The one body of the extra vLLM environments (scripts/vllm032_env.sh, scripts/vllm030_env.sh,
# each a few lines that call `hscache_vllm_env`): sourced, never run.
#
# hscache_vllm_env TAG LABEL SIZE: for TAG (032, 030)
#   1. creates (or reuses) a venv at ${HSCACHE_VENV<TAG>:-$HSCACHE_CACHE/venv-vllm<TAG>-<hash>},
#      <hash> being a short hash of requirements/vllm<TAG>*.txt and the Python version: the
#      exact pins of requirements/vllm<TAG>.txt, then the wheels of
#      requirements/vllm<TAG>-nodeps.txt with --no-deps --require-hashes; a stamp file marks
#      a complete install, so a venv interrupted half-way is rebuilt from scratch; one
#      installer at a time (a lock), a second caller waits, then finds the stamp;
#   2. installs requirements/test-extra.txt (a stamp per version of that file), then builds
#      hscache's wheel from this checkout (`maturin build --release`, with the tools of
#      scripts/env.sh) and installs it there when it changed;
#   3. exports HSCACHE_VENV<TAG> and HSCACHE_PY<TAG>, that venv's python. The active
#      environment stays the one of scripts/env.sh.
# LABEL ("vLLM 0.32") and SIZE ("~6.3 GB") only word the log lines. Returns non-zero on any
# failure, whether or not the caller has `set -e`, and then exports no HSCACHE_PY<TAG>.
# Knobs: HSCACHE_VENV<TAG>, HSCACHE_PYTHON (interpreter for a new venv), HSCACHE_VERBOSE=1.

# The quiet runner: hscache_quiet LOG TAG CMD... (output shown only on failure).
source "$(dirname "${BASH_SOURCE[0]}")/quiet.sh"

hscache_vllm_env() {
    local tag="$1" label="$2" size="$3"
    local venv_var="HSCACHE_VENV$tag" py_var="HSCACHE_PY$tag"
    _hv_log() { printf '[hscache env%s] %s\n' "$tag" "$*" >&2; }
    if [[ -z "${HSCACHE_ENV_READY:-}" ]]; then
        _hv_log "source scripts/env.sh first"
        return 1
    fi
    local python="${HSCACHE_PYTHON:-}"
    if [[ -z "$python" ]]; then
        python=python3
        if command -v python3.11 >/dev/null 2>&1; then python=python3.11; fi
    fi
    local pyver reqs hash venv stamp
    pyver="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" || return 1
    reqs=("$HSCACHE_ROOT/requirements/vllm$tag.txt" "$HSCACHE_ROOT/requirements/vllm$tag-nodeps.txt")
    hash="$({ cat "${reqs[@]}"; echo "python$pyver"; } | sha256sum | cut -c1-12)" || return 1
    venv="${!venv_var:-$HSCACHE_CACHE/venv-vllm$tag-$hash}"
    stamp="$venv/.hscache-complete"
    local ok=1 lock_fd
    if [[ "$(cat "$stamp" 2>/dev/null || true)" != "$hash" ]]; then
        mkdir -p "$HSCACHE_CACHE" || return 1
        exec {lock_fd}>"$HSCACHE_CACHE/.venv-vllm$tag.lock"
        flock "$lock_fd"
        if [[ "$(cat "$stamp" 2>/dev/null || true)" != "$hash" ]]; then
            _hv_make_venv || ok=0
        fi
        flock -u "$lock_fd"
        exec {lock_fd}>&-
    fi
    ((ok)) && { _hv_install_test_extra || ok=0; }
    ((ok)) && { _hv_install_hscache || ok=0; }
    unset -f _hv_make_venv _hv_install_test_extra _hv_install_hscache
    if ((ok)); then
        unset -f _hv_log
        export "$venv_var=$venv" "$py_var=$venv/bin/python"
        return 0
    fi
    _hv_log "FAILED: the $label environment ($venv)"
    unset -f _hv_log
    return 1
}


# (uses hscache_vllm_env's locals: tag, label, size, python, pyver, reqs, hash, venv, stamp)
_hv_make_venv() {
    local t0=$SECONDS
    _hv_log "creating $venv ($label on CPU, Python $pyver; $size, a few minutes)"
    rm -rf "$venv"
    "$python" -m venv "$venv" || return 1
    local pip=("$venv/bin/python" -m pip --disable-pip-version-check)
    local log="$venv/install.log"
    hscache_quiet "$log" "$tag" timeout 1800 "${pip[@]}" install --no-input -r "${reqs[0]}" || return 1
    hscache_quiet "$log.nodeps" "$tag" timeout 900 "${pip[@]}" install --no-input --no-deps \
        --require-hashes -r "${reqs[1]}" || return 1
    echo "$hash" >"$stamp" || return 1
    _hv_log "$label venv ready in $((SECONDS - t0)) s"
}

# requirements/test-extra.txt (pytest-xdist, Hypothesis), once per venv and version of that
# file (a stamp per file hash, outside the venv hash), as scripts/env.sh does for its venv.
_hv_install_test_extra() {
    local file="$HSCACHE_ROOT/requirements/test-extra.txt" extra_stamp
    extra_stamp="$venv/.hscache-test-extra-$(sha256sum "$file" | cut -c1-12)" || return 1
    [[ -f "$extra_stamp" ]] && return 0
    hscache_quiet "$venv/test-extra.log" "$tag" "$venv/bin/python" -m pip \
        --disable-pip-version-check install --no-input -r "$file" || return 1
    touch "$extra_stamp"
}

# hscache from this checkout, as a wheel (what users install), when it changed.
_hv_install_hscache() {
    local dist="$HSCACHE_CACHE/wheels-vllm$tag" wheel whash
    rm -rf "$dist"
    (cd "$HSCACHE_ROOT" && hscache_quiet "$HSCACHE_CACHE/maturin-build-vllm$tag.log" "$tag" \
        timeout 1800 maturin build --release --out "$dist") || return 1
    wheel="$(ls "$dist"/hscache-*.whl)" || return 1
    whash="$(sha256sum "$wheel" | cut -c1-16)" || return 1
    if [[ "$(cat "$venv/.hscache-wheel" 2>/dev/null || true)" != "$whash" ]]; then
        hscache_quiet "$venv/hscache-install.log" "$tag" "$venv/bin/python" -m pip \
            --disable-pip-version-check install --no-input --no-deps --force-reinstall \
            "$wheel" || return 1
        echo "$whash" >"$venv/.hscache-wheel"
        _hv_log "hscache installed into the $label venv"
    fi
}
