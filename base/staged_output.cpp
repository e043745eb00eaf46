// Staged outputs: a registry of the temporaries not yet committed, shared by the destructors,
// commit() and the thread that cleans up after a signal. Its mutex orders them: a signal that
// arrives during a commit waits for the rename, and once the cleanup thread holds the mutex no
// commit can start (it keeps it until the process exits).
#include "base/staged_output.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <stdio.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "base/error.h"
#include "base/interrupt.h"

namespace kestrel {

namespace fs = std::filesystem;

namespace {

struct Pending {
  const void* owner;
  fs::path tmp;
  std::string dest;
  fs::path parent, created;  // StagedDir: dest's parent, and the outermost parent it created
};

struct Registry {
  std::mutex mutex;
  std::vector<Pending> pending;
  std::string program;
};

// Never destroyed: the cleanup thread may use it while static destructors run.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

void unregister(const void* owner) {
  std::vector<Pending>& p = registry().pending;
  std::erase_if(p, [owner](const Pending& e) { return e.owner == owner; });
}

std::string pid_suffix() { return ".kestrel-tmp-" + std::to_string(::getpid()); }

// Removes the parents a StagedDir created, deepest first, as long as they are empty.
void remove_created_parents(const fs::path& parent, const fs::path& created) {
  if (created.empty()) return;
  std::error_code ec;
  for (fs::path p = parent;; p = p.parent_path()) {
    if (!fs::remove(p, ec) || p == created || p == p.root_path()) break;
  }
}

// The absolute path to write: a trailing separator dropped, a symbolic link followed (the
// output replaces what it points to, not the link).
fs::path resolve(const std::string& dest, const std::string& what) {
  if (dest.empty()) throw Error("no " + what + " given");
  fs::path p = fs::absolute(dest).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  std::error_code absent, ec;  // absent: an error that only says there is nothing there yet
  if (fs::is_symlink(fs::symlink_status(p, absent))) p = fs::weakly_canonical(p, ec);
  if (ec || p.filename().empty() || p == p.root_path())
    throw Error(dest + ": cannot write an output " + what + " there");
  return p;
}

std::string errno_text(int err) { return std::strerror(err); }

}  // namespace

// ---------------------------------------------------------------------------------------------

void StagedDir::check(const std::string& dest, bool replace) {
  const fs::path p = resolve(dest, "directory");
  std::error_code ec;
  const fs::file_status st = fs::status(p, ec);
  if (!fs::exists(st)) return;
  if (!fs::is_directory(st)) throw Error(dest + ": exists and is not a directory");
  const bool empty = fs::is_empty(p, ec);
  if (ec) throw Error(dest + ": cannot read the directory: " + ec.message());
  if (!empty && !replace) throw Error(dest + " is not empty; give --force to replace it");
}

StagedDir::StagedDir(const std::string& dest, bool replace) : shown_(dest), replace_(replace) {
  check(dest, replace);
  dest_ = resolve(dest, "directory");
  const fs::path parent = dest_.parent_path();
  fs::path missing;
  for (fs::path a = parent; !fs::exists(a) && a != a.root_path(); a = a.parent_path()) missing = a;
  std::error_code ec;
  fs::create_directories(parent, ec);
  if (!fs::is_directory(parent)) {
    remove_created_parents(parent, missing);
    throw Error(dest + ": cannot create the directory " + parent.string() + ": " +
                (ec ? ec.message() : "not a directory"));
  }
  created_ = missing;
  tmp_ = parent / (dest_.filename().string() + pid_suffix());
  {
    std::lock_guard<std::mutex> lock(registry().mutex);
    registry().pending.push_back({this, tmp_, shown_, parent, created_});
    fs::remove_all(tmp_, ec);  // left by an earlier process that had this id
    if (fs::create_directory(tmp_, ec) && !ec) return;
    unregister(this);
  }
  remove_created_parents(parent, created_);
  throw Error(dest + ": cannot create " + tmp_.string() + ": " + ec.message());
}

StagedDir::~StagedDir() {
  if (committed_) return;
  std::error_code ec;
  {
    std::lock_guard<std::mutex> lock(registry().mutex);
    fs::remove_all(tmp_, ec);
    unregister(this);
  }
  remove_created_parents(tmp_.parent_path(), created_);
}

void StagedDir::commit() {
  if (committed_) return;
  std::lock_guard<std::mutex> lock(registry().mutex);
  // An absent or empty dest is replaced by a plain rename; an old output is exchanged with the
  // new one atomically, then removed from where the new one was.
  if (::rename(tmp_.c_str(), dest_.c_str()) != 0) {
    const int err = errno;
    if (err != ENOTEMPTY && err != EEXIST)
      throw Error(shown_ + ": cannot move the new output into place: " + errno_text(err));
    if (!replace_)
      throw Error(shown_ + " was filled by something else meanwhile; give --force to replace it");
    if (::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, dest_.c_str(), RENAME_EXCHANGE) != 0) {
      const int xerr = errno;
      if (xerr != EINVAL && xerr != ENOSYS && xerr != EOPNOTSUPP)
        throw Error(shown_ + ": cannot replace it with the new output: " + errno_text(xerr));
      // A filesystem without the exchange: the old output steps aside for the new one, and
      // comes back if the new one cannot take its place.
      const fs::path old = dest_.parent_path() / (dest_.filename().string() + ".kestrel-old-" +
                                                   std::to_string(::getpid()));
      if (::rename(dest_.c_str(), old.c_str()) != 0)
        throw Error(shown_ + ": cannot move the old output aside: " + errno_text(errno));
      if (::rename(tmp_.c_str(), dest_.c_str()) != 0) {
        const int rerr = errno;
        ::rename(old.c_str(), dest_.c_str());
        throw Error(shown_ + ": cannot move the new output into place: " + errno_text(rerr));
      }
      ::rename(old.c_str(), tmp_.c_str());  // removed with the temporary below
    }
    std::error_code ec;
    fs::remove_all(tmp_, ec);  // the old output
  }
  unregister(this);
  committed_ = true;
}

