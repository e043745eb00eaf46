#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) in the sanitized build, build-asan (clang,
# AddressSanitizer and UndefinedBehaviorSanitizer; scripts/cmake-common.sh: configure_sanitized,
# shared with scripts/sanitize.sh), then either
#   fuzz.sh replay            runs every target once over its seed corpus (CI), or
#   fuzz.sh run [SECONDS [TARGET...]]
#                             fuzzes each target (default: every one) in turn for SECONDS
#                             (default 60) from its seeds and what earlier runs kept in
#                             build-asan/corpus/<target>/; FUZZ_RUNS=N also stops a target after
#                             N executions (the hardening runs: 600 s or 1M executions), and
#                             FUZZ_SEED=N fixes libFuzzer's seed (CI: 15 s per target, seed 1).
# The seeds are the repository's own real files: chat templates, tokenizer fixtures, the
# family models' configs and checkpoints. Any crash, sanitizer report, leak, timeout or
# exception other than kestrel::Error fails the run and leaves the input in build-asan/fuzz/.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-replay}"
seconds="${2:-60}"
bash scripts/install-deps.sh --fuzz
source scripts/cmake-common.sh
configure_sanitized build-asan
all_targets=(fuzz_safetensors fuzz_config fuzz_tokenizer_json fuzz_bpe_encode fuzz_jinja
             fuzz_batch_line fuzz_messages fuzz_server_request fuzz_server_http fuzz_grammar
             fuzz_tool_calls)
