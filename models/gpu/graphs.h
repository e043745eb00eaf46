// CUDA graphs of the decode step: capture, and the set a sequence replays.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace kestrel {

// Captures what `record` enqueues on s (thread-local capture mode) and instantiates it. Where
// record throws, the capture is ended and discarded and the exception passes on.
cudaGraphExec_t capture_graph(cudaStream_t s, const std::function<void()>& record);

// A sequence's decode graphs: one per head for each range of positions, [0, 512),
// [512, 1024), [1024, 2048), ... up to its context (or one range for all).
//
// Attention's grid covers the positions its graph may be replayed at; blocks past the position
// exit at once but each is still launched, and the blocks per query head are best chosen by the
// context's length. So the step is captured once per range, each range twice the last: 3
// ranges at 2,048 positions, 4 at 4,096, 9 at 131,072. A range's end is a bound only: every
// graph reads its token and position from device memory.
class DecodeGraphs {
 public:
  DecodeGraphs() = default;
  DecodeGraphs(const DecodeGraphs&) = delete;
  DecodeGraphs& operator=(const DecodeGraphs&) = delete;
  ~DecodeGraphs() { clear(); }

  // record(head, bound) enqueues the step for `head` (0 .. heads - 1) at positions below
  // `bound`. Replaces what was captured before.
  void capture(int ctx, bool ranges, int heads, cudaStream_t s,
               const std::function<void(int head, int bound)>& record);
  cudaGraphExec_t get(int pos, int head) const { return graphs_[(size_t)range(pos) * heads_ + head]; }
  // The bound of pos's range (the end of the range, exclusive).
  int bound(int pos) const { return range_end_[range(pos)]; }
  // Destroys the graphs (none may be running).
  void clear();

 private:
  int range(int pos) const;
  int heads_ = 0;
  std::vector<int> range_end_;           // each range's end, the last the context
  std::vector<cudaGraphExec_t> graphs_;  // [range][head]
};

// A sequence's graphs of the speculative verify pass: one per row count n, each captured the
// first time its n runs and replayed at any position (the kernels read the position from device
// memory). A graph binds the sequence's KV cache and the model's prefill scratch of one
// generation: the scratch may be made again (a new chunk length, an out-of-memory retry), and
// graphs of an older generation are destroyed, never replayed, once a newer one is asked for.
class VerifyGraphs {
 public:
  VerifyGraphs() = default;
  VerifyGraphs(const VerifyGraphs&) = delete;
  VerifyGraphs& operator=(const VerifyGraphs&) = delete;
  ~VerifyGraphs() { clear(); }

  // The graph for n rows over the scratch of `generation`; nullptr where there is none (those
  // of another generation are destroyed first: none of them may be running).
  cudaGraphExec_t get(int n, uint64_t generation);
  // Keeps g (captured over the scratch of `generation`) as the graph for n rows.
  void put(int n, uint64_t generation, cudaGraphExec_t g);
  int size() const;  // graphs held
  void clear();      // destroys them (none may be running)

 private:
  // Holds only graphs of `generation` from here on: those of another are destroyed.
  void bind(uint64_t generation);
  uint64_t generation_ = 0;
  std::vector<cudaGraphExec_t> graphs_;  // [n], nullptr where not captured
};

}  // namespace kestrel
