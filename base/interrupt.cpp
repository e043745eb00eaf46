#include "base/interrupt.h"

#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <utility>

namespace kestrel {

namespace {

std::atomic<bool> g_catching{false};     // SIGINT sets g_interrupted
std::atomic<bool> g_interrupted{false};
std::atomic<bool> g_exit_armed{false};   // an exit hook waits on g_signalled
std::atomic<int> g_signal{0};            // the first stop signal, for the exit status
sem_t g_signalled;

// Only async-signal-safe work: a flag, or a semaphore that wakes the exit thread.
extern "C" void on_signal(int sig) {
  if (sig == SIGINT && g_catching.load()) {
    g_interrupted.store(true);
    return;
  }
  if (!g_exit_armed.load()) {  // not asked for: what the signal would have done
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  int none = 0;
  g_signal.compare_exchange_strong(none, sig);
  sem_post(&g_signalled);
}

// `restart`: a system call the signal interrupts resumes (SA_RESTART); without it, it fails
// with EINTR, which is how a caught Ctrl-C reaches a blocking read.
void install(int sig, bool restart) {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = restart ? SA_RESTART : 0;
  sigaction(sig, &sa, nullptr);
}

sigset_t stop_set() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

}  // namespace

void catch_interrupts() {
  g_catching.store(true);
  install(SIGINT, /*restart=*/false);
}

bool interrupted() { return g_interrupted.load(); }

bool take_interrupt() { return g_interrupted.exchange(false); }

void on_stop_signal_exit(std::function<void(int)> hook) {
  static std::once_flag once;
  std::call_once(once, [&hook] {
    sem_init(&g_signalled, 0, 0);
    std::thread([hook = std::move(hook)] {
      while (sem_wait(&g_signalled) != 0) {
      }
      const int sig = g_signal.load();
      hook(sig);
      ::_exit(128 + sig);
    }).detach();
    g_exit_armed.store(true);
    for (int sig : {SIGTERM, SIGHUP}) install(sig, /*restart=*/true);
    if (!g_catching.load()) install(SIGINT, /*restart=*/true);
  });
}

void block_stop_signals() {
  const sigset_t set = stop_set();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int wait_for_stop_signal() {
  const sigset_t set = stop_set();
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

}  // namespace kestrel
