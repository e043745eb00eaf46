#include "tokenizer/tokenizer_file.h"

#include <cstdint>

#include <fmt/format.h>

#include "base/error.h"
#include "base/files.h"

namespace kestrel {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The SAX handler: JSON values built as nlohmann's DOM parser builds them, except inside the
// vocabulary and the merges.
class Reader final : public json::json_sax_t {
 public:
  // `vocab_at` and `merges_at`: the keys leading to them from the root ({} for the root).
  Reader(TokenizerFile& out, std::vector<std::string> vocab_at,
         std::vector<std::string> merges_at)
      : out_(out), vocab_at_(std::move(vocab_at)), merges_at_(std::move(merges_at)) {}

  std::string error;

  bool null() override {
    if (mode_ != Mode::dom) return misplaced("null");
    return value(json());
  }
  bool boolean(bool b) override {
    if (mode_ != Mode::dom) return misplaced(b ? "true" : "false");
    return value(b);
  }
  bool number_integer(number_integer_t n) override { return number(n); }
  bool number_unsigned(number_unsigned_t n) override {
    return number(n > number_unsigned_t(INT64_MAX) ? -1 : number_integer_t(n));
  }
  bool number_float(number_float_t x, const string_t&) override {
    if (mode_ != Mode::dom) return misplaced(fmt::format("{}", x));
    return value(x);
  }
  bool string(string_t& s) override {
    if (mode_ == Mode::merges) {
      if (in_pair_) {
        pair_.push_back(std::move(s));
        return true;
      }
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        return fail(fmt::format("merge {} (\"{}\") is not two tokens separated by a space",
                                out_.merges.size(), s));
      out_.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      return true;
    }
    if (mode_ == Mode::vocab) return fail(fmt::format("token \"{}\" has a string id", key_));
    return value(std::move(s));
  }
  bool binary(binary_t&) override { return fail("binary values are not JSON"); }
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool start_object(std::size_t) override {
    if (mode_ == Mode::dom && at(vocab_at_)) {
      mode_ = Mode::vocab;
      return true;
    }
    if (mode_ != Mode::dom) return fail("unexpected object in the vocabulary or merges");
    return open(json::object());
  }
  bool end_object() override {
    if (mode_ == Mode::vocab) {
      mode_ = Mode::dom;
      out_.has_vocab = true;
      return stack_.empty() || value(json());  // a null in the vocabulary's place
    }
    return close();
  }
  bool start_array(std::size_t) override {
    if (mode_ == Mode::dom && at(merges_at_)) {
      mode_ = Mode::merges;
      return true;
    }
    if (mode_ == Mode::merges && !in_pair_) {
      in_pair_ = true;
      pair_.clear();
      return true;
    }
    if (mode_ != Mode::dom) return fail("unexpected list in the vocabulary or merges");
    return open(json::array());
  }
  bool end_array() override {
    if (mode_ == Mode::merges) {
      if (in_pair_) {
        in_pair_ = false;
        if (pair_.size() != 2)
          return fail(fmt::format("merge {} is not a pair [\"a\", \"b\"]", out_.merges.size()));
        out_.merges.emplace_back(std::move(pair_[0]), std::move(pair_[1]));
        return true;
      }
      mode_ = Mode::dom;
      out_.has_merges = true;
      return value(json());
    }
    return close();
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    return fail(e.what());
  }

 private:
  enum class Mode { dom, vocab, merges };

  bool fail(const std::string& why) {
    if (error.empty()) error = why;
    return false;
  }
  // A value that is not a token id inside the vocabulary, or not a token inside the merges.
  bool misplaced(const std::string& v) {
    if (mode_ == Mode::vocab)
      return fail(fmt::format("token \"{}\" has id {}, not a token id", key_, v));
    return fail(fmt::format("merge {} is {}, not \"a b\" or [\"a\", \"b\"]", out_.merges.size(),
                            v));
  }
  bool number(number_integer_t n) {
    if (mode_ == Mode::vocab) {
      if (n < 0 || n >= (number_integer_t{1} << 30))
        return fail(fmt::format("token \"{}\" has id {}, not a token id", key_, n));
      out_.vocab.emplace_back(std::move(key_), static_cast<int>(n));
      return true;
    }
    if (mode_ == Mode::merges) return misplaced(std::to_string(n));
    return value(n);
  }
  // Whether the value about to start is at `keys` from the root.
  bool at(const std::vector<std::string>& keys) const {
    if (keys.empty()) return stack_.empty();
    if (stack_.size() != keys.size() || !stack_.back()->is_object() || key_ != keys.back())
      return false;
    for (size_t i = 1; i < stack_.size(); ++i)
      if (path_[i] != keys[i - 1]) return false;
    return true;
  }
  json* place(json v) {
    if (stack_.empty()) {
      out_.root = std::move(v);
      return &out_.root;
    }
    json& top = *stack_.back();
    if (top.is_object()) return &(top[key_] = std::move(v));
    top.push_back(std::move(v));
    return &top.back();
  }
  bool value(json v) {
    place(std::move(v));
    return true;
  }
  bool open(json v) {
    const std::string key = !stack_.empty() && stack_.back()->is_object() ? key_ : std::string();
    stack_.push_back(place(std::move(v)));
    path_.push_back(key);
    return true;
  }
  bool close() {
    stack_.pop_back();
    path_.pop_back();
    return true;
  }

  TokenizerFile& out_;
  std::vector<std::string> vocab_at_, merges_at_;
  Mode mode_ = Mode::dom;
  std::vector<json*> stack_;       // the open containers
  std::vector<std::string> path_;  // the key of each open container ("" for the root)
  std::string key_;
  bool in_pair_ = false;
  std::vector<std::string> pair_;
};

}  // namespace

std::string read_file_bytes(const fs::path& path) { return read_regular_file(path.string()); }

TokenizerFile read_tokenizer_file(const fs::path& path, std::vector<std::string> vocab_at,
                                  std::vector<std::string> merges_at) {
  const std::string text = read_file_bytes(path);
  TokenizerFile file;
  Reader r(file, std::move(vocab_at), std::move(merges_at));
  if (!json::sax_parse(text, &r))
    throw Error(fmt::format("{}: malformed {} ({})", path.string(),
                            r.error.find("parse_error") != std::string::npos ? "JSON" : "tokenizer",
                            r.error));
  return file;
}

}  // namespace kestrel