targets=("${all_targets[@]}")
if [ "$mode" = run ] && [ $# -gt 2 ]; then targets=("${@:3}"); fi
cmake --build build-asan -j"${FUZZ_JOBS:-$(nproc)}" --target "${all_targets[@]}"

# Seed corpora: folders of whole files, and single files a target reads as its input (the
# first byte of safetensors/config/tokenizer inputs selects a variant, so seeds are prefixed).
seeds="build-asan/fuzz/seeds"
rm -rf "$seeds"
for t in "${all_targets[@]}"; do mkdir -p "$seeds/$t"; done
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
# GPTQModel's per-module dynamic rules: alone, and in the tiny GPTQ Llama's config.json, where
# the checkpoint checks resolve them against its linears (the rules keep its one format).
python3 - "$seeds/fuzz_config" tests/data/families/llama-gptq/config.json <<'PY'
import json, sys
out, src = sys.argv[1], sys.argv[2]
dyn = {"-:lm_head": {}, "+:model\\.layers\\.(?P<n>1)\\..*": {"bits": 4, "sym": True},
       ".*\\.0\\.mlp\\.[a-z]{,4}_proj\\Z": {"group_size": 32, "desc_act": True}}
q = {"quant_method": "gptq", "bits": 8, "group_size": 64, "dynamic": dyn}
open(out + "/quant-dynamic", "wb").write(b"\x00" + json.dumps(q).encode())
c = json.load(open(src))
c["quantization_config"]["dynamic"] = dyn
open(out + "/config-llama-gptq-dynamic", "wb").write(b"\x01" + json.dumps(c).encode())
PY
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
# What the chat templates above do not use: macros, call blocks, namespaces given values,
# loop.changed (each once held its scope in a cycle).
printf '%s' '{% macro f(n, s="-") %}{% if n > 0 %}{{ s }}{{ f(n - 1, s) }}{% endif %}{% endmacro %}{{ f(3) }}{% call f(1) %}x{% endcall %}' \
  > "$seeds/fuzz_jinja/macros"
printf '%s' '{% set ns = namespace(n=0, m=[]) %}{% for x in messages %}{% set ns.n = ns.n + 1 %}{{ loop.changed(x) }}{{ loop.cycle("a", "b") }}{% endfor %}{{ ns.n }}' \
  > "$seeds/fuzz_jinja/namespace"
cp README.md docs/design.md "$seeds/fuzz_bpe_encode/"
python3 - "$seeds/fuzz_bpe_encode" <<'PY'
import json, sys
texts = json.load(open("tests/data/tokenizers/corpus.json"))
texts = texts if isinstance(texts, list) else texts.get("texts", [])
for i, t in enumerate(texts[:300]):
    open("%s/c%d" % (sys.argv[1], i), "w", encoding="utf-8", errors="surrogatepass").write(t)
PY
# Batch-file lines as the README and docs/cli.md write them, and every conversation of the
# chat template goldens as a --messages file.
python3 - "$seeds" <<'PY'
import json, sys
out = sys.argv[1]
lines = [
    {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0},
    {"prompt": "Write a haiku about rivers", "stop": ["\n\n"], "id": "haiku-1"},
    {"prompt": "def fib(n):", "max_tokens": 64, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
     "seed": 42, "stop": "\n", "id": 7},
    {"prompt": "Caf\u00e9 \u2014 \U0001f600", "temperature": 0.7, "id": None},
    {"prompt": "Yes or no?", "grammar": "root ::= (\"yes\" | \"no\") [.!]?"},
    {"prompt": "A city", "json_schema": {"type": "object", "properties": {"city": {"type": "string"}},
     "required": ["city"]}},
    {"prompt": "Anything", "json_object": True, "n_predict": 64},
]
for i, l in enumerate(lines):
    open("%s/fuzz_batch_line/line%d" % (out, i), "w").write(json.dumps(l) + "\n")
seen = set()
for c in json.load(open("tests/data/chat_templates/goldens.json"))["cases"]:
    m = json.dumps(c["context"].get("messages", []), ensure_ascii=False, indent=1)
    if m not in seen:
        seen.add(m)
        open("%s/fuzz_messages/m%d.json" % (out, len(seen)), "w", encoding="utf-8").write(m)
# kestrel serve's bodies: the first byte picks the endpoint (chat, completions, tokenize,
# detokenize), as fuzz_server_request reads it.
msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
bodies = [
    (0, {"model": "m", "messages": msgs, "max_tokens": 16, "temperature": 0.7, "top_p": 0.9,
         "seed": -1, "stop": ["\n\n", "END"], "stream": True,
         "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 3,
         "presence_penalty": 0.5, "frequency_penalty": -0.5, "top_k": 40, "min_p": 0.05,
         "repeat_penalty": 1.1, "n": 1, "user": "u"}),
    (0, {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
         "max_completion_tokens": 8, "tool_choice": "none",
         "response_format": {"type": "text"}, "logit_bias": {}}),
    (1, {"prompt": "Once upon a time", "max_tokens": 32, "stop": "the", "logprobs": 2,
         "ignore_eos": True}),
    (1, {"prompt": [1, 450, 4996, 17354], "max_tokens": 4, "seed": 18446744073709551615}),
    (2, {"content": "Hello world", "add_special": True, "with_pieces": True}),
    (3, {"tokens": [1, 15043, 3186]}),
]
for i, (endpoint, b) in enumerate(bodies):
    open("%s/fuzz_server_request/b%d" % (out, i), "wb").write(bytes([endpoint]) + json.dumps(b).encode())
# kestrel serve's HTTP: one connection's bytes each, as clients write them: pipelined
# requests, bodies by length and chunked, HEAD, a CORS preflight, Expect, the refusals' shapes.
def req(method, path, body=b"", headers=()):
    h = "%s %s HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n" % (method, path)
    for x in headers:
        h += x + "\r\n"
    if body and not any(x.lower().startswith("transfer-encoding") for x in headers):
        h += "Content-Length: %d\r\n" % len(body)
    return h.encode() + b"\r\n" + body
chat = json.dumps(bodies[0][1]).encode()
http = {
    "pipelined": req("GET", "/health") + req("HEAD", "/health") + req("GET", "/v1/models/m?x=%20y"),
    "chat": req("POST", "/v1/chat/completions", chat, ["Content-Type: application/json", "Authorization: Bearer k"]),
    "stream": req("POST", "/v1/completions", json.dumps({"prompt": "a", "stream": True}).encode(),
                  ["Connection: close"]),
    "chunked": req("POST", "/tokenize", b"6\r\n{\"cont\r\n11\r\nent\": \"Hello\", \"x\"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n",
                   ["Transfer-Encoding: chunked"]) + req("POST", "/detokenize", b'{"tokens": [1, 2]}'),
    "preflight": req("OPTIONS", "/v1/chat/completions", headers=["Origin: http://a.example",
                     "Access-Control-Request-Method: POST", "Access-Control-Request-Headers: authorization"]),
    "expect": req("POST", "/tokenize", b'{"content": "x"}', ["Expect: 100-continue"]),
    "http10": b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" + req("GET", "/health"),
    "conflict": req("POST", "/tokenize", b'{"content": "x"}', ["Content-Length: 3"]),
    "refusals": req("GET", "/v1/completions") + req("POST", "/health") + req("POST", "/tokenize") +
                req("GET", "/nothing", headers=["Authorization: Bearer wrong"]),
}
for name, data in http.items():
    open("%s/fuzz_server_http/%s" % (out, name), "wb").write(data)
PY
# Grammars (first byte 0: GBNF, then after a 0x00 the bytes to match; 1: a JSON Schema): the
# forms docs/grammar.md lists, and schemas with each supported keyword.
python3 - "$seeds/fuzz_grammar" <<'PY'
import json, sys
out = sys.argv[1]
gbnf = [
    ('root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [A-Z] [a-z]{1,5}\n', "hello Ada!"),
    ('root ::= "[" ws (value ("," ws value)*)? "]"\nvalue ::= [0-9]+ | "\\"" [^"\\\\]* "\\""\nws ::= [ \\t\\n]*\n', '[1, "x\u00e9"]'),
    ('# comment\nroot ::= ( "a" | [b-d] )* "\\x41" "\\u00e9" . [^\\n]{1,} \n', "abcA\u00e9z"),
    ('root ::= x{2,4} y?\nx ::= "ab"\ny ::= [\\u4e00-\\u9fff]+\n', "abab\u4e2d"),
]
for i, (g, text) in enumerate(gbnf):
    open("%s/gbnf%d" % (out, i), "wb").write(b"\x00" + g.encode() + b"\x00" + text.encode())
schemas = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
     "age": {"type": "integer", "minimum": 0, "maximum": 150},
     "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}},
     "required": ["name"], "additionalProperties": False},
    {"type": ["string", "null"], "pattern": "^[a-z]{2,4}(-\\d+)?$"},
    {"anyOf": [{"type": "number"}, {"const": "x"}, {"type": "string", "format": "date-time"}]},
    {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "boolean"},
     "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"},
    {"type": "object", "additionalProperties": {"type": "integer"}},
]
for i, s in enumerate(schemas):
    open("%s/schema%d" % (out, i), "wb").write(b"\x01" + json.dumps(s).encode())
