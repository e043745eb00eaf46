// The one owner of the signals that ask a program to stop: SIGINT (Ctrl-C), SIGTERM and
// SIGHUP. Every handler of the process is installed here, so that what a signal does follows
// from what the program registered, never from which component called sigaction last:
//
//   SIGINT   caught (catch_interrupts): sets a flag that long work polls, the program goes on;
//            otherwise as SIGTERM
//   SIGTERM, SIGHUP   with an exit hook (on_stop_signal_exit): the hook runs on a thread of its
//            own, then the process exits with 128 + the signal; otherwise the default (the
//            process ends)
//
// A server that waits for its end instead (kestrel serve) blocks SIGINT and SIGTERM in all its
// threads and takes them with wait_for_stop_signal.
#pragma once

#include <functional>

namespace kestrel {

// From now on SIGINT sets the flag that interrupted() reads, instead of ending the process.
// Without SA_RESTART: a read waiting for input returns (EINTR), so that a prompt sees Ctrl-C.
void catch_interrupts();
bool interrupted();
// Reads and clears the flag.
bool take_interrupt();

// From now on SIGTERM, SIGHUP and an uncaught SIGINT run `hook(signal)` on a thread of its own
// (where it may take locks and remove files; the signal handler only wakes that thread), then
// exit the process with 128 + the signal. One hook per process: a second call is ignored.
void on_stop_signal_exit(std::function<void(int)> hook);

// For a program that waits for its end: blocks SIGINT and SIGTERM in the calling thread and in
// the threads it starts from now on (call it before starting any), so that neither is delivered
// to a thread; wait_for_stop_signal then takes the next one and returns its number.
void block_stop_signals();
int wait_for_stop_signal();

}  // namespace kestrel
