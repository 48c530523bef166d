# Sourced by scripts/env.sh and scripts/vllm_env_lib.sh, never run: the quiet runner of the
# environment scripts.
#
# hscache_quiet LOG TAG CMD...: runs CMD with its output in LOG, shown only if it fails (the
# last 40 lines, after a "[hscache envTAG] FAILED" line) or with HSCACHE_VERBOSE=1; returns
# CMD's status.
hscache_quiet() {
    local log="$1" tag="$2"
    shift 2
    if [[ "${HSCACHE_VERBOSE:-0}" == 1 ]]; then
        "$@" 2>&1 | tee "$log"
        return "${PIPESTATUS[0]}"
    fi
    if ! "$@" >"$log" 2>&1; then
        printf '[hscache env%s] %s\n' "$tag" "FAILED: $* (last lines of $log follow)" >&2
        tail -n 40 "$log" >&2
        return 1
    fi
}
