#!/usr/bin/env bash
# Installs, builds and runs the whole test suite. GPU tests skip, with a message, where
# there is no usable GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
