// A program run as a child process that the test controls: signalled while it runs, or with a
// limit on the size of every file it writes (RLIMIT_FSIZE: a write past it fails with EFBIG,
// as on a full disk).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace kestrel::test {

class Child {
 public:
  // Starts argv[0] (a path) with stdout discarded and stderr kept; max_file_bytes >= 0 limits
  // the size of the files it writes. start_stopped: the child stops itself before exec, and
  // the constructor returns once it has stopped (SIGCONT lets it go on), so that a test can
  // prepare what depends on its pid.
  explicit Child(const std::vector<std::string>& argv, long max_file_bytes = -1,
                 bool start_stopped = false) {
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {  // only async-signal-safe calls until exec
      dup2(fds[1], STDERR_FILENO);
      close(fds[0]);
      close(fds[1]);
      const int null = open("/dev/null", O_WRONLY);
      dup2(null, STDOUT_FILENO);
      if (max_file_bytes >= 0) {
        signal(SIGXFSZ, SIG_IGN);  // the write fails instead of killing the process
        const rlimit rl{(rlim_t)max_file_bytes, (rlim_t)max_file_bytes};
        setrlimit(RLIMIT_FSIZE, &rl);
      }
      if (start_stopped) raise(SIGSTOP);
      execv(args[0], args.data());
      _exit(127);
    }
    close(fds[1]);
    err_fd_ = fds[0];
    if (start_stopped) {
      int status = 0;
      waitpid(pid_, &status, WUNTRACED);
    }
  }
  ~Child() {
    if (pid_ > 0 && !waited_) {
      kill(pid_, SIGKILL);
      wait();
    }
  }
  pid_t pid() const { return pid_; }

  // Polls `ready` every 5 ms until it holds (true) or the child has exited or `seconds` passed.
  bool wait_until(const std::function<bool()>& ready, double seconds = 60) const {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < end) {
      if (ready()) return true;
      siginfo_t info{};
      if (waitid(P_PID, (id_t)pid_, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid_)
        return false;  // exited (and left to wait())
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

  void signal_it(int sig) const { kill(pid_, sig); }

  // Waits for the exit; returns its status (-1 when killed by a signal) and fills err.
  int wait() {
    std::string text;
    char buf[4096];
    ssize_t n;
    while (err_fd_ >= 0 && (n = read(err_fd_, buf, sizeof buf)) > 0) text.append(buf, n);
    if (err_fd_ >= 0) close(err_fd_);
    err_fd_ = -1;
    int status = 0;
    waitpid(pid_, &status, 0);
    waited_ = true;
    err = text;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  std::string err;

 private:
  pid_t pid_ = -1;
  int err_fd_ = -1;
  bool waited_ = false;
};

// The temporary a staged output of process `pid` writes before it is renamed to `dest`.
inline std::filesystem::path staged_temp(const std::filesystem::path& dest, pid_t pid) {
  return dest.parent_path() / (dest.filename().string() + ".kestrel-tmp-" + std::to_string(pid));
}

// Every file under `dir` with its bytes, to compare a directory before and after.
inline std::vector<std::pair<std::string, std::string>> snapshot(const std::filesystem::path& dir) {
  std::vector<std::pair<std::string, std::string>> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::string bytes;
    if (FILE* f = std::fopen(e.path().c_str(), "rb")) {
      char buf[1 << 16];
      size_t n;
      while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) bytes.append(buf, n);
      std::fclose(f);
    }
    files.emplace_back(std::filesystem::relative(e.path(), dir).string(), std::move(bytes));
  }
  std::sort(files.begin(), files.end());
  return files;
}

// The names in `dir` holding ".kestrel-tmp-" or ".kestrel-old-": what a staged output leaves
// when it is not cleaned up.
inline std::vector<std::string> staging_leftovers(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.find(".kestrel-tmp-") != std::string::npos ||
        n.find(".kestrel-old-") != std::string::npos)
      names.push_back(n);
  }
  return names;
}

}  // namespace kestrel::test
