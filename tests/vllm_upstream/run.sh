#!/usr/bin/env bash
# Runs vLLM's own unit tests (tests/v1/core/* and the KV connector tests, from the sdist, see
# fetch_sdist.sh) against the installed vLLM, offline on CPU, optionally with hscache's
# KVCacheManager swapped in (hscache_swap.py), and judges the outcome against
# known_failures*.txt (compare.py).
#
#   tests/vllm_upstream/run.sh [--swap] [--vllm 0.32|0.30] [--write-known] [TEST_FILE_OR_NODE ...]
#                              [-- PYTEST_ARGS]
#
#   --swap          HSCACHE_SWAP=1: hscache.vllm.KVCacheManager (or HSCACHE_SWAP_CLASS=mod:Class)
#   --vllm 0.32     vLLM 0.32's tests (its sdist) in the vLLM 0.32 environment
#                   (scripts/vllm032_env.sh); default: vLLM 0.33.0's, in scripts/env.sh's
#   --vllm 0.30     vLLM 0.30's, in the vLLM 0.30 environment (scripts/vllm030_env.sh)
#   --write-known   (without --swap) rewrite the known-failures list from this run
#   TEST_FILE...    paths relative to the sdist root; default: CORE_FILES, plus
#                   CONNECTOR_FILES for 0.33
#
# Exit status: 0 if every failure is an expected one, 1 otherwise. Results (JSON) and the
# pytest log land in ${HSCACHE_CACHE:-$HOME/.cache/hscache}/vllm-upstream[-vllm03x]-{base,swap}.*
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

CORE_FILES=(
    tests/v1/core/test_scheduler.py
    tests/v1/core/test_async_scheduler.py
    tests/v1/core/test_deferred_block_free.py
    tests/v1/core/test_swa_inflight_window_free.py
    tests/v1/core/test_prefix_replay.py
    tests/v1/core/test_prefix_caching.py
    tests/v1/core/test_kv_cache_utils.py
    tests/v1/core/test_encoder_cache_manager.py
    tests/v1/core/test_kv_cache_metrics.py
    tests/v1/core/test_kv_sharing.py
    tests/v1/core/test_contiguous_kv_packing.py
    tests/v1/core/test_mamba_align_chunk_split.py
    tests/v1/core/test_worker_slot_overflow.py
    tests/v1/core/test_repetition_detection.py
    tests/v1/core/test_output.py
    tests/v1/core/test_priority_preemption_bug.py
    tests/v1/core/test_priority_scheduler_random.py
    tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py
    tests/v1/core/prefix_cache/test_partial_prefix_cache_primitives.py
    tests/v1/core/prefix_cache/test_mamba_eagle_resume_checkpoint.py
)
# vLLM 0.33's KV connector unit tests that drive a scheduler and its KV-cache manager
# (offloading connector, load-failure recovery, invalid blocks, cache-pollution
# prevention, lifecycle, multi-connector) and the KV offloading tests; their fixtures come
# from their own conftest files.
CONNECTOR_FILES=(
    tests/v1/kv_connector/unit/test_offloading_connector.py
    tests/v1/kv_connector/unit/offloading_connector
    tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py
    tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py
    tests/v1/kv_connector/unit/test_cache_pollution_prevention.py
    tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py
    tests/v1/kv_connector/unit/test_multi_connector.py
    tests/v1/simple_kv_offload
    tests/v1/kv_offload
)
# Left out: tests with short wall-clock deadlines and no KV-cache manager, which fail now and
# then on a loaded 2-core machine, swap or not: the offloading tier's peer-to-peer
# transport (ZMQ sessions, 5 s) and the shared offload region's multiprocess tests
# (spawned workers that import torch, 30 s).
region=tests/v1/kv_offload/cpu/test_shared_offload_region.py
CONNECTOR_IGNORE=(
    --ignore=tests/v1/kv_offload/tiering/p2p
    --deselect="$region::test_multiprocess_race_construct_and_write"
    --deselect="$region::test_mp_barrier_unlinks_file_and_survives_sigkill"
    --deselect="$region::test_create_next_worker_view_multiprocess_slots"
)

swap=0
write_known=0
series=0.33
files=()
pytest_args=()
while (($#)); do
    case "$1" in
        --swap) swap=1 ;;
        --write-known) write_known=1 ;;
        --vllm)
            shift
            case "${1:-}" in
                0.32 | 0.32.0) series=0.32 ;;
                0.33 | 0.33.0) series=0.33 ;;
                0.30 | 0.30.0) series=0.30 ;;
                *) echo "--vllm takes 0.30, 0.32 or 0.33, not '${1:-}'" >&2; exit 2 ;;
            esac
            ;;
        --) shift; pytest_args=("$@"); break ;;
        -h | --help) sed -n '2,19p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) files+=("$1") ;;
    esac
    shift
