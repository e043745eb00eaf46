#!/usr/bin/env bash
# Checks that #include arrows point one way between the layers:
#   base  <-  kernels, tokenizer  <-  models  <-  engine  <-  tools  <-  tests
# A file may include its own layer or a lower one, never a higher one or a sibling
# (kernels and tokenizer know nothing of each other). One rule more: the `kestrel` program
# (tools/kestrel/) is a client of engine/, as llama.cpp's tools/main is of llama.h, and never
# includes models/ or kernels/ (the kernel and model tools beside it may). Prints each
# offending include and exits 1 when there is one.
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
layer() {  # the layer of a path, and its rank
  case "$1" in
    base/*) echo "base 0" ;;
    kernels/*) echo "kernels 1" ;;
    tokenizer/*) echo "tokenizer 1" ;;
    models/*) echo "models 2" ;;
    engine/*) echo "engine 3" ;;
    tools/*) echo "tools 4" ;;
    tests/*) echo "tests 5" ;;
    *) echo "other 9" ;;
  esac
}
bad=0 checked=0
while IFS= read -r file; do
  read -r from_name from_rank <<<"$(layer "$file")"
  while IFS= read -r inc; do
    [ -n "$inc" ] || continue
    checked=$((checked + 1))
    read -r to_name to_rank <<<"$(layer "$inc")"
    [ "$to_name" = other ] && continue  # a path relative to the file's own folder
    if [ "$to_name" != "$from_name" ] && [ "$to_rank" -ge "$from_rank" ]; then
      echo "$file: includes $inc ($from_name may not depend on $to_name)"
      bad=1
    elif [[ "$file" == tools/kestrel/* ]] && { [ "$to_name" = models ] || [ "$to_name" = kernels ]; }; then
      echo "$file: includes $inc (tools/kestrel uses $to_name only through engine/)"
      bad=1
    fi
  done < <(sed -n -E 's/^[[:space:]]*#[[:space:]]*include[[:space:]]+"([^"]+)".*/\1/p' "$file")
done < <(git ls-files -- '*.h' '*.hpp' '*.cpp' '*.cu' '*.cuh')
echo "check-layers: $checked project includes checked"
exit $bad
