#!/usr/bin/env bash
# Long fuzzing runs of hscache's fuzz targets (tests/fuzz_common/mod.rs): the manager's op
# sequences against its reference model, generic value hashing and request block hashing
# under every algorithm.
#
#   scripts/fuzz.sh [HOURS] [TARGET...]     (default: 1 hour per target, every target)
#
# With a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`), each target runs
# under libFuzzer for HOURS (corpus: fuzz/corpus/<target>, grown in place; crashes land in
# fuzz/artifacts/<target>). Without them, the stable driver (tests/core/fuzz_targets.rs)
# runs seeded random inputs for the same time. Minimise a crash with
# `cargo +nightly fuzz tmin <target> <artifact>` and commit it to the corpus once fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
hours="${1:-1}"
shift || true
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
    targets=(manager_ops value_hash request_hash)
fi
secs=$(python3 -c "print(int(float('$hours') * 3600))")

if rustup toolchain list 2>/dev/null | grep -q nightly && cargo fuzz --version >/dev/null 2>&1; then
    for t in "${targets[@]}"; do
        echo "== libFuzzer: $t for ${secs}s"
        cargo +nightly fuzz run "$t" "fuzz/corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=4096
    done
else
    echo "no nightly toolchain or cargo-fuzz: running the stable driver for ${secs}s a target" >&2
    for t in "${targets[@]}"; do
        HSCACHE_FUZZ_ITERS=18446744073709551615 HSCACHE_FUZZ_SECS="$secs" \
            HSCACHE_FUZZ_SEED="${HSCACHE_FUZZ_SEED:-$RANDOM}" \
            cargo test --release -q --test core "fuzz_targets::fuzz_$t" -- --nocapture
    done
fi
