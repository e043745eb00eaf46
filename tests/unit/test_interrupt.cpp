// base/interrupt: what each stop signal does once a program has said what it wants. Each case
// runs in a child process of its own, since signal dispositions are the process's.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <thread>

#include "base/interrupt.h"

using namespace kestrel;

namespace {

// Runs f in a child process; its wait status.
int in_child(const std::function<int()>& f) {
  const pid_t pid = fork();
  if (pid == 0) _exit(f());
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

}  // namespace

TEST(Interrupt, CaughtCtrlCSetsTheFlagAndTheProcessGoesOn) {
  const int st = in_child([] {
    catch_interrupts();
    if (interrupted()) return 1;
    raise(SIGINT);
    if (!interrupted()) return 2;
    if (!take_interrupt() || interrupted()) return 3;  // read and cleared
    return 0;
  });
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0);
}

TEST(Interrupt, StopSignalRunsTheExitHookThenExits128PlusSignal) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const int st = in_child([&]() -> int {
    on_stop_signal_exit([&](int sig) {
      const char c = (char)sig;
      [[maybe_unused]] ssize_t n = write(fds[1], &c, 1);
    });
    raise(SIGTERM);
    for (;;) pause();  // the hook's thread ends the process
  });
  close(fds[1]);
  char c = 0;
  ASSERT_EQ(read(fds[0], &c, 1), 1);
  close(fds[0]);
  EXPECT_EQ(c, SIGTERM);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 128 + SIGTERM);
}

TEST(Interrupt, CaughtCtrlCStaysAFlagBesideAnExitHook) {
  const int st = in_child([] {
    on_stop_signal_exit([](int) {});
    catch_interrupts();
    raise(SIGINT);
    return interrupted() ? 0 : 1;
  });
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0);
}

TEST(Interrupt, UncaughtCtrlCEndsTheProcess) {
  const int st = in_child([] {
    raise(SIGINT);
    return 0;
  });
  ASSERT_TRUE(WIFSIGNALED(st));
  EXPECT_EQ(WTERMSIG(st), SIGINT);
}

TEST(Interrupt, ABlockedStopSignalIsWaitedFor) {
  const int st = in_child([] {
    block_stop_signals();
    std::thread([] { kill(getpid(), SIGINT); }).detach();  // inherits the mask: not delivered
    return wait_for_stop_signal() == SIGINT ? 0 : 1;
  });
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0);
}
