#!/usr/bin/env node
// The reference ids the tokenizer tests compare Kestrel's with, from implementations that
// share no code with it: @lenml/tokenizers (transformers.js's tokenizers) for Llama 3's and
// Qwen3's tokenizer.json and for the fixtures of tests/data/tokenizers, gpt-3-encoder (GPT-2's
// reference algorithm) for vocab.json + merges.txt. scripts/fetch-test-tokenizers.sh runs it
// after fetching them.
//
//   tokenizer-reference.js DATA DIR
//
// DATA is tests/data/tokenizers (corpus.json, fixture_cases.json and the fixtures); DIR holds
// the fetched files and gets the results.
//
// The test texts are the corpus's fragments, thousands of random mixtures of them (pieces cut
// at any character, case changed, joined by whitespace runs, CRLF, digits, contractions and
// special-token strings) from a fixed seed, all fragments as one long text, and mixtures with
// invalid UTF-8 bytes (read as U+FFFD per maximal invalid subpart, as Node's decoder does).
// For each tokenizer it writes DIR/reference/NAME.jsonl, one text per line:
//   {"b64": the text's bytes, "ids": ids without specials, "text": their decoding,
//    "ids_special": ids with the specials the tokenizer adds (the first texts only)}
// DIR/reference/NAME.decode.json: the decoding of every id alone, and
// DIR/reference/NAME.sequences.jsonl: {"ids", "text"} for hundreds of id sequences from a fixed
// seed, made to split characters over tokens: any ids; windows of a text's ids, which start
// and end anywhere; the UTF-8 bytes of characters as byte tokens, cut at any byte, between
// ordinary tokens; and all of these with special and added tokens put between their ids.
// For the fixtures it writes DIR/reference/fixtures.json: for each case of fixture_cases.json,
// each text's ids without and with specials and the decoding of the first.
"use strict";
const fs = require("fs");
const path = require("path");

const [dataArg, dirArg] = process.argv.slice(2);
const dir = dirArg && path.resolve(dirArg);
if (!dataArg || !dirArg) {
  console.error("usage: tokenizer-reference.js DATA DIR");
  process.exit(1);
}
const data = path.resolve(dataArg);
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

const fragments = JSON.parse(fs.readFileSync(path.join(data, "corpus.json"), "utf8"));
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

// GPT-2's byte-level alphabet: the character that spells each byte.
const byteChars = (() => {
  const chars = [];
  let next = 256;
  for (let b = 0; b < 256; ++b) {
    const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
    chars.push(String.fromCodePoint(printable ? b : next++));
  }
  return chars;
})();

// Id sequences for the streaming decoder (see the top), from their own generator so that the
// texts above do not depend on them.
function sequences(encode, vocabSize, byteIds, addedIds) {
  const r = rng(20251202);
  const rint = (lo, hi) => lo + Math.floor(r() * (hi - lo + 1));
  const rpick = (xs) => xs[Math.floor(r() * xs.length)];
  const wide = fragments.filter((f) => /[^\x00-\x7f]/.test(f));
  const window = () => {
    const chars = Array.from(rpick(wide));
    const a = rint(0, chars.length - 1);
    const ids = encode(chars.slice(a, a + rint(1, 40)).join(""));
    const from = rint(0, Math.max(0, ids.length - 1));
    return ids.slice(from, from + rint(1, 16));
  };
  const byteRun = () => {
    const chars = Array.from(rpick(wide)).filter((c) => c.codePointAt(0) > 0x7f);
    if (chars.length === 0) return [];
    const a = rint(0, chars.length - 1);
    const bytes = Buffer.from(chars.slice(a, a + rint(1, 3)).join(""), "utf8");
    const from = rint(0, bytes.length - 1);
    return Array.from(bytes.subarray(from, rint(from + 1, bytes.length)), (b) => byteIds[b]);
  };
  const out = [];
  for (let i = 0; i < 400; ++i) {
    let ids = [];
    switch (i % 4) {
      case 0:
        for (let n = rint(1, 12); n > 0; --n) ids.push(rint(0, vocabSize - 1));
        break;
      case 1:
        ids = window();
        break;
      case 2:
        ids = [...(r() < 0.5 ? window() : []), ...byteRun(), ...(r() < 0.5 ? window() : [])];
        break;
      default: {
        for (let n = rint(2, 4); n > 0; --n) {
          ids.push(...(r() < 0.5 ? window() : byteRun()));
          if (r() < 0.7) ids.push(rpick(addedIds));
          else ids.push(rint(0, vocabSize - 1));
        }
        // Inside a character too: an added token between the bytes of a run.
        const run = byteRun();
        const at = rint(0, run.length);
        ids.push(...run.slice(0, at), rpick(addedIds), ...run.slice(at));
      }
    }
    if (ids.length === 0) ids = [rint(0, vocabSize - 1)];
    out.push(ids);
  }
  return out;
}

