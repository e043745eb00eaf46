// Continuous batching for `kestrel serve --parallel N`: the requests' generations still run on
// their own worker threads (engine/generate.h, with every request's own sampling, penalties,
// stop strings, logprobs, grammar and cancellation untouched), but every pass they ask of the
// model goes to one StepBatcher, whose step thread runs it:
//
//   worker 1: forward(1 token) ---+
//   worker 2: forward(1 token) ---+--> step: Model::forward_batch over the waiting decode rows
//   worker 3: forward(prompt) ----+          + at most one prompt chunk (<= batch_tokens tokens)
//
// - Requests join and leave between steps: a step takes whatever rows are waiting when it starts.
// - A step waits for the rows of every generation in progress (Generation), or at most `gather`
//   from the first row waiting, so that a stream busy elsewhere (a slow client's write, a grammar
//   mask) delays the others by that much and no more.
// - Prompts run in chunks of at most batch_tokens tokens, one chunk per step, the oldest waiting
//   chunk first (a long prompt takes turns with the other prompts and never stalls the decode
//   rows for more than one chunk). A chunk's cut depends only on where the prompt starts and
//   batch_tokens, never on what else runs, so a request's arithmetic is the same alone or
//   beside others. A pass that wants every row's logits (a speculative verify pass, at most
//   kMaxDraftMax + 1 rows) runs whole, as one chunk.
// - Only the step thread runs the model, so sessions of one model never run at once
//   (models/model.h) without a lock per pass.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "models/model.h"

namespace kestrel::server {

struct BatcherOptions {
  int batch_tokens = 512;  // most prompt tokens one step runs
  // How long a step waits, from its first waiting row, for the rows of the other generations in
  // progress. Host work between two steps (sampling, detokenizing, a write) takes microseconds;
  // this bounds what a stream stalled elsewhere costs the rest per step.
  std::chrono::microseconds gather{2000};
  std::function<void()> on_start;  // run first on the step thread (CPU: the linears' team)
};

class StepBatcher {
 public:
  StepBatcher(Model& model, BatcherOptions opt);
  ~StepBatcher();  // fails what still waits (kestrel::Error) and joins the step thread
  StepBatcher(const StepBatcher&) = delete;
  StepBatcher& operator=(const StepBatcher&) = delete;

  // `inner` (a session of this batcher's model) behind a session whose passes run on the step
  // thread, batched; it must not outlive the batcher.
  std::unique_ptr<Session> wrap(std::unique_ptr<Session> inner);

  // A generation in progress, held while it runs: steps wait (up to gather) for its rows.
  class Generation {
   public:
    explicit Generation(StepBatcher& b);
    ~Generation();
    Generation(const Generation&) = delete;
    Generation& operator=(const Generation&) = delete;

   private:
    StepBatcher& b_;
  };

  struct Stats {
    uint64_t steps = 0;           // steps run
    uint64_t decode_rows = 0;     // one-token rows run, over all steps
    uint64_t chunks = 0;          // prompt chunks (and whole verify passes) run
    int widest = 0;               // most decode rows of one step
  };
  Stats stats() const;

 private:
  class BatchedSession;
  struct Pass {  // one pass a worker waits for
    Session* inner;
    const int* tokens;
    int n, pos;
    float* logits;
    float* all_logits;
    std::chrono::steady_clock::time_point arrived;
    bool done = false;
    std::exception_ptr error;
  };
  // Queues `p`, waits for its step, rethrows what the model threw for it.
  void run(Pass& p);
  void loop();
  void step(std::vector<Pass*>& rows, Pass* chunk);

  Model& model_;
  BatcherOptions opt_;
  mutable std::mutex m_;
  std::condition_variable work_, done_;
  std::deque<Pass*> waiting_;  // first come first
  int active_ = 0;             // Generations held
  bool stop_ = false;
  Stats stats_;
  std::vector<float> logits_;  // [rows, vocab] of a step's decode rows (step thread only)
  std::thread thread_;         // last: it starts with the members above constructed
};

}  // namespace kestrel::server
