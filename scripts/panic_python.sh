#!/usr/bin/env bash
# The test-hooks step: builds the extension with the test-only cargo features
# `fault-injection` (armed panics, src/fault.rs) and `mutants` (the mutant switches:
# src/step/, src/manager/mutants.rs, the slot mirror's and omni rules'), a debug build (it
# compiles faster, and the shields behave the same), into its own target directory, puts it
# in a copy of python/hscache (never over the python/hscache/_core.abi3.so the other tests
# import), and runs against that copy:
#   - tests/robustness/test_panic_python.py: injected panics must surface as InternalError
#     and poison only the object that panicked;
#   - every test marked `hooks` (`pytest -m hooks`: the mutants the differentials must
#     catch, the poisoned-manager rows of the bad-input matrix), which the release
#     extension's run deselects (tests/conftest.py);
#   - tests/test_release_build.py, which finds every switch in this build (and none in the
#     release one).
#
# Expects the environment of scripts/env.sh (sourced by scripts/test.sh).
#   HSCACHE_FAULT_TARGET  cargo target directory for the feature build
#                         (default: target/fault-injection, kept between runs)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

target="${HSCACHE_FAULT_TARGET:-$PWD/target/fault-injection}"
cargo build --quiet --features python,fault-injection,mutants --target-dir "$target"

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
hooks="$(PYTHONPATH="$pkg" python -c 'from hscache import _core; print(int(_core.TEST_HOOKS))')"
if [[ "$hooks" != 1 ]]; then
    echo "the test-hooks build has no mutants (_core.TEST_HOOKS is false)"
    exit 1
fi
# the mutants are the slow part (whole differentials each): on every core, as scripts/test.sh's
# other pytest steps (HSCACHE_PYTEST_WORKERS, default one process outside it)
PYTHONPATH="$pkg" python -m pytest -q -p no:cacheprovider -n "${HSCACHE_PYTEST_WORKERS:-0}" \
    -m hooks tests
PYTHONPATH="$pkg" python -m pytest -q -p no:cacheprovider tests/test_release_build.py
