// Per-op timing of one decode step (kestrel bench --profile).
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "models/model.h"

namespace kestrel {

// The step records its ops as usual and calls mark() after each; while a profile is taken, a
// mark records an event (otherwise nothing, so the decode graphs carry none).
class StepProfiler {
 public:
  bool on() const { return on_; }
  int pos() const { return pos_; }  // the profiled step's position (attention's bytes grow with it)
  void mark(const char* op, double bytes, cudaStream_t s);
  // `record` enqueues the step at `pos` on s. It is captured as one graph with an event after
  // every op, so that it runs as in decoding (no host launch gaps), and replayed twice: the
  // second replay is timed. Ops of the same name are summed.
  std::vector<OpTime> profile(cudaStream_t s, int pos, const std::function<void()>& record);

 private:
  bool on_ = false;
  int pos_ = 0;
  std::vector<std::pair<std::string, double>> ops_;  // name, bytes
  std::vector<cudaEvent_t> events_;
};

}  // namespace kestrel
