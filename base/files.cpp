#include "base/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/error.h"

namespace kestrel {

namespace {

// What a non-regular file is, in words.
const char* kind_of(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "neither a file nor a directory";
}

void check_regular(const std::string& path, const struct stat& st) {
  if (S_ISREG(st.st_mode)) return;
  if (S_ISDIR(st.st_mode)) throw Error(path + " is a directory");
  throw Error(path + " is not a regular file (" + kind_of(st.st_mode) + ")");
}

[[noreturn]] void cannot(const std::string& path, int err) {
  if (err == ENOENT || err == ENOTDIR) throw Error(path + ": no such file");
  throw Error(path + ": cannot open (" + std::strerror(err) + ")");
}

}  // namespace

bool path_exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

int open_regular_file(const std::string& path, size_t* size) {
  // stat first so that a FIFO or a device is never opened (opening can block or act on the
  // device); fstat after opening in case the path changed in between. O_NONBLOCK keeps even
  // that race from blocking; it does nothing to reads of a regular file.
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) cannot(path, errno);
  check_regular(path, st);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) cannot(path, errno);
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    cannot(path, err);
  }
  try {
    check_regular(path, st);
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (size) *size = (size_t)st.st_size;
  return fd;
}

std::string read_regular_file(const std::string& path) {
  size_t size = 0;
  const int fd = open_regular_file(path, &size);
  std::string out;
  try {
    out.resize(size);
    size_t got = 0;
    for (;;) {
      if (got == out.size()) out.resize(out.size() + 4096);  // the file grew, or reads to EOF
      const ssize_t n = ::read(fd, out.data() + got, out.size() - got);
      if (n < 0) {
        if (errno == EINTR) continue;
        throw Error(path + ": cannot read (" + std::strerror(errno) + ")");
      }
      if (n == 0) break;
      got += (size_t)n;
    }
    out.resize(got);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return out;
}

}  // namespace kestrel
