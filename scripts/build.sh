#!/usr/bin/env bash
# Configures and builds Kestrel into ./build (Release). With a GPU present it compiles for
# that GPU only; without one, for Hopper (sm_90a), which keeps a CPU-only build quick.
# Override with CUDA_ARCHS="80;86;89;90a". Uses ccache where installed (scripts/cmake-common.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
archs="${CUDA_ARCHS:-}"
if [ -z "$archs" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then archs=native; else archs=90a; fi
fi
source scripts/cmake-common.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$archs" \
  "${cmake_common_args[@]}"
cmake --build build -j"$(nproc)"
