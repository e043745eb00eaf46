// What the tests of kestrel serve share: the real server started in the background (its stderr
// in a file the test reads as it runs) and one HTTP exchange over a plain socket.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/test_util.h"

extern char** environ;

namespace kestrel::test {

inline const std::string kKestrelServeBin = KESTREL_BIN;

// A server started in the background, its stderr in a file the test reads as it runs.
class Server {
 public:
  explicit Server(const std::vector<std::string>& args, const std::string& name = "serve") {
    log_ = scratch() / (name + ".log");
    std::vector<std::string> argv = {kKestrelServeBin, "serve"};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargs;
    for (std::string& a : argv) cargs.push_back(a.data());
    cargs.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (posix_spawn(&pid_, cargs[0], &fa, nullptr, cargs.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  ~Server() { stop(); }

  std::string log() const { return read_file(log_); }
  pid_t pid() const { return pid_; }

  // The port of its "listening on" line, once printed (-1 when it exited first or took over
  // 60 s); `line` gets the whole line.
  int wait_listening(std::string* line = nullptr) {
    static const std::regex re(R"(listening on http://[^\s]+:(\d+)[^\n]*)");
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < end) {
      std::smatch m;
      const std::string text = log();
      if (std::regex_search(text, m, re)) {
        if (line) *line = m[0];
        return std::stoi(m[1]);
      }
      if (exited()) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }

  // Stops it (SIGTERM) and returns its exit status (-1: killed by a signal).
  int stop() {
    if (pid_ <= 0) return status_;
    if (!exited()) kill(pid_, SIGTERM);
    int st = 0;
    waitpid(pid_, &st, 0);
    pid_ = -1;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return status_;
  }

 private:
  bool exited() const {
    siginfo_t info{};
    return waitid(P_PID, (id_t)pid_, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid_;
  }
  std::filesystem::path log_;
  pid_t pid_ = -1;
  int status_ = -1;
};

// One HTTP/1.1 exchange over a fresh connection ("Connection: close"); the raw answer. A
// non-empty body is sent with its Content-Length.
inline std::string http(int port, const std::string& request_line, const std::vector<std::string>& headers = {},
                 const std::string& body = "") {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return "";
  }
  std::string req = request_line + "\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  for (const std::string& h : headers) req += h + "\r\n";
  if (!body.empty()) req += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  req += "\r\n" + body;
  for (size_t off = 0; off < req.size();) {
    const ssize_t n = write(fd, req.data() + off, req.size() - off);
    if (n <= 0) break;
    off += (size_t)n;
  }
  // Read to the end of the body by its Content-Length: an answer given before the request
  // was read through (414) leaves the connection open.
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) {
    out.append(buf, (size_t)n);
    const size_t head = out.find("\r\n\r\n");
    if (head == std::string::npos) continue;
    std::smatch m;
    const std::string h = out.substr(0, head);
    static const std::regex re(R"(\r\nContent-Length: (\d+))", std::regex::icase);
    if (std::regex_search(h, m, re) && out.size() >= head + 4 + std::stoul(m[1])) break;
  }
  close(fd);
  return out;
}

// A process's resident memory (VmRSS) in bytes; 0 when it cannot be read.
inline int64_t rss_bytes(pid_t pid) {
  const std::string status = read_file("/proc/" + std::to_string(pid) + "/status");
  std::smatch m;
  static const std::regex re(R"(VmRSS:\s+(\d+) kB)");
  return std::regex_search(status, m, re) ? std::stoll(m[1]) * 1024 : 0;
}

inline int status_of(const std::string& response) {
  return response.size() > 12 ? std::atoi(response.c_str() + 9) : 0;
}
inline std::string body_of(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  return at == std::string::npos ? "" : response.substr(at + 4);
}
inline bool has_header(const std::string& response, const std::string& header) {
  const std::string head = response.substr(0, response.find("\r\n\r\n") + 2);
  return head.find("\r\n" + header + "\r\n") != std::string::npos;
}

}  // namespace kestrel::test
