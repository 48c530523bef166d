#!/usr/bin/env bash
# The vllm-omni end-to-end check: hscache inside a real vllm-omni 0.30 thinker -> talker
# pipeline (vLLM 0.30, CPU), against vllm-omni's own hidden-state cache and a cold run.
#
#   bash scripts/omni_e2e.sh [--sync] [--talker] [--spec]
#
# --sync also runs the three arms with async_scheduling: false (OmniARScheduler); --talker
# also runs the talker-prefix-caching experiment of docs/omni.md (arms talker_pc and
# talker_pc_fixed, reported in the table, not checked); --spec also runs the drafting arms
# (cold_spec, hscache_spec: the thinker drafting with ngram, synchronous scheduling; the
# talker's rows and tokens checked against the cold drafting run). Not by default: the
# default arms take 11+ minutes on 2 cores, the two drafting arms ~3-5 more.
#
# In the vLLM 0.30 + vllm-omni 0.30 environment (scripts/vllm030_env.sh): installs the test
# scaffolding tests/omni_e2e/plugin (a CPU platform for vllm-omni, which knows GPUs only, and
# a probe reporting which caches served) into that venv, makes a tiny random Qwen2.5-Omni
# (tests/omni_e2e/make_model.py; nothing downloaded), runs tests/omni_e2e/run_pipeline.py
# once per arm (cold: thinker prefix caching off; omni: vllm-omni's cache; hscache:
# HSCACHE=1 + HSCACHE_OMNI_PREFIX_CACHE=1 + HSCACHE_STRICT=1, both stages on hscache.omni's
# schedulers: the fast path), then the hybrid arm (the hscache arm, HSCACHE=1 alone, on a
# second tiny model whose thinker has a full-attention and a 64-token sliding-window layer,
# `make_model.py --sliding-window 64`, a layout vllm-omni's own cache refuses; its cold
# reference runs in the same engine), checks the JSONs with
# tests/omni_e2e/test_omni_pipeline.py and prints a table. Each arm starts two stage
# engines (~1-3 min on 2 cores). Work folder: ${HSCACHE_OMNI_E2E_WORK:-$HSCACHE_CACHE/omni_e2e}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ "${HSCACHE_ENV_READY:-}" != "${HSCACHE_VENV:-unset}" ]]; then
    # shellcheck source=env.sh
    source scripts/env.sh
fi
if [[ -z "${HSCACHE_PY030:-}" ]]; then
    # shellcheck source=vllm030_env.sh
    source scripts/vllm030_env.sh
fi

suffixes=("")
experiments=()
spec=0
for flag in "$@"; do
    case "$flag" in
    --sync) suffixes+=("-sync") ;;
    --talker) experiments=(talker_pc talker_pc_fixed) ;;
    --spec) spec=1 ;;
    *)
        echo "usage: bash scripts/omni_e2e.sh [--sync] [--talker] [--spec]" >&2
        exit 2
        ;;
    esac
done
work="${HSCACHE_OMNI_E2E_WORK:-$HSCACHE_CACHE/omni_e2e}"
results="$work/results"
rm -rf "$results"
mkdir -p "$results"
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HSCACHE_OMNI_CPU=1
unset HSCACHE HSCACHE_PARITY HSCACHE_DISABLE HSCACHE_OMNI_PREFIX_CACHE HSCACHE_STRICT

"$HSCACHE_PY030" -m pip --disable-pip-version-check install --quiet --no-input --no-deps \
    --no-build-isolation -e tests/omni_e2e/plugin >"$work/plugin-install.log" 2>&1 ||
    { tail -n 20 "$work/plugin-install.log" >&2; exit 1; }
"$HSCACHE_PY030" tests/omni_e2e/make_model.py "$work/model" >"$work/make_model.log" 2>&1 ||
    { tail -n 20 "$work/make_model.log" >&2; exit 1; }
"$HSCACHE_PY030" tests/omni_e2e/make_model.py "$work/model-swa" --sliding-window 64 \
    >>"$work/make_model.log" 2>&1 || { tail -n 20 "$work/make_model.log" >&2; exit 1; }

run_arm() { # arm, model, json name, run_pipeline flags...
    local arm="$1" model="$2" name="$3"
    shift 3
    local log="$results/$name.log"
    if ! timeout 900 "$HSCACHE_PY030" tests/omni_e2e/run_pipeline.py --arm "$arm" \
        --model "$model" --out "$results/$name.json" "$@" >"$log" 2>&1; then
        echo "omni-e2e: arm $name failed (last lines of $log follow)" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
    grep -E "^$arm: start" "$log" || true
}

for suffix in "${suffixes[@]}"; do
    arms=(cold omni hscache)
    if [[ -z "$suffix" ]]; then arms+=("${experiments[@]}"); fi
    for arm in "${arms[@]}"; do
        flags=()
        if [[ "$suffix" == "-sync" ]]; then flags+=(--sync); fi
        run_arm "$arm" "$work/model" "$arm$suffix" "${flags[@]}"
    done
done
run_arm hybrid "$work/model-swa" hybrid
if [[ "$spec" == 1 ]]; then
    run_arm cold_spec "$work/model" cold_spec
    run_arm hscache_spec "$work/model" hscache_spec
fi

HSCACHE_OMNI_E2E_RESULTS="$results" "$HSCACHE_PY030" -m pytest -q -p no:cacheprovider \
    tests/omni_e2e/test_omni_pipeline.py
"$HSCACHE_PY030" tests/omni_e2e/table.py "$results"
