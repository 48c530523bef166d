#!/usr/bin/env bash
# Builds the abi3 wheel (`maturin build --release`), installs it into a fresh venv, and runs
# scripts/wheel_smoke.py there against vLLM, so that a packaging mistake (a missing module,
# a stub, the plugin entry point) fails the tests. vLLM and its dependencies come from the
# test venv's site-packages on PYTHONPATH (not as a site dir, so its editable hscache is not
# seen); hscache comes from the wheel only, and hscache's tools (tools/, hscache_tools) are
# not on that path: scripts/wheel_smoke.py checks that the wheel works without them.
#
# Expects the environment of scripts/env.sh (sourced by scripts/test.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
maturin build --release --quiet --out "$out/dist" >/dev/null
wheel="$(ls "$out"/dist/hscache-*.whl)"
echo "built $(basename "$wheel")"

python -m venv --without-pip "$out/venv"
site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
python -m pip install --quiet --no-deps --no-compile --target "$out/wheel-site" "$wheel"
cd "$out"
PYTHONPATH="$out/wheel-site:$site" "$out/venv/bin/python" \
    "$OLDPWD/scripts/wheel_smoke.py" "$out/wheel-site"