PY

# Replies with tool calls in each format (the first byte picks hermes, llama3 or mistral by its
# value mod 3, and the piece size of the streamed read).
python3 - "$seeds/fuzz_tool_calls" <<'PY'
import sys
out = sys.argv[1]
call = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "s": "}]\\" <tool_call>"}}'
replies = [
    (0, "Let me check.\n<tool_call>\n" + call + "\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"),
    (3, "<tool_call>\n{\"arguments\": {\"a\": null}, \"name\": \"g\"}"),
    (1, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'),
    (4, '{"name": "get_weather", "parameters": {"city": "Oslo"}} done'),
    (2, '[TOOL_CALLS][{"name": "f", "arguments": {"q": [true, false]}, "id": "a1b2c3d4e"}, ' + call + ']'),
    (5, "No call here, just [brackets] and {braces}."),
]
for i, (b, text) in enumerate(replies):
    open("%s/r%d" % (out, i), "wb").write(bytes([b]) + text.encode())
PY

status=0
for t in "${targets[@]}"; do
  corpus="build-asan/corpus/$t"
  mkdir -p "$corpus"
  common=(-timeout=10 -rss_limit_mb=4096 -artifact_prefix="build-asan/fuzz/$t-")
  [ -f "tests/fuzz/$t.dict" ] && common+=(-dict="tests/fuzz/$t.dict")
  if [ "$mode" = replay ]; then
    if ! ASAN_OPTIONS=detect_leaks=1 "./build-asan/fuzz/$t" "${common[@]}" -runs=0 \
        "$seeds/$t" "$corpus" > "build-asan/fuzz/$t.log" 2>&1; then
      echo "fuzz: $t failed on its corpus (build-asan/fuzz/$t.log)"; tail -20 "build-asan/fuzz/$t.log"; status=1
    else
      echo "fuzz: $t replayed $(grep -o 'INITED.*' "build-asan/fuzz/$t.log" | head -1)"
    fi
  else
    runs=()
    [ -n "${FUZZ_RUNS:-}" ] && runs=(-runs="$FUZZ_RUNS")
    [ -n "${FUZZ_SEED:-}" ] && runs+=(-seed="$FUZZ_SEED")
    start=$SECONDS
    if ! ASAN_OPTIONS=detect_leaks=1 "./build-asan/fuzz/$t" "${common[@]}" \
        -max_total_time="$seconds" "${runs[@]}" -print_final_stats=1 \
        "$corpus" "$seeds/$t" > "build-asan/fuzz/$t.log" 2>&1; then
      echo "fuzz: $t found a problem (build-asan/fuzz/$t.log)"; tail -30 "build-asan/fuzz/$t.log"; status=1
    else
      echo "fuzz: $t $(grep -E 'stat::number_of_executed_units' "build-asan/fuzz/$t.log" | awk '{print $2}') runs in $((SECONDS - start)) s, $(ls "$corpus" | wc -l) inputs kept"
    fi
  fi
done
exit $status
