#!/usr/bin/env bash
# The Python side of the panic-safety step: builds the extension with the `fault-injection`
# feature (a debug build: it compiles faster, and the shields behave the same) into its own
# target directory, puts it in a copy of python/hscache (never over the
# python/hscache/_core.abi3.so the other tests import), and runs tests/robustness/test_panic_python.py
# against that copy: injected panics must surface as InternalError and poison only the
# object that panicked.
#
# Expects the environment of scripts/env.sh (sourced by scripts/test.sh).
#   HSCACHE_FAULT_TARGET  cargo target directory for the feature build
#                         (default: target/fault-injection, kept between runs)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

target="${HSCACHE_FAULT_TARGET:-$PWD/target/fault-injection}"
cargo build --quiet --features python,fault-injection --target-dir "$target"

pkg="$(mktemp -d)"
trap 'rm -rf "$pkg"' EXIT
cp -r python/hscache "$pkg/hscache"
rm -f "$pkg"/hscache/_core*.so
cp "$target/debug/libhscache.so" "$pkg/hscache/_core.abi3.so"
PYTHONPATH="$pkg" python -m pytest -q -p no:cacheprovider tests/robustness/test_panic_python.py \
    -W error::pytest.PytestUnhandledThreadExceptionWarning
n_skipped="$(PYTHONPATH="$pkg" python -c 'from hscache import _core; print(int(not hasattr(_core, "_arm_fault")))')"
if [[ "$n_skipped" != 0 ]]; then
    echo "the fault-injection build has no _arm_fault: tests/robustness/test_panic_python.py skipped"
    exit 1
fi
