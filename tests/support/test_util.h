// Helpers shared by the tests that run the executables or write model directories.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <system_error>

namespace kestrel::test {

// A directory of this test process's own, removed when the process ends. CTest runs every
// case as its own process, several at a time, so nothing may live at a fixed shared path.
inline const std::filesystem::path& scratch() {
  struct Dir {
    std::filesystem::path path = std::filesystem::temp_directory_path() /
                                 ("kestrel_test_" + std::to_string(getpid()));
    Dir() { std::filesystem::create_directories(path); }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Dir dir;
  return dir.path;
}

// Lines of a command's output: newlines, and a last line without one.
inline int lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n + (!s.empty() && s.back() != '\n');
}

struct CommandResult {
  int code = -1;  // exit status; -1 when the command did not exit normally
  std::string out, err;
};

// Runs a shell command, capturing stdout and stderr separately.
inline CommandResult run_command(const std::string& cmd) {
  const std::filesystem::path err_file = scratch() / "stderr.txt";
  CommandResult r;
  FILE* p = popen((cmd + " 2>" + err_file.string()).c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_file);
  r.err.assign(std::istreambuf_iterator<char>(in), {});
  return r;
}

// Writes `text` to `path` as it is (binary).
inline void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// The whole of a file, as it is (binary); empty when it cannot be read.
inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// English-like text from a small vocabulary with random punctuation and line breaks: `words`
// words, the same for the same seed (perplexity and calibration inputs).
inline std::string make_text(int words, uint32_t seed) {
  static const char* kWords[] = {"the", "river", "runs", "under", "a", "stone", "bridge", "and",
                                 "kernel", "module", "loads", "when", "user", "asks", "for",
                                 "python", "file", "opens", "with", "data"};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> w(0, 19), punct(0, 9);
  std::string s;
  for (int i = 0; i < words; ++i) {
    s += kWords[w(rng)];
    const int p = punct(rng);
    s += p == 0 ? ".\n" : p == 1 ? ", " : " ";
  }
  return s;
}

}  // namespace kestrel::test
