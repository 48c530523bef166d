#!/usr/bin/env bash
# THE benchmark command (README): `bash scripts/bench.sh [ARGS...]`.
# Sets up the environment (scripts/env.sh: pinned venv, hscache built in release mode), adds
# the plot's pinned matplotlib (requirements/bench-plot.txt, once per venv), then runs
# hscache's side-by-side benchmark against vLLM: `python -m hscache bench ARGS...`.
# Afterwards `python -m hscache bench --plot FILE.png` works in that venv too.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

plot_reqs=requirements/bench-plot.txt
plot_stamp="$HSCACHE_VENV/.hscache-plot-$(sha256sum "$plot_reqs" | cut -c1-12)"
if [[ ! -f "$plot_stamp" ]]; then
    echo "[hscache bench] installing the plot's pinned matplotlib ($plot_reqs)" >&2
    _hs_quiet "$HSCACHE_VENV/plot-install.log" \
        python -m pip install --disable-pip-version-check --no-input -r "$plot_reqs"
    touch "$plot_stamp"
fi

exec python -m hscache bench "$@"
