#!/usr/bin/env node
// The reference ids the tokenizer tests compare Kestrel's with, from implementations that
// share no code with it: @lenml/tokenizers (transformers.js's tokenizers) for Llama 3's and
// Qwen3's tokenizer.json, gpt-3-encoder (GPT-2's reference algorithm) for vocab.json +
// merges.txt. scripts/fetch-test-tokenizers.sh runs it after fetching them.
//
//   tokenizer-reference.js CORPUS_JSON DIR
//
// The test texts are the corpus's fragments, thousands of random mixtures of them (pieces cut
// at any character, case changed, joined by whitespace runs, CRLF, digits, contractions and
// special-token strings) from a fixed seed, all fragments as one long text, and mixtures with
// invalid UTF-8 bytes (read as U+FFFD per maximal invalid subpart, as Node's decoder does).
// For each tokenizer it writes DIR/reference/NAME.jsonl, one text per line:
//   {"b64": the text's bytes, "ids": ids without specials, "text": their decoding,
//    "ids_special": ids with the specials the tokenizer adds (the first texts only)}
// and DIR/reference/NAME.decode.json: the decoding of every id alone.
"use strict";
const fs = require("fs");
const path = require("path");

const [corpusPath, dirArg] = process.argv.slice(2);
const dir = dirArg && path.resolve(dirArg);
if (!corpusPath || !dirArg) {
  console.error("usage: tokenizer-reference.js CORPUS_JSON DIR");
  process.exit(1);
}
const { TokenizerLoader } = require(path.join(dir, "node_modules/@lenml/tokenizers"));
const gpt2 = require(path.join(dir, "node_modules/gpt-3-encoder"));

// mulberry32: a small seeded generator, so the texts are the same on every machine.
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const rand = rng(20251201);
const pick = (xs) => xs[Math.floor(rand() * xs.length)];
const int = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));

const fragments = JSON.parse(fs.readFileSync(corpusPath, "utf8"));
const separators = [" ", " ", " ", "  ", "   ", "\n", "\n", "\r\n", "\t", " \n", "\n\n", "\n \n",
                    "", "", "'s ", "'LL ", "'T", " 42 ", "2024", " \u00a0", "\r\n\r\n", "    ",
                    ". ", ", ", "; ", " - ", "!\n", "?? ", "\u3000", " \t "];
const specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|reserved_special_token_7|>", "<|im_start|>", "<|im_end|>",
                  "<|endoftext|>", "<think>", "</think>", "<tool_call>", "<|fim_middle|>"];

function piece() {
  const chars = Array.from(pick(fragments));  // code points: a cut never splits one
  if (chars.length === 0) return "";
  const a = int(0, chars.length - 1);
  const b = Math.min(chars.length, a + int(1, 120));
  let s = chars.slice(rand() < 0.3 ? 0 : a, rand() < 0.3 ? chars.length : b).join("");
  const r = rand();
  if (r < 0.1) s = s.toUpperCase();
  else if (r < 0.2) s = s.toLowerCase();
  else if (r < 0.25) s = Array.from(s).map((c) => (rand() < 0.5 ? c.toUpperCase() : c.toLowerCase())).join("");
  return s;
}

function mixture() {
  let s = "";
  const n = int(1, 6);
  for (let i = 0; i < n; ++i) {
    if (i > 0) s += pick(separators);
    if (rand() < 0.15) s += pick(specials);
    s += piece();
  }
  return s;
}

// Bytes that are not UTF-8 (stray continuation bytes, truncated and overlong sequences,
// surrogates, code points past U+10FFFF) put into a text.
const badBytes = [[0x80], [0xbf], [0xc0, 0xaf], [0xc3], [0xe2, 0x82], [0xf0, 0x9f, 0x98],
                  [0xed, 0xa0, 0x80], [0xf4, 0x90, 0x80, 0x80], [0xf8, 0x88, 0x80, 0x80, 0x80],
                  [0xff], [0xfe, 0xff], [0xe0, 0x80, 0x80], [0xc2], [0xf5]];
function corrupted() {
  const text = Buffer.from(mixture(), "utf8");
  const parts = [];
  let at = 0;
  const n = int(1, 4);
  for (let i = 0; i < n; ++i) {
    const cut = int(at, text.length);
    parts.push(text.subarray(at, cut), Buffer.from(pick(badBytes)));
    at = cut;
  }
  parts.push(text.subarray(at));
  return Buffer.concat(parts);
}

const texts = fragments.map((f) => Buffer.from(f, "utf8"));
for (let i = 0; i < 12000; ++i) texts.push(Buffer.from(mixture(), "utf8"));
texts.push(Buffer.from(fragments.join("\n"), "utf8"));
for (let i = 0; i < 500; ++i) texts.push(corrupted());

function write(name, encode, encodeSpecial, decode, vocabSize) {
  const lines = [];
  texts.forEach((buf, i) => {
    const text = buf.toString("utf8");
    const ids = encode(text);
    const rec = { b64: buf.toString("base64"), ids, text: decode(ids) };
    if (i < fragments.length && encodeSpecial) rec.ids_special = encodeSpecial(text);
    lines.push(JSON.stringify(rec));
  });
  fs.writeFileSync(path.join(dir, "reference", name + ".jsonl"), lines.join("\n") + "\n");
  const each = [];
  for (let id = 0; id < vocabSize; ++id) each.push(decode([id]));
  fs.writeFileSync(path.join(dir, "reference", name + ".decode.json"), JSON.stringify(each));
  console.log(`tokenizer-reference: ${name}: ${texts.length} texts, ${vocabSize} ids`);
}

for (const name of ["llama3", "qwen3"]) {
  const read = (f) => JSON.parse(fs.readFileSync(path.join(dir, name, f), "utf8"));
  const tokenizerJSON = read("tokenizer.json");
  const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig: read("tokenizer_config.json") });
  let size = Object.keys(tokenizerJSON.model.vocab).length;
  for (const t of tokenizerJSON.added_tokens) size = Math.max(size, t.id + 1);
  write(name,
        (t) => tok.encode(t, { add_special_tokens: false }),
        (t) => tok.encode(t, { add_special_tokens: true }),
        (ids) => (ids.length ? tok.decode(ids, { skip_special_tokens: true, clean_up_tokenization_spaces: false }) : ""),
        size);
}

// GPT-2: transformers' GPT2Tokenizer matches its special token <|endoftext|> in the text
// before BPE; gpt-3-encoder does not, so the text is cut there first.
const eot = "<|endoftext|>", eotId = 50256;
write("gpt2",
      (t) => t.split(eot).flatMap((part, i) => (i > 0 ? [eotId] : []).concat(gpt2.encode(part))),
      null,
      (ids) => gpt2.decode(ids.filter((id) => id !== eotId)),
      eotId + 1);
