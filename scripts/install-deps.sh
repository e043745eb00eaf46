#!/usr/bin/env bash
# Installs Kestrel's build dependencies from Debian/Ubuntu packages. The CUDA 13 toolkit is
# expected at /usr/local/cuda (NVIDIA's installer or packages). With --fuzz, also clang and its
# libFuzzer/sanitizer runtimes, for the sanitized build (scripts/sanitize.sh,
# scripts/fuzz.sh).
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config libsentencepiece-dev libpcre2-dev libutf8proc-dev
      nlohmann-json3-dev libfmt-dev libcli11-dev libgtest-dev libgmock-dev libopenblas-dev
      liblapacke-dev libedit-dev libboost-dev curl ccache python3-jsonschema)
[ "${1:-}" = --fuzz ] && pkgs+=(clang libclang-rt-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
if [ ! -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  echo "install-deps: no CUDA toolkit (nvcc) found; Kestrel builds with the CUDA 13 toolkit in /usr/local/cuda" >&2
  exit 1
fi
