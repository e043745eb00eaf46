#!/usr/bin/env bash
# Installs, builds, writes a small random-weight 4-bit GPTQ model and generates from it,
# on the GPU when there is one, else on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
model="${DEMO_MODEL_DIR:-${TMPDIR:-/tmp}/kestrel-demo-tiny-gptq4}"
./build/kestrel-synth --shape tiny --dtype gptq --bits 4 --group-size 128 --seed 1 --out "$model"
./build/kestrel generate -m "$model" -p "The quick brown fox" -n 48 --temp 0