done
default_files=0
if ((${#files[@]} == 0)); then
    default_files=1
    files=("${CORE_FILES[@]}")
    if [[ $series == 0.33 ]]; then
        files+=("${CONNECTOR_FILES[@]}")
        pytest_args+=("${CONNECTOR_IGNORE[@]}")
    fi
fi

# Without the swap, hscache itself is not needed: don't build it (unless asked to).
((swap)) || export HSCACHE_SKIP_BUILD="${HSCACHE_SKIP_BUILD:-1}"
# The environment (venv, vLLM, hscache), unless the caller already has it (scripts/test.sh).
if [[ "${HSCACHE_ENV_READY:-}" != "${HSCACHE_VENV:-unset}" ]]; then
    # shellcheck source=../../scripts/env.sh
    source "$repo/scripts/env.sh"
fi

py=python
suffix=""
if [[ $series == 0.32 ]]; then
    if [[ -z "${HSCACHE_PY032:-}" ]]; then
        # shellcheck source=../../scripts/vllm032_env.sh
        source "$repo/scripts/vllm032_env.sh"
    fi
    py="$HSCACHE_PY032"
    suffix=-vllm032
elif [[ $series == 0.30 ]]; then
    if [[ -z "${HSCACHE_PY030:-}" ]]; then
        # shellcheck source=../../scripts/vllm030_env.sh
        source "$repo/scripts/vllm030_env.sh"
    fi
    py="$HSCACHE_PY030"
    suffix=-vllm030
fi
version="$("$py" -c 'import vllm; print(vllm.__version__)')"
src="$(bash "$here/fetch_sdist.sh" "$version")"
if ((default_files)); then
    # An older release lacks some of the newest test files (0.30: test_prefix_replay.py).
    kept=()
    for f in "${files[@]}"; do
        if [[ -e "$src/$f" ]]; then kept+=("$f"); else echo "[hscache] vLLM $version has no $f" >&2; fi
    done
    files=("${kept[@]}")
fi
tag=base
((swap)) && tag=swap
out="$HSCACHE_CACHE/vllm-upstream$suffix-$tag"
rm -f "$out.json" "$out.unexpected"

compare=(python "$here/compare.py" "$out.json" --vllm "$series")
((swap)) && compare+=(--swap)
((write_known)) && compare+=(--write-known)

# --confcutdir: the conftest files under tests/v1/ load (the connector tests' fixtures),
# vLLM's root tests/conftest.py (many extras) does not; hscache_swap provides the two
# root fixtures the selected tests use.
pytest_cmd=(
    "$py" -m pytest -p hscache_swap --confcutdir tests/v1 -p no:cacheprovider
    -o console_output_style=count
)
echo "[hscache] vLLM $version upstream tests, swap $([[ $tag == swap ]] && echo ON || echo OFF):" \
    "${files[*]}" >&2
t0=$SECONDS
set +e
(
    cd "$src"
    # The cwd (the sdist's tests tree, without its vllm/ sources) provides `tests.*`.
    HSCACHE_SWAP=$swap HSCACHE_RESULTS="$out.json" PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" \
        timeout "${HSCACHE_UPSTREAM_TIMEOUT:-1800}" "${pytest_cmd[@]}" -q --tb=no -rN \
        "${pytest_args[@]}" "${files[@]}"
)
rc=$?
set -e
echo "[hscache] pytest exit status $rc after $((SECONDS - t0)) s" >&2
# 0: all passed, 1: some failed (judged below); anything else (interrupted, internal or
# usage error, nothing collected, timeout) is a failure of the run itself.
if ((rc > 1)) || [[ ! -s "$out.json" ]]; then
    echo "[hscache] FAILED: pytest did not complete (exit status $rc)" >&2
    exit 1
fi
"${compare[@]}" --failed-out "$out.unexpected" && exit 0
# Show the unexpected failures in full (they were run with --tb=no above).
if [[ -s "$out.unexpected" ]]; then
    echo "[hscache] re-running the unexpected failures with tracebacks:" >&2
    mapfile -t again <"$out.unexpected"
    (
        cd "$src"
        HSCACHE_SWAP=$swap PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" \
            timeout 900 "${pytest_cmd[@]}" -q --tb=short -rfE "${pytest_args[@]}" \
            "${again[@]:0:50}" || true
    )
fi
exit 1
