#!/usr/bin/env bash
# The router check (scripts/test.sh runs it as its `router-e2e` step): hscache-served vLLM
# engines behind NVIDIA Dynamo's KV-aware indexer, which must see exactly what it sees
# from stock vLLM engines.
#
#   bash scripts/router_e2e.sh [--arms stock,hscache,compact]
#
# Needs the vLLM 0.32 CPU environment of scripts/e2e.sh (scripts/vllm032_env.sh, which
# installs hscache's wheel from this checkout) and a small venv of its own with Dynamo's
# standalone indexer (requirements/dynamo.txt: ai-dynamo-runtime 1.6.1, ~280 MB) under
# $HSCACHE_CACHE/venv-dynamo-<hash>. If that wheel cannot be installed the check is
# skipped with a message and exit status 77 (scripts/test.sh counts the step as skipped),
# except under CI=true, where it fails (exit 1); anything else that fails fails the check.
# tests/e2e/router.py runs the arms (stock vLLM, hscache, hscache with compact events),
# three engines each (two dense, one hybrid), publishing over ipc:// sockets in a private
# directory; the indexer's HTTP port is a free loopback port. Every process it starts is
# killed when it ends. Logs and JSON: ${HSCACHE_ROUTER_WORK:-$HSCACHE_CACHE/router}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ "${HSCACHE_ENV_READY:-}" != "${HSCACHE_VENV:-unset}" ]]; then
    # shellcheck source=env.sh
    source scripts/env.sh
fi
if [[ -z "${HSCACHE_PY032:-}" ]]; then
    # shellcheck source=vllm032_env.sh
    source scripts/vllm032_env.sh
fi

log() { printf '[router-e2e] %s\n' "$*" >&2; }

# Dynamo's indexer in its own venv (exact pins), made once per requirements hash.
reqs=requirements/dynamo.txt
pyver="$("$HSCACHE_PY032" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
hash="$({ cat "$reqs"; echo "python$pyver"; } | sha256sum | cut -c1-12)"
dyn="${HSCACHE_VENV_DYNAMO:-$HSCACHE_CACHE/venv-dynamo-$hash}"
stamp="$dyn/.hscache-complete"
if [[ "$(cat "$stamp" 2>/dev/null || true)" != "$hash" ]]; then
    mkdir -p "$HSCACHE_CACHE"
    exec {lock}>"$HSCACHE_CACHE/.venv-dynamo.lock"
    flock "$lock"
    if [[ "$(cat "$stamp" 2>/dev/null || true)" != "$hash" ]]; then
        log "creating $dyn (ai-dynamo-runtime, ~280 MB)"
        rm -rf "$dyn"
        base="$("$HSCACHE_PY032" -c 'import sys; print(sys.base_prefix)')/bin/python$pyver"
        if ! { "$base" -m venv "$dyn" &&
            timeout 900 "$dyn/bin/python" -m pip --disable-pip-version-check install \
                --no-input -q -r "$reqs" >"$HSCACHE_CACHE/venv-dynamo-install.log" 2>&1; }; then
            tail -n 20 "$HSCACHE_CACHE/venv-dynamo-install.log" >&2 || true
            rm -rf "$dyn"
            case "${CI:-}" in
                "" | 0 | false | False | FALSE) ;;
                *)
                    log "FAILED: Dynamo's indexer wheel (ai-dynamo-runtime==1.6.1) could not" \
                        "be installed (log above); under CI=true a check that cannot run fails"
                    exit 1
                    ;;
            esac
            log "SKIPPED: Dynamo's indexer wheel (ai-dynamo-runtime==1.6.1) could not be" \
                "installed (log above); the router check did not run (under CI=true: fails)"
            exit 77
        fi
        echo "$hash" >"$stamp"
    fi
    flock -u "$lock"
fi

work="${HSCACHE_ROUTER_WORK:-$HSCACHE_CACHE/router}"
mkdir -p "$work"
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset HSCACHE HSCACHE_PARITY HSCACHE_DISABLE HSCACHE_STRICT HSCACHE_KV_EVENTS
# router.py kills its engines and indexers on exit (also on SIGTERM); this bounds it all.
cmd=(timeout 1200 "$HSCACHE_PY032" tests/e2e/router.py --work "$work"
    --indexer-python "$dyn/bin/python" "$@")
# Dynamo's indexer serves HTTP on all interfaces: where the machine allows it, the whole
# check runs in a network namespace of its own, where only loopback exists.
if unshare -n true 2>/dev/null && command -v ip >/dev/null; then
    log "running in a private network namespace (loopback only)"
    unshare -n -- bash -c 'ip link set lo up && exec "$@"' router-e2e "${cmd[@]}"
else
    log "no private network namespace here: the indexer listens on a free port of all" \
        "interfaces for the check's duration"
    "${cmd[@]}"
fi
