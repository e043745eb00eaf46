// The tokenizer of a synthetic model: a small SentencePiece BPE model (Llama conventions:
// <unk> 0, <s> 1, </s> 2, byte fallback) trained on generated English-like text.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kestrel::synth {

// `n_lines` lines of English-like prose (sentences from word lists and templates, with
// punctuation, numbers, quotes and a few accented words), the same for the same seed.
std::vector<std::string> english_like_corpus(uint64_t seed, int n_lines);

// Trains a BPE tokenizer of about `vocab_size` pieces on english_like_corpus() and returns
// the serialized model proto (the bytes of a tokenizer.model). Deterministic.
std::string train_tokenizer(int vocab_size);

}  // namespace kestrel::synth
