#!/usr/bin/env bash
# Runs vLLM 0.33.0's own unit tests (tests/v1/core/*, from the sdist, see fetch_sdist.sh)
# against the installed vLLM, offline on CPU, optionally with hscache's KVCacheManager
# swapped in (hscache_swap.py), and judges the outcome against known_failures.txt
# (compare.py).
#
#   tests/vllm_upstream/run.sh [--swap] [--write-known] [TEST_FILE_OR_NODE ...] [-- PYTEST_ARGS]
#
#   --swap          HSCACHE_SWAP=1: hscache.vllm.KVCacheManager (or HSCACHE_SWAP_CLASS=mod:Class)
#   --write-known   (without --swap) rewrite known_failures.txt from this run
#   TEST_FILE...    paths relative to the sdist root; default: the files of DEFAULT_FILES
#
# Exit status: 0 if every failure is an expected one, 1 otherwise. Results (JSON) and the
# pytest log land in ${HSCACHE_CACHE:-$HOME/.cache/hscache}/vllm-upstream-{base,swap}.*
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

DEFAULT_FILES=(
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

swap=0
write_known=0
files=()
pytest_args=()
while (($#)); do
    case "$1" in
        --swap) swap=1 ;;
        --write-known) write_known=1 ;;
        --) shift; pytest_args=("$@"); break ;;
        -h | --help) sed -n '2,15p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) files+=("$1") ;;
    esac
    shift
done
((${#files[@]})) || files=("${DEFAULT_FILES[@]}")

# Without the swap, hscache itself is not needed: don't build it (unless asked to).
((swap)) || export HSCACHE_SKIP_BUILD="${HSCACHE_SKIP_BUILD:-1}"
# The environment (venv, vLLM, hscache), unless the caller already has it (scripts/test.sh).
if [[ "${HSCACHE_ENV_READY:-}" != "${HSCACHE_VENV:-unset}" ]]; then
    # shellcheck source=../../scripts/env.sh
    source "$repo/scripts/env.sh"
fi

src="$(bash "$here/fetch_sdist.sh")"
tag=base
((swap)) && tag=swap
out="$HSCACHE_CACHE/vllm-upstream-$tag"
rm -f "$out.json" "$out.unexpected"

compare=(python "$here/compare.py" "$out.json")
((swap)) && compare+=(--swap)
((write_known)) && compare+=(--write-known)

pytest_cmd=(
    python -m pytest -p hscache_swap --noconftest -p no:cacheprovider
    -o console_output_style=count
)
echo "[hscache] vLLM upstream tests, swap $([[ $tag == swap ]] && echo ON || echo OFF):" \
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
