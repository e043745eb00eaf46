#include "models/gpu/profiler.h"

#include <algorithm>

#include "kernels/common/cuda_utils.h"
#include "models/gpu/graphs.h"

namespace kestrel {

void StepProfiler::mark(const char* op, double bytes, cudaStream_t s) {
  if (!on_) return;
  cudaEvent_t e;
  KESTREL_CUDA_CHECK(cudaEventCreate(&e));
  events_.push_back(e);
  KESTREL_CUDA_CHECK(cudaEventRecordWithFlags(e, s, cudaEventRecordExternal));
  ops_.emplace_back(op, bytes);
}

std::vector<OpTime> StepProfiler::profile(cudaStream_t s, int pos,
                                          const std::function<void()>& record) {
  cudaEvent_t start = nullptr;
  cudaGraphExec_t exec = nullptr;
  auto done = [&] {  // whether it succeeded or threw
    on_ = false;
    if (exec) cudaGraphExecDestroy(exec);
    if (start) cudaEventDestroy(start);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    events_.clear();
  };
  std::vector<OpTime> out;
  try {
    KESTREL_CUDA_CHECK(cudaEventCreate(&start));
    ops_.clear();
    pos_ = pos;
    on_ = true;
    exec = capture_graph(s, [&] {
      KESTREL_CUDA_CHECK(cudaEventRecordWithFlags(start, s, cudaEventRecordExternal));
      record();
    });
    on_ = false;
    for (int i = 0; i < 2; ++i) KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, s));
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
    cudaEvent_t prev = start;
    for (size_t i = 0; i < ops_.size(); ++i) {
      float ms = 0;
      KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, prev, events_[i]));
      prev = events_[i];
      auto it = std::find_if(out.begin(), out.end(), [&](const OpTime& t) { return t.op == ops_[i].first; });
      if (it == out.end()) it = out.insert(out.end(), OpTime{ops_[i].first});
      it->launches += 1;
      it->us += ms * 1000.0;
      it->bytes += ops_[i].second;
    }
  } catch (...) {
    done();
    throw;
  }
  done();
  return out;
}

}  // namespace kestrel
