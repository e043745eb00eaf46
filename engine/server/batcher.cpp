#include "engine/server/batcher.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "base/error.h"
#include "engine/server/scheduler.h"

namespace kestrel::server {

// A session whose passes the batcher runs (see batcher.h). Greedy and sampled decoding go
// through forward() step by step: the defaults of forward_argmax and greedy_run call it, and no
// device-chained run is offered, since a chained run keeps its next token in the model's shared
// state between steps, where another row's step would overwrite it.
class StepBatcher::BatchedSession final : public SessionWrapper {
 public:
  BatchedSession(std::unique_ptr<Session> inner, StepBatcher& b)
      : SessionWrapper(std::move(inner)), b_(b) {}

  void forward(const int* tokens, int n, int pos, float* logits, float* all_logits) override {
    KESTREL_CHECK(n > 0, "forward: no tokens");
    // A decode step, or a pass that wants every row's logits (a verify pass): one pass.
    if (n == 1 || all_logits) {
      Pass p{inner_.get(), tokens, n, pos, logits, all_logits, {}, false, nullptr};
      b_.run(p);
      return;
    }
    // A prompt: chunks of batch_tokens from its start, each writing the logits of its last
    // token (the last chunk's are the prompt's). A chunk of one token is a decode row.
    const int chunk = b_.opt_.batch_tokens;
    for (int at = 0; at < n; at += chunk) {
      Pass p{inner_.get(), tokens + at, std::min(chunk, n - at), pos + at, logits, nullptr, {},
             false, nullptr};
      b_.run(p);
    }
  }

 private:
  StepBatcher& b_;
};

namespace {

// Checked before the step thread starts: a constructor that throws after would leave it running.
BatcherOptions checked(BatcherOptions o) {
  KESTREL_CHECK(o.batch_tokens >= 1,
                "--batch-tokens must be at least 1, got " + std::to_string(o.batch_tokens));
  return o;
}

}  // namespace

StepBatcher::StepBatcher(Model& model, BatcherOptions opt)
    : model_(model), opt_(checked(std::move(opt))), thread_([this] { loop(); }) {}

StepBatcher::~StepBatcher() {
  {
    std::lock_guard<std::mutex> l(m_);
    stop_ = true;
  }
  work_.notify_all();
  thread_.join();
}

std::unique_ptr<Session> StepBatcher::wrap(std::unique_ptr<Session> inner) {
  KESTREL_CHECK(&inner->model() == &model_, "a session of another model cannot join this batcher");
  return std::make_unique<BatchedSession>(std::move(inner), *this);
}

StepBatcher::Generation::Generation(StepBatcher& b) : b_(b) {
  std::lock_guard<std::mutex> l(b_.m_);
  ++b_.active_;
}

StepBatcher::Generation::~Generation() {
  {
    std::lock_guard<std::mutex> l(b_.m_);
    --b_.active_;
  }
  b_.work_.notify_all();  // a step may have waited for this generation's row
}

StepBatcher::Stats StepBatcher::stats() const {
  std::lock_guard<std::mutex> l(m_);
  return stats_;
}

void StepBatcher::run(Pass& p) {
  std::unique_lock<std::mutex> l(m_);
  if (stop_) throw Error("the model's step thread has stopped");
  p.arrived = std::chrono::steady_clock::now();
  waiting_.push_back(&p);
  work_.notify_all();
  done_.wait(l, [&] { return p.done; });
  if (p.error) std::rethrow_exception(p.error);
}

void StepBatcher::loop() {
  if (opt_.on_start) opt_.on_start();
  std::unique_lock<std::mutex> l(m_);
  std::vector<Pass*> rows;
  for (;;) {
    work_.wait(l, [&] { return stop_ || !waiting_.empty(); });
    if (stop_) break;
    // Gather: every generation in progress has a pass waiting, or the first has waited enough.
    work_.wait_until(l, waiting_.front()->arrived + opt_.gather,
                     [&] { return stop_ || (int)waiting_.size() >= active_; });
    if (stop_) break;
    // Every waiting decode row, and the oldest waiting chunk.
    rows.clear();
    Pass* chunk = nullptr;
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      Pass* p = *it;
      const bool row = p->n == 1 && !p->all_logits;
      if (row || !chunk) {
        (row ? rows.push_back(p) : (void)(chunk = p));
        it = waiting_.erase(it);
      } else {
        ++it;
      }
    }
    l.unlock();
    step(rows, chunk);
    l.lock();
    ++stats_.steps;
    stats_.decode_rows += rows.size();
    stats_.chunks += chunk != nullptr;
    stats_.widest = std::max(stats_.widest, (int)rows.size());
    for (Pass* p : rows) p->done = true;
    if (chunk) chunk->done = true;
    done_.notify_all();
  }
  // Stopping: whoever still waits gets an error rather than a hang.
  for (Pass* p : waiting_) {
    p->error = std::make_exception_ptr(Error("the server is stopping"));
    p->done = true;
  }
  waiting_.clear();
  done_.notify_all();
}

void StepBatcher::step(std::vector<Pass*>& rows, Pass* chunk) {
  // The decode rows first: the running streams get their tokens before a prompt's chunk runs.
  if (!rows.empty()) {
    const size_t vocab = model_.config().vocab;
    try {  // the buffers too: running out of memory for them falls back to the rows alone
      std::vector<BatchRow> batch;
      batch.reserve(rows.size());
      for (Pass* p : rows) batch.push_back({p->inner, p->tokens[0], p->pos});
      logits_.resize(rows.size() * vocab);
      model_.forward_batch(batch, logits_.data());
      for (size_t i = 0; i < rows.size(); ++i)
        std::copy_n(logits_.data() + i * vocab, vocab, rows[i]->logits);
    } catch (...) {
      // One bad row (a position past its context) fails the batch, as does a device short of
      // memory for the batch's scratch: run each alone, so that only a bad row fails. A row's
      // K/V written before the failure is written again.
      for (Pass* p : rows) {
        try {
          p->inner->forward(p->tokens, 1, p->pos, p->logits, nullptr);
        } catch (...) {
          p->error = std::current_exception();
        }
      }
    }
  }
  if (chunk) {
    try {
      chunk->inner->forward(chunk->tokens, chunk->n, chunk->pos, chunk->logits, chunk->all_logits);
    } catch (...) {
      chunk->error = std::current_exception();
    }
  }
}

}  // namespace kestrel::server
