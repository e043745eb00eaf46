// A gtest fixture base for suites that share one tiny kestrel-synth model directory and its
// SentencePiece tokenizer (control pieces <s>, </s>; byte pieces), written once per suite.
// Link kestrel_synth and the tokenizer to use it.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>

#include "tests/support/synth_model.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::test {

class TinyTokenizerSuite : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::filesystem::path(
        write_tiny_model({"fp16", "fp16", 16, 0, false, false, "gptq"}, /*seed=*/0, /*n_layers=*/1));
    tok_ = Tokenizer::load(dir_->string()).release();
  }
  static void TearDownTestSuite() {
    delete tok_;
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static inline std::filesystem::path* dir_ = nullptr;
  static inline Tokenizer* tok_ = nullptr;
};

}  // namespace kestrel::test
