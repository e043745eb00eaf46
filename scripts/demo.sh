#!/usr/bin/env bash
# Installs, builds and continues a documentation sentence with the real 4-bit GPTQ model in
# data/docs-llama-19m-gptq4 (a 19M-parameter Llama trained on technical documentation), on
# the GPU when there is one, else on the CPU (--device auto).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
# Modest sampling with a fixed seed: greedy decoding of so small a model soon repeats itself.
./build/kestrel generate -m data/docs-llama-19m-gptq4 --device auto \
  -p "The subprocess module allows you to" -n 112 --temp 0.7 --top-p 0.9 --seed 2
