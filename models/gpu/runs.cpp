// Decoding as a run of steps chained on the device (DecodeRun): the greedy run's argmax, or the
// sampled run's draw, writes the next step's token and position itself, so that step i + 1 is
// queued before the host has read token i.
#include <cmath>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/sampling/sample_cuda.h"
#include "models/gpu/session.h"

namespace kestrel {

// Step k of the run goes through the chained graph of slot k % 2 and its event. At most two
// steps are queued (the one being handed out and the one after it), so a slot's graph is
// relaunched, and its host slot rewritten, only after the host has read it. A sampled run's
// parameters go to the device first; its draws then count up there, step by step.
class DecoderCuda::ChainedRun final : public DecodeRun {
 public:
  ChainedRun(DecoderCudaSession& q, int token, int pos, const TopKSampling* sampling)
      : q_(q), m_(q.m_), pos0_(pos), sampled_(sampling != nullptr) {
    DecoderCuda& m = m_;
    q.set_step_input(token, pos);
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(m.s_.token, m.host_io_, 2 * sizeof(int),
                                       cudaMemcpyHostToDevice, m.stream_));
    if (sampling) {
      sampling_ = *sampling;
      sampling_.draws = 0;
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(m.s_.sampling, &sampling_, sizeof(sampling_),
                                         cudaMemcpyHostToDevice, m.stream_));
    }
    queue();
  }
  ~ChainedRun() override { cudaStreamSynchronize(m_.stream_); }

  int next(bool ahead) override {
    if (handed_ == queued_) queue();
    if (ahead && queued_ == handed_ + 1 && pos0_ + queued_ < q_.q_.ctx) queue();
    const int slot = handed_ % 2;
    KESTREL_CUDA_CHECK(cudaEventSynchronize(m_.chain_done_[slot]));
    ++handed_;
    return m_.host_io_[3 + slot];
  }

 private:
  void queue() {
    const int pos = pos0_ + queued_;
    q_.check_position(pos);
    const int slot = queued_ % 2;
    const Head head = sampled_ ? (slot ? Head::Sample1 : Head::Sample0)
                               : (slot ? Head::Chain1 : Head::Chain0);
    KESTREL_CUDA_CHECK(cudaGraphLaunch(q_.graph(pos, head), m_.stream_));
    KESTREL_CUDA_CHECK(cudaEventRecord(m_.chain_done_[slot], m_.stream_));
    ++queued_;
  }

  DecoderCudaSession& q_;
  DecoderCuda& m_;
  const int pos0_;
  const bool sampled_;
  TopKSampling sampling_;  // the source of the copy to the device, alive until it is done
  int queued_ = 0, handed_ = 0;  // steps launched, tokens returned
};

std::unique_ptr<DecodeRun> DecoderCudaSession::greedy_run(int token, int pos) {
  return std::make_unique<DecoderCuda::ChainedRun>(*this, token, pos, nullptr);
}

std::unique_ptr<DecodeRun> DecoderCudaSession::sampled_run(int token, int pos, const TopKSampling& s) {
  const int vocab = config().vocab;
  const bool ok = vocab <= kDeviceSampleMax && s.top_k >= 1 &&
                  s.top_k <= kDeviceTopKMax && s.top_k <= vocab &&
                  s.temperature > 0.0f && std::isfinite(s.temperature) && s.top_p > 0.0f &&
                  s.min_p >= 0.0f && s.min_p <= 1.0f;
  if (!ok) return nullptr;  // the host samples what the device's sampler does not cover
  return std::make_unique<DecoderCuda::ChainedRun>(*this, token, pos, &s);
}

}  // namespace kestrel
