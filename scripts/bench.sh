#!/usr/bin/env bash
# THE benchmark command (README): `bash scripts/bench.sh [ARGS...]`.
# Sets up the environment (scripts/env.sh: pinned venv, hscache built in release mode), then
# runs hscache's side-by-side benchmark against vLLM: `python -m hscache bench ARGS...`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
exec python -m hscache bench "$@"
