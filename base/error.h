// Errors. A user's mistake (missing file, unsupported config, prompt too long) is a
// kestrel::Error carrying one line that names what and where; the CLI prints it and exits
// non-zero. Library code never calls exit() or abort().
#pragma once

#include <stdexcept>
#include <string>

namespace kestrel {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Thrown for "the GPU is not usable" situations that the CLI turns into a device hint.
class DeviceError : public Error {
 public:
  using Error::Error;
};

}  // namespace kestrel

// KESTREL_CHECK(cond, msg): throws kestrel::Error(msg) when cond is false. msg is any
// expression convertible to std::string, evaluated only on failure.
#define KESTREL_CHECK(cond, msg)                       \
  do {                                                 \
    if (!(cond)) throw ::kestrel::Error(std::string(msg)); \
  } while (0)
