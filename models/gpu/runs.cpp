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
//
// Paged KV memory: a step's position is made the session's own (a block taken at a block's
// first position, a shared block copied) before the step is queued, so a step queued ahead
// never writes where another sequence reads; where the pool has no block for it, the step
// ahead is not queued and the next call to next() throws KvPoolFull. Step k's K/V is recorded
// (commit_write, with its input: the run's token, or step k - 1's) when step k's token is
// handed out, and that of the step queued ahead when the run ends.
class DecoderCuda::ChainedRun final : public DecodeRun {
 public:
  ChainedRun(DecoderCudaSession& q, int token, int pos, const TopKSampling* sampling)
      : q_(q), m_(q.m_), pos0_(pos), sampled_(sampling != nullptr), input_(token) {
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
  ~ChainedRun() override {
    cudaStreamSynchronize(m_.stream_);
    // The step queued ahead and never handed out wrote its K/V with the last token handed out.
    if (queued_ > handed_) {
      try {
        q_.commit_write(pos0_ + handed_, &input_, 1);
      } catch (...) {  // bookkeeping only: the blocks stay unpublished
      }
    }
  }

  int next(bool ahead) override {
    if (handed_ == queued_) queue(true);
    if (ahead && queued_ == handed_ + 1 && pos0_ + queued_ < q_.q_.ctx) queue(false);
    const int slot = handed_ % 2;
    KESTREL_CUDA_CHECK(cudaEventSynchronize(m_.chain_done_[slot]));
    const int token = m_.host_io_[3 + slot];
    q_.commit_write(pos0_ + handed_, &input_, 1);  // the step's K/V hold its input now
    input_ = token;                                 // the next step's input
    ++handed_;
    return token;
  }

 private:
  // Queues the next step, or (paged, the pool full) throws KvPoolFull where `must`, else
  // queues nothing.
  void queue(bool must = true) {
    const int pos = pos0_ + queued_;
    q_.check_position(pos);
    if (must)
      q_.prepare_write(pos, 1);
    else if (!q_.try_prepare_write(pos, 1))
      return;
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
  int input_;              // the token step handed_ runs (the first, or the last handed out)
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
