#!/usr/bin/env bash
# The CPU tests (ctest -LE gpu) under AddressSanitizer, LeakSanitizer and
# UndefinedBehaviorSanitizer, in the sanitized build build-asan (scripts/cmake-common.sh:
# configure_sanitized; clang, shared with scripts/fuzz.sh). Only what the CPU tests run is built
# (the target kestrel_cpu_tests).
#
# A report in a test or in a program it runs (kestrel, kestrel-synth, ...) goes to
# build-asan/sanitizer/ and fails the script, whatever the test made of the exit code.
#   sanitize.sh              configure, build, run (JOBS=N: parallel jobs, default nproc)
# CUDA_ARCHS as for scripts/build.sh (default 90a: the CPU tests run no device code).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
build=build-asan
jobs="${JOBS:-$(nproc)}"
bash scripts/install-deps.sh --fuzz
source scripts/cmake-common.sh
configure_sanitized "$build"
cmake --build "$build" -j"$jobs" --target kestrel_cpu_tests

# The tokenizer tests' references (scripts/fetch-test-tokenizers.sh): build/'s where
# scripts/test.sh fetched them, else fetched here.
tok="$root/build/test-tokenizers"
[ -d "$tok" ] || tok="$root/$build/test-tokenizers"
bash scripts/fetch-test-tokenizers.sh "$tok"
export KESTREL_TEST_TOKENIZERS="$tok"

reports="$root/$build/sanitizer"
rm -rf "$reports"
mkdir -p "$reports"
# protect_shadow_gap=0: the CUDA driver maps memory where ASan's shadow gap is (on a GPU
# machine; without one nothing is mapped). The driver's own allocations alive at exit are not
# Kestrel's leaks (scripts/lsan.supp).
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:protect_shadow_gap=0:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=0:log_path=$reports/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan"
export LSAN_OPTIONS="suppressions=$root/scripts/lsan.supp:print_suppressions=0"

# install_consumer is left out: it installs the shared library and builds an unsanitized program
# against it, a packaging check with nothing of its own to sanitize. So are the checks of a
# quantity over real-size work, each 35-100 s under the sanitizers (a fresh CI-like run, where
# the sanitized tests took 23 minutes), whose code the other sanitized tests run at small size:
#  - SpecTiny.SampledOutputFollowsTheTargetDistribution: 5,000 sampled speculative runs for a
#    statistical check (the other SpecTiny tests run the same code);
#  - EndToEnd.GptqCloseToFp16AndBelowRtn, Mixed.PlanKeepsItsBudgetAndMoreBudgetNeverLosesMore,
#    Mixed.OneCandidatePlanIsTheUniformCheckpoint: quantization quality and plans over budgets
#    (the other EndToEnd and Mixed tests quantize, plan and write through the same code, and
#    test_quant_plan checks the planner);
#  - KvCacheDocsModel.GreedyTextEqualsF16, SpecRealModel.DocsLlamaGreedyLookupIsPlainDecoding:
#    the docs model's text (the tiny-model tests of the cache and of lookup run the same code);
#  - Perplexity.CpuEqualsIndependentComputation: every window against an independent
#    computation (Perplexity.ChunksLimitsTheWindows runs the same code over two windows).
# The plain run (scripts/test.sh) keeps every one of them.
status=0
ctest --test-dir "$build" --output-on-failure -j"$jobs" -LE gpu \
  -E '^(install_consumer|SpecTiny\.SampledOutputFollowsTheTargetDistribution|EndToEnd\.GptqCloseToFp16AndBelowRtn|Mixed\.PlanKeepsItsBudgetAndMoreBudgetNeverLosesMore|Mixed\.OneCandidatePlanIsTheUniformCheckpoint|KvCacheDocsModel\.GreedyTextEqualsF16|SpecRealModel\.DocsLlamaGreedyLookupIsPlainDecoding|Perplexity\.CpuEqualsIndependentComputation)$' \
  --timeout 1200 || status=1
if compgen -G "$reports/*" > /dev/null; then
  echo "sanitize: sanitizer reports ($reports):"
  for f in "$reports"/*; do echo "== $f"; head -60 "$f"; done
  status=1
fi
if [ $status -eq 0 ]; then
  echo "sanitize: the CPU tests pass under ASan+UBSan with no report"
else
  echo "sanitize: failed" >&2
fi
exit $status
