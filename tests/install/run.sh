#!/usr/bin/env bash
# The install test: `cmake --install` of the build into a fresh prefix, then the consumer
# program (tests/install) configured against that prefix alone, built, and run on a tiny model.
#   run.sh BUILD_DIR KESTREL_SYNTH
set -euo pipefail
build="$1" synth="$2"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/kestrel-install-test.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/include/kestrel/kestrel.h"
test -f "$work/prefix/lib/cmake/kestrel/kestrelConfig.cmake"
cmake -S "$here" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log"
cmake --build "$work/consumer" > "$work/build.log"
"$synth" --shape tiny --dtype gptq --bits 4 --group-size 32 --seed 3 --out "$work/model" > /dev/null 2>&1
"$work/consumer/consumer" "$work/model"
