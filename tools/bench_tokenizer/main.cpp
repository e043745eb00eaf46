// kestrel-bench-tokenizer: one core's speed of a model directory's tokenizer. Loads it
// (median of --repeat loads), then for each text file (its first --mb megabytes): encode
// MB/s with a fresh tokenizer (cold: its word cache empty) and again on the same one (warm),
// decode MB/s of the ids (bytes of text out per second) whole and streamed one id at a time.
// Prints a Markdown table of medians.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <fmt/format.h>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "base/error.h"
#include "tokenizer/tokenizer.h"
#include "tools/median.h"

namespace {

using Clock = std::chrono::steady_clock;
using kestrel::bench::median;

double seconds(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The first `bytes` of the file, cut back to a character boundary.
std::string read_prefix(const std::string& path, size_t bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw kestrel::Error(path + ": cannot open file");
  std::ostringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  if (s.size() > bytes) {
    s.resize(bytes);
    while (!s.empty() && (static_cast<unsigned char>(s.back()) & 0xC0) == 0x80) s.pop_back();
    if (!s.empty() && static_cast<unsigned char>(s.back()) >= 0xC0) s.pop_back();
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"one core's tokenizer speed: load, encode, decode", "kestrel-bench-tokenizer"};
  std::string dir;
  std::vector<std::string> files;
  double mb = 1.0;
  int repeat = 5;
  app.add_option("-m,--model", dir, "model directory (its tokenizer)")->required();
  app.add_option("-f,--file", files, "text file to encode (repeatable)")->required();
  app.add_option("--mb", mb, "megabytes of each file to use")->check(CLI::PositiveNumber);
  app.add_option("-r,--repeat", repeat, "runs per figure (the median is shown)")
      ->check(CLI::PositiveNumber);
  app.set_version_flag("--version", "kestrel-bench-tokenizer " KESTREL_VERSION);
  CLI11_PARSE(app, argc, argv);

  try {
    std::vector<double> loads;
    std::unique_ptr<kestrel::Tokenizer> tok;
    for (int r = 0; r < repeat; ++r)
      loads.push_back(seconds([&] { tok = kestrel::Tokenizer::load(dir); }));
    fmt::print("tokenizer: {} ({}, {} ids), load {:.3f} s\n\n", dir, tok->kind(), tok->vocab_size(),
               median(loads));
    fmt::print("| file | MB | tokens | encode cold MB/s | encode warm MB/s | decode MB/s | "
               "stream MB/s |\n");
    fmt::print("|---|---|---|---|---|---|---|\n");
    for (const std::string& f : files) {
      const std::string text = read_prefix(f, static_cast<size_t>(mb * 1e6));
      const double size = text.size() / 1e6;
      std::vector<double> cold, warm, dec, str;
      std::vector<int> ids;
      for (int r = 0; r < repeat; ++r) {
        auto fresh = kestrel::Tokenizer::load(dir);
        cold.push_back(seconds([&] { ids = fresh->encode(text, false); }));
        warm.push_back(seconds([&] { ids = fresh->encode(text, false); }));
      }
      size_t out = 0;
      for (int r = 0; r < repeat; ++r) {
        dec.push_back(seconds([&] { out = tok->decode(ids).size(); }));
        str.push_back(seconds([&] {
          kestrel::StreamDecoder d(*tok, true);
          size_t n = 0;
          for (int id : ids) n += d.push(id).size();
          n += d.flush().size();
          out = n;
        }));
      }
      const double out_mb = out / 1e6;
      fmt::print("| {} | {:.2f} | {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |\n", f, size, ids.size(),
                 size / median(cold), size / median(warm), out_mb / median(dec),
                 out_mb / median(str));
    }
  } catch (const std::exception& e) {
    std::cerr << "kestrel-bench-tokenizer: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
