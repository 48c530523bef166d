#!/usr/bin/env bash
# THE benchmark command (README): `bash scripts/bench.sh [ARGS...]`.
# Sets up the environment (scripts/env.sh: pinned venv with the plot's pinned matplotlib,
# requirements/bench-plot.txt, installed once per venv; hscache built in release mode), then
# runs hscache's side-by-side benchmark against vLLM: `python -m hscache bench ARGS...`.
# Afterwards `python -m hscache bench --plot FILE.png` works in that venv too.
# scripts/test.sh runs it as a newcomer would (step "bench-smoke": scripts/bench_smoke.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

exec python -m hscache bench "$@"
