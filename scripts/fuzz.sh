#!/usr/bin/env bash
# Long runs of the generated-module tests, with other modules than CI's: the transform's
# differential test (plain vs instrumented vs unwound and rewound, on wasmtime) and the
# cross-engine test (unwound on one engine, rewound on the other, back and forth), and the
# interpreter's select guard (guarded modules compute what their inputs do).
#
# usage: scripts/fuzz.sh [MODULES] [SEED]
#   MODULES  generated modules per test (default 2000; CI runs 60)
#   SEED     first xorshift state, decimal or 0x hex (default: from the clock); a failure
#            prints the module's text, and the same MODULES and SEED run it again
#
# The cargo-fuzz targets in fuzz/ (decoders of everything ferry reads from outside) are run
# separately: docs/architecture.md, "Tests".
set -euo pipefail
cd "$(dirname "$0")/.."
modules="${1:-2000}"
seed="${2:-$(date +%s%N)}"
echo "fuzz: $modules modules per test, seed $seed"
export FERRY_DIFFERENTIAL_MODULES="$modules" FERRY_DIFFERENTIAL_SEED="$seed"
export FERRY_CROSS_ENGINE_MODULES="$modules" FERRY_CROSS_ENGINE_SEED="$seed"
export FERRY_GENERATED_MODULES="$modules" FERRY_GENERATED_SEED="$seed"
export FERRY_SELECT_GUARD_MODULES="$modules" FERRY_SELECT_GUARD_SEED="$seed"
cargo test --release -p ferry-instrument -- --nocapture \
    generated_modules_behave_the_same_instrumented_and_churned \
    generated_modules_unwound_on_one_engine_rewind_on_the_other \
    most_generated_modules_are_actually_instrumented \
    guarded_selects_change_nothing_a_module_computes
