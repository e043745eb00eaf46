// Non-regular files where a reader expects a file: a FIFO, and a call that must refuse it at
// once. A reader that opens a FIFO blocks until some program writes to it, so should the call
// block, a watchdog opens the FIFO for writing after a few seconds and closes it (the reader
// then sees an empty file) and the test fails instead of hanging.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "base/error.h"

namespace kestrel::test {

inline void make_fifo(const std::string& path) {
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << path;
}

// Runs f, which must throw kestrel::Error without blocking on the FIFO at `fifo`; returns
// the message.
template <typename F>
std::string error_without_blocking(const std::string& fifo, F&& f) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false, blocked = false;
  std::thread watchdog([&] {
    std::unique_lock lock(m);
    if (cv.wait_for(lock, std::chrono::seconds(5), [&] { return done; })) return;
    blocked = true;
    // Unblock the reader: a non-blocking open for writing succeeds once a reader waits.
    while (!done) {
      lock.unlock();
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);
      lock.lock();
      cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return done; });
    }
  });
  std::string msg;
  try {
    f();
    ADD_FAILURE() << "expected a kestrel::Error";
  } catch (const Error& e) {
    msg = e.what();
  }
  {
    std::lock_guard lock(m);
    done = true;
  }
  cv.notify_all();
  watchdog.join();
  EXPECT_FALSE(blocked) << fifo << ": the reader blocked on the FIFO";
  return msg;
}

}  // namespace kestrel::test