// ---------------------------------------------------------------------------------------------

StagedFile::StagedFile(const std::string& dest) : shown_(dest) {
  dest_ = resolve(dest, "file");
  std::error_code ec;
  if (fs::is_directory(dest_, ec)) throw Error(dest + ": is a directory");
  tmp_ = dest_.parent_path() / (dest_.filename().string() + pid_suffix());
  std::lock_guard<std::mutex> lock(registry().mutex);
  registry().pending.push_back({this, tmp_, shown_, {}, {}});
  // Created here, exclusively and not through a symlink (a link planted at the predictable
  // name cannot redirect the write), with the mode of the file it replaces (a private file
  // stays private; a new one gets the umask's default).
  struct stat old {};
  const bool replacing = ::stat(dest_.c_str(), &old) == 0;
  const int fd = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
  if (fd >= 0 && replacing) ::fchmod(fd, old.st_mode & 07777);
  const int err = errno;
  if (fd >= 0) ::close(fd);
  if (fd >= 0) file_.open(tmp_, std::ios::binary | std::ios::trunc);
  if (fd < 0 || !file_) {
    if (fd >= 0) fs::remove(tmp_, ec);
    unregister(this);
    throw Error(dest + ": cannot write: " + errno_text(fd < 0 ? err : errno));
  }
}

StagedFile::~StagedFile() {
  if (committed_) return;
  file_.close();
  std::error_code ec;
  std::lock_guard<std::mutex> lock(registry().mutex);
  fs::remove(tmp_, ec);
  unregister(this);
}

void StagedFile::write(std::string_view text) {
  file_.write(text.data(), (std::streamsize)text.size());
  file_.flush();
  if (!file_) throw Error(shown_ + ": write failed: " + errno_text(errno));
}

void StagedFile::commit() {
  if (committed_) return;
  errno = 0;
  file_.close();
  if (file_.fail()) throw Error(shown_ + ": write failed: " + errno_text(errno));
  std::lock_guard<std::mutex> lock(registry().mutex);
  if (::rename(tmp_.c_str(), dest_.c_str()) != 0)
    throw Error(shown_ + ": cannot move the new file into place: " + errno_text(errno));
  unregister(this);
  committed_ = true;
}

// ---------------------------------------------------------------------------------------------

namespace {

// Removes a temporary that another thread may still be writing into: again until it stays gone.
void remove_fully(const fs::path& p) {
  std::error_code ec;
  for (int quiet = 0, i = 0; quiet < 3 && i < 200; ++i) {
    fs::remove_all(p, ec);
    quiet = fs::exists(p, ec) ? 0 : quiet + 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// Runs on base/interrupt's exit thread after a stop signal; the process exits after it.
void cleanup_after_signal() {
  Registry& r = registry();
  r.mutex.lock();  // kept until _exit
  std::string dests;
  for (const Pending& p : r.pending) {
    remove_fully(p.tmp);
    remove_created_parents(p.parent, p.created);
    dests += (dests.empty() ? "" : ", ") + p.dest;
  }
  const std::string clear = isatty(STDERR_FILENO) ? "\r\033[K" : "";  // a progress bar's line
  const std::string what = dests.empty() ? "" : "; nothing written to " + dests;
  const std::string line = clear + r.program + ": interrupted" + what + "\n";
  [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
}

}  // namespace

void remove_staged_outputs_on_signals(const std::string& program) {
  static std::once_flag once;
  std::call_once(once, [&program] {
    {
      std::lock_guard<std::mutex> lock(registry().mutex);
      registry().program = program;
    }
    on_stop_signal_exit([](int) { cleanup_after_signal(); });
  });
}

}  // namespace kestrel