function write(name, encode, encodeSpecial, decode, vocabSize, byteIds, addedIds) {
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
  const seqs = sequences(encode, vocabSize, byteIds, addedIds);
  fs.writeFileSync(path.join(dir, "reference", name + ".sequences.jsonl"),
                   seqs.map((ids) => JSON.stringify({ ids, text: decode(ids) })).join("\n") + "\n");
  console.log(`tokenizer-reference: ${name}: ${texts.length} texts, ${vocabSize} ids, ` +
              `${seqs.length} id sequences`);
}

const decodeOptions = { skip_special_tokens: true, clean_up_tokenization_spaces: false };
const lenmlDecode = (tok) => (ids) => (ids.length ? tok.decode(ids, decodeOptions) : "");

for (const name of ["llama3", "qwen3"]) {
  const read = (f) => JSON.parse(fs.readFileSync(path.join(dir, name, f), "utf8"));
  const tokenizerJSON = read("tokenizer.json");
  const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON,
                                               tokenizerConfig: read("tokenizer_config.json") });
  let size = Object.keys(tokenizerJSON.model.vocab).length;
  for (const t of tokenizerJSON.added_tokens) size = Math.max(size, t.id + 1);
  write(name,
        (t) => tok.encode(t, { add_special_tokens: false }),
        (t) => tok.encode(t, { add_special_tokens: true }),
        lenmlDecode(tok),
        size,
        byteChars.map((c) => tokenizerJSON.model.vocab[c]),
        tokenizerJSON.added_tokens.map((t) => t.id));
}

// GPT-2: transformers' GPT2Tokenizer matches its special token <|endoftext|> in the text
// before BPE; gpt-3-encoder does not, so the text is cut there first.
const eot = "<|endoftext|>", eotId = 50256;
const gpt2Vocab = JSON.parse(fs.readFileSync(path.join(dir, "gpt2", "vocab.json"), "utf8"));
write("gpt2",
      (t) => t.split(eot).flatMap((part, i) => (i > 0 ? [eotId] : []).concat(gpt2.encode(part))),
      null,
      (ids) => gpt2.decode(ids.filter((id) => id !== eotId)),
      eotId + 1,
      byteChars.map((c) => gpt2Vocab[c]),
      [eotId]);

// The fixtures: each case of fixture_cases.json is a fixture with a JSON merge patch.
function mergePatch(target, patch) {
  if (patch === null || typeof patch !== "object" || Array.isArray(patch)) return patch;
  const isObject = target !== null && typeof target === "object" && !Array.isArray(target);
  const out = isObject ? { ...target } : {};
  for (const [k, v] of Object.entries(patch)) {
    if (v === null) delete out[k];
    else out[k] = mergePatch(out[k], v);
  }
  return out;
}
const spec = JSON.parse(fs.readFileSync(path.join(data, "fixture_cases.json"), "utf8"));
const fixtureCases = spec.cases.map((c) => {
  const base = JSON.parse(fs.readFileSync(path.join(data, c.fixture, "tokenizer.json"), "utf8"));
  const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON: mergePatch(base, c.patch),
                                               tokenizerConfig: {} });
  return {
    name: c.name,
    results: spec.texts.map((text) => {
      const ids = tok.encode(text, { add_special_tokens: false });
      return { text, ids, ids_special: tok.encode(text, { add_special_tokens: true }),
               decoded: lenmlDecode(tok)(ids) };
    }),
  };
});
fs.writeFileSync(path.join(dir, "reference", "fixtures.json"),
                 JSON.stringify({ cases: fixtureCases }));
console.log(`tokenizer-reference: fixtures: ${fixtureCases.length} cases, ` +
            `${spec.texts.length} texts`);
