#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer into build-fuzz, then either
#   fuzz.sh replay            runs every target once over its seed corpus (CI), or
#   fuzz.sh run [SECONDS]     fuzzes every target for SECONDS (default 60) from its seeds,
#                             new inputs kept in build-fuzz/corpus/<target>/.
# The seeds are the repository's own real files: chat templates, tokenizer fixtures, the
# family models' configs and checkpoints. Any crash, sanitizer report, leak, timeout or
# exception other than kestrel::Error fails the run and leaves the input in build-fuzz/.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-replay}"
seconds="${2:-60}"
command -v clang++ >/dev/null || { echo "fuzz: clang++ not found (apt-get install clang)" >&2; exit 1; }
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CUDA_HOST_COMPILER=g++ \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DKESTREL_BUILD_TESTS=OFF -DKESTREL_FUZZ=ON >/dev/null
targets=(fuzz_safetensors fuzz_config fuzz_tokenizer_json fuzz_bpe_encode fuzz_jinja)
cmake --build build-fuzz -j"$(nproc)" --target "${targets[@]}"

# Seed corpora: folders of whole files, and single files a target reads as its input (the
# first byte of safetensors/config/tokenizer inputs selects a variant, so seeds are prefixed).
seeds="build-fuzz/seeds"
rm -rf "$seeds"
mkdir -p "$seeds"/{fuzz_safetensors,fuzz_config,fuzz_tokenizer_json,fuzz_bpe_encode,fuzz_jinja}
prefixed() {  # prefixed BYTE FILE OUT
  { printf "\\x$1"; cat "$2"; } > "$3"
}
for f in tests/data/families/*/config.json; do
  n="$(basename "$(dirname "$f")")"
  prefixed 01 "$f" "$seeds/fuzz_config/config-$n"
done
for f in tests/data/families/*-gptq/config.json; do
  n="$(basename "$(dirname "$f")")"
  python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["quantization_config"]))' \
    "$f" > "$seeds/q.json"
  prefixed 00 "$seeds/q.json" "$seeds/fuzz_config/quant-$n"
done
rm -f "$seeds/q.json"
head -c 4096 tests/data/families/opt/model.safetensors > "$seeds/st-head"  # a cut file
prefixed 01 "$seeds/st-head" "$seeds/fuzz_safetensors/truncated"
python3 - "$seeds/fuzz_safetensors" <<'PY'
import json, struct, sys
out = sys.argv[1]
def st(header, data=b""):
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data
with open(out + "/small", "wb") as f:
    f.write(b"\x01" + st({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
                          "__metadata__": {"format": "pt"}}, b"\x00\x3c\x00\x40"))
index = {"metadata": {"total_size": 14},
         "weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors",
                        "model.norm.weight": "model-00001-of-00001.safetensors"}}
with open(out + "/index", "wb") as f:
    f.write(b"\x00" + json.dumps(index).encode())
PY
for d in tests/data/tokenizers/*/; do
  n="$(basename "$d")"
  prefixed 01 "$d/tokenizer.json" "$seeds/fuzz_tokenizer_json/$n"
  prefixed 00 "$d/tokenizer.json" "$seeds/fuzz_tokenizer_json/$n-noconfig"
done
cp tests/data/chat_templates/*.jinja "$seeds/fuzz_jinja/"
cp README.md docs/design.md "$seeds/fuzz_bpe_encode/"
python3 - "$seeds/fuzz_bpe_encode" <<'PY'
import json, sys
texts = json.load(open("tests/data/tokenizers/corpus.json"))
texts = texts if isinstance(texts, list) else texts.get("texts", [])
for i, t in enumerate(texts[:300]):
    open("%s/c%d" % (sys.argv[1], i), "w", encoding="utf-8", errors="surrogatepass").write(t)
PY

status=0
for t in "${targets[@]}"; do
  corpus="build-fuzz/corpus/$t"
  mkdir -p "$corpus"
  common=(-timeout=10 -rss_limit_mb=4096 -artifact_prefix="build-fuzz/$t-")
  if [ "$mode" = replay ]; then
    if ! ASAN_OPTIONS=detect_leaks=1 "./build-fuzz/fuzz/$t" "${common[@]}" -runs=0 \
        "$seeds/$t" "$corpus" > "build-fuzz/$t.log" 2>&1; then
      echo "fuzz: $t failed on its corpus (build-fuzz/$t.log)"; tail -20 "build-fuzz/$t.log"; status=1
    else
      echo "fuzz: $t replayed $(grep -o 'INITED.*' "build-fuzz/$t.log" | head -1)"
    fi
  else
    if ! "./build-fuzz/fuzz/$t" "${common[@]}" -max_total_time="$seconds" -print_final_stats=1 \
        "$corpus" "$seeds/$t" > "build-fuzz/$t.log" 2>&1; then
      echo "fuzz: $t found a problem (build-fuzz/$t.log)"; tail -30 "build-fuzz/$t.log"; status=1
    else
      echo "fuzz: $t $(grep -E 'stat::number_of_executed_units' "build-fuzz/$t.log" | awk '{print $2}') runs in ${seconds} s, $(ls "$corpus" | wc -l) inputs kept"
    fi
  fi
done
exit $status
