#include "models/gpu/graphs.h"

#include <algorithm>

#include "kernels/common/cuda_utils.h"

namespace kestrel {

cudaGraphExec_t capture_graph(cudaStream_t s, const std::function<void()>& record) {
  cudaGraph_t graph = nullptr;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  try {
    record();
  } catch (...) {
    cudaStreamEndCapture(s, &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  KESTREL_CUDA_CHECK(err);
  return exec;
}

void DecodeGraphs::capture(int ctx, bool ranges, int heads, cudaStream_t s,
                           const std::function<void(int head, int bound)>& record) {
  clear();
  heads_ = heads;
  for (int end = 512; end < ctx && ranges; end *= 2) range_end_.push_back(end);
  range_end_.push_back(ctx);
  graphs_.assign(range_end_.size() * heads, nullptr);
  for (size_t r = 0; r < range_end_.size(); ++r)
    for (int h = 0; h < heads; ++h)
      graphs_[r * heads + h] = capture_graph(s, [&] { record(h, range_end_[r]); });
}

int DecodeGraphs::range(int pos) const {
  return (int)(std::upper_bound(range_end_.begin(), range_end_.end(), pos) - range_end_.begin());
}

void DecodeGraphs::clear() {
  for (cudaGraphExec_t g : graphs_)
    if (g) cudaGraphExecDestroy(g);
  graphs_.clear();
  range_end_.clear();
}

void VerifyGraphs::bind(uint64_t generation) {
  if (generation == generation_) return;
  clear();
  generation_ = generation;
}

cudaGraphExec_t VerifyGraphs::get(int n, uint64_t generation) {
  bind(generation);
  return n >= 0 && n < (int)graphs_.size() ? graphs_[n] : nullptr;
}

void VerifyGraphs::put(int n, uint64_t generation, cudaGraphExec_t g) {
  bind(generation);
  if (n >= (int)graphs_.size()) graphs_.resize(n + 1, nullptr);
  if (graphs_[n]) cudaGraphExecDestroy(graphs_[n]);
  graphs_[n] = g;
}

int VerifyGraphs::size() const {
  return (int)std::count_if(graphs_.begin(), graphs_.end(), [](cudaGraphExec_t g) { return g; });
}

void VerifyGraphs::clear() {
  for (cudaGraphExec_t g : graphs_)
    if (g) cudaGraphExecDestroy(g);
  graphs_.clear();
}

}  // namespace kestrel
