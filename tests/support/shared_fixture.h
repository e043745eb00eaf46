// A test suite's expensive inputs (a synthesized model, calibration text sampled from it), made
// once and shared by the processes of one test binary.
//
// gtest_discover_tests runs every case as a process of its own, so a SetUpTestSuite that
// synthesizes a model and samples text from it runs once per case: under the sanitizers that
// was most of the quantizer suites' time. The first process to ask builds the directory under
// an exclusive lock; the others wait on the lock and read what it left.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "base/error.h"

namespace kestrel::test {

// The directory `name` under `root`, made by `build` (which writes into the empty directory it
// is given) unless an earlier process of this same executable made it. The key holds the
// executable's size and modification time, so a rebuilt test never reads what an older build
// left; a stale key's directory is removed when a new one is made. A build that throws leaves
// nothing behind, and the next process tries again.
inline std::filesystem::path shared_fixture(const std::filesystem::path& root,
                                            const std::string& name,
                                            const std::function<void(const std::filesystem::path&)>& build) {
  namespace fs = std::filesystem;
  struct stat st {};
  KESTREL_CHECK(::stat("/proc/self/exe", &st) == 0, "cannot stat the test executable");
  const std::string prefix = name + "-";
  const std::string key = prefix + std::to_string((long long)st.st_size) + "-" +
                          std::to_string((long long)st.st_mtim.tv_sec) + "." +
                          std::to_string((long long)st.st_mtim.tv_nsec);
  fs::create_directories(root);
  const fs::path lock_path = root / (name + ".lock");
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  KESTREL_CHECK(fd >= 0, "cannot open " + lock_path.string());
  struct Unlock {
    int fd;
    ~Unlock() {
      ::flock(fd, LOCK_UN);
      ::close(fd);
    }
  } unlock{fd};
  KESTREL_CHECK(::flock(fd, LOCK_EX) == 0, "cannot lock " + lock_path.string());
  const fs::path dir = root / key;
  if (fs::exists(dir / ".complete")) return dir;
  for (const fs::directory_entry& e : fs::directory_iterator(root))
    if (e.path().filename().string().rfind(prefix, 0) == 0) fs::remove_all(e.path());
  fs::create_directories(dir);
  try {
    build(dir);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(dir, ec);
    throw;
  }
  std::ofstream done(dir / ".complete");
  done << "complete\n";
  done.close();
  KESTREL_CHECK(done.good(), "cannot write " + (dir / ".complete").string());
  return dir;
}

// Token ids, one per line: a fixture's sampled text kept as the ids it was sampled as.
inline void write_ids(const std::filesystem::path& file, const std::vector<int>& ids) {
  std::ofstream out(file);
  for (int id : ids) out << id << "\n";
  out.close();
  KESTREL_CHECK(out.good(), "cannot write " + file.string());
}

inline std::vector<int> read_ids(const std::filesystem::path& file) {
  std::ifstream in(file);
  KESTREL_CHECK(in.good(), "cannot read " + file.string());
  std::vector<int> ids;
  for (int id; in >> id;) ids.push_back(id);
  return ids;
}

}  // namespace kestrel::test
