#include "engine/server/scheduler.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "base/error.h"

namespace kestrel::server {

void TurnLock::lock() {
  std::unique_lock<std::mutex> lk(m_);
  const uint64_t ticket = next_++;
  cv_.wait(lk, [&] { return serving_ == ticket; });
}

void TurnLock::unlock() {
  {
    std::lock_guard<std::mutex> lk(m_);
    ++serving_;
  }
  cv_.notify_all();
}

TurnTakingSession::TurnTakingSession(std::unique_ptr<Session> inner, TurnLock& turn)
    : SessionWrapper(std::move(inner)), turn_(turn) {}

void TurnTakingSession::forward(const int* tokens, int n, int pos, float* logits, float* all_logits) {
  std::lock_guard<TurnLock> turn(turn_);
  inner_->forward(tokens, n, pos, logits, all_logits);
}

int TurnTakingSession::forward_argmax(int token, int pos) {
  std::lock_guard<TurnLock> turn(turn_);
  return inner_->forward_argmax(token, pos);
}

void TurnTakingSession::forward_argmax_rows(const int* tokens, int n, int pos, int* out) {
  std::lock_guard<TurnLock> turn(turn_);
  inner_->forward_argmax_rows(tokens, n, pos, out);
}

Slots::Slots(int n_slots, int max_queue, std::function<const std::vector<int>&(int)> cached,
             int64_t kv_blocks)
    : busy_(n_slots, false), released_at_(n_slots, 0), max_queue_(max_queue), cached_(std::move(cached)),
      kv_blocks_(kv_blocks) {}

int Slots::best_free_slot(const std::vector<int>& ids, int64_t kv_blocks) const {
  if (kv_blocks_ > 0 && kv_reserved_ + kv_blocks > kv_blocks_) return -1;
  int best = -1;
  size_t best_shared = 0;
  for (int s = 0; s < (int)busy_.size(); ++s) {
    if (busy_[s]) continue;
    const std::vector<int>& c = cached_(s);
    size_t shared = 0;
    while (shared < c.size() && shared < ids.size() && c[shared] == ids[shared]) ++shared;
    if (best < 0 || shared > best_shared ||
        (shared == best_shared && released_at_[s] < released_at_[best])) {
      best = s;
      best_shared = shared;
    }
  }
  return best;
}

std::unique_ptr<Slots::Lease> Slots::acquire(const std::vector<int>& ids,
                                             const std::function<bool()>& cancelled,
                                             Outcome& outcome, int64_t kv_blocks) {
  KESTREL_CHECK(kv_blocks_ == 0 || kv_blocks <= kv_blocks_,
                "a request needs " + std::to_string(kv_blocks) + " KV blocks of a pool of " +
                    std::to_string(kv_blocks_));
  std::unique_lock<std::mutex> lk(m_);
  if (shutting_down_) {
    outcome = Outcome::ShuttingDown;
    return nullptr;
  }
  auto take = [&](int s) {
    busy_[s] = true;
    kv_reserved_ += kv_blocks;
    outcome = Outcome::Granted;
    return std::make_unique<Lease>(*this, s, kv_blocks);
  };
  if (line_.empty()) {
    const int s = best_free_slot(ids, kv_blocks);
    if (s >= 0) return take(s);
  }
  if ((int)line_.size() >= max_queue_) {
    outcome = Outcome::QueueFull;
    return nullptr;
  }
  const uint64_t ticket = next_ticket_++;
  line_.push_back(ticket);
  auto leave = [&](Outcome why) {
    line_.erase(std::find(line_.begin(), line_.end(), ticket));
    cv_.notify_all();  // the next in line may now be first
    outcome = why;
    return nullptr;
  };
  for (;;) {
    // Woken by a release; the timeout is how often a waiting client is checked for having gone.
    cv_.wait_for(lk, std::chrono::milliseconds(50));
    if (shutting_down_) return leave(Outcome::ShuttingDown);
    if (line_.front() == ticket) {
      const int s = best_free_slot(ids, kv_blocks);
      if (s >= 0) {
        line_.pop_front();
        cv_.notify_all();
        return take(s);
      }
    }
    if (cancelled && cancelled()) return leave(Outcome::Cancelled);
  }
}

void Slots::release(int slot, int64_t kv_blocks) {
  {
    std::lock_guard<std::mutex> lk(m_);
    busy_[slot] = false;
    kv_reserved_ -= kv_blocks;
    released_at_[slot] = ++releases_;
  }
  cv_.notify_all();
}

void Slots::shut_down() {
  {
    std::lock_guard<std::mutex> lk(m_);
    shutting_down_ = true;
  }
  cv_.notify_all();
}

bool Slots::shutting_down() const {
  std::lock_guard<std::mutex> lk(m_);
  return shutting_down_;
}

Slots::Status Slots::status() const {
  std::lock_guard<std::mutex> lk(m_);
  Status s;
  for (bool b : busy_) (b ? s.busy : s.idle)++;
  s.queued = (int)line_.size();
  s.kv_blocks = kv_blocks_;
  s.kv_reserved = kv_reserved_;
  return s;
}

}  // namespace kestrel::server
