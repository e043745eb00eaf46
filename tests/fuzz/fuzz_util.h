// What the fuzz targets share: a private scratch folder in memory-backed /dev/shm (or /tmp)
// into which an input is written as the file a loader opens, and the rule that a bad input
// may only end in kestrel::Error: any other exception escaping a loader is a finding (a
// library's message reaching the user), as is any crash or sanitizer report.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>

#include "base/error.h"

namespace kestrel::fuzz {

inline const std::filesystem::path& scratch() {
  static const std::filesystem::path dir = [] {
    const std::filesystem::path base =
        std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path();
    std::filesystem::path d = base / ("kestrel-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

inline void write_file(const std::filesystem::path& p, const uint8_t* data, size_t n) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), (std::streamsize)n);
}

// Runs fn; kestrel::Error is the expected outcome of a bad input, anything else aborts.
template <class Fn>
void expect_only_kestrel_errors(Fn&& fn) {
  try {
    fn();
  } catch (const Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "escaped exception (not kestrel::Error): %s\n", e.what());
    std::abort();
  }
}

}  // namespace kestrel::fuzz
