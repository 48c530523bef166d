#!/usr/bin/env bash
# The README's main command as a newcomer runs it (the `bench-smoke` step of
# scripts/test.sh): `bash scripts/bench.sh --quick --json FILE --plot FILE.png`, output to a
# log file (not a terminal), with the plot's install stamp removed first so that the
# install branch of scripts/env.sh runs, and without the caller's PYTHONPATH (a newcomer's
# shell: scripts/env.sh must put the checkout's tools/, hscache_tools, on it by itself);
# then scripts/check_bench_smoke.py judges the log,
# the JSON (decisions identical, a ratio per scenario and path) and the PNG. ~1-2 minutes.
#
#   bash scripts/bench_smoke.sh
#
# Files: ${HSCACHE_CACHE:-$HOME/.cache/hscache}/bench-smoke/{bench.log,bench.json,bench.png}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The venv bench.sh will use (scripts/env.sh names it), to remove its plot stamp.
venv="$(HSCACHE_SKIP_BUILD=1 bash -c 'source scripts/env.sh >/dev/null && echo "$HSCACHE_VENV"')"
[[ -n "$venv" && -d "$venv" ]] || { echo "bench-smoke: no venv ($venv)" >&2; exit 1; }
rm -f "$venv"/.hscache-bench-plot-*

work="${HSCACHE_CACHE:-$HOME/.cache/hscache}/bench-smoke"
rm -rf "$work"
mkdir -p "$work"
rc=0
env -u PYTHONPATH timeout 900 bash scripts/bench.sh --quick --json "$work/bench.json" --plot "$work/bench.png" \
    >"$work/bench.log" 2>&1 || rc=$?
if ((rc != 0)); then
    tail -n 40 "$work/bench.log" >&2
    echo "bench-smoke: scripts/bench.sh --quick exited $rc (log: $work/bench.log)" >&2
    exit 1
fi
if ! grep -q 'installing .*requirements/bench-plot.txt' "$work/bench.log" ||
    ! ls "$venv"/.hscache-bench-plot-* >/dev/null 2>&1; then
    echo "bench-smoke: scripts/bench.sh did not install the plot's requirements" >&2
    exit 1
fi
python3 scripts/check_bench_smoke.py "$work/bench.log" "$work/bench.json" "$work/bench.png"
