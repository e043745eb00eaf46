// What the generation loop, the benchmark and perplexity need from a model running on some
// device: a Model (loaded once) and Sessions over it (one sequence each), which run tokens at
// positions and hand back logits.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/error.h"
#include "models/io/config.h"
#include "kernels/attention/kv_quant.h"
#include "kernels/sampling/sample.h"
#include "models/kv_pool.h"

namespace kestrel {

// Time spent in one kind of op over a decode step (for `kestrel bench --profile`).
struct OpTime {
  std::string op;
  int launches = 0;
  double us = 0;      // summed over the launches
  double bytes = 0;   // bytes the op must move through device memory (0 = not counted)
};

// Decoding as a run of steps, each picking its token on the model's device (greedy, or drawn
// by the device's sampler): the first step takes the token and position the run was started
// with, each later step the token the step before picked, one position on. next()
// returns the token of the oldest step not yet handed out. With `ahead` the session may queue
// the step that token feeds before handing it over, so that a GPU works on token i + 1 while the
// host handles token i; that step writes its K/V at the next position, which the caller's next
// token would write anyway. Destroying the run waits for whatever it still has queued; while a
// run is alive its session is used through it only.
class DecodeRun {
 public:
  virtual ~DecodeRun() = default;
  virtual int next(bool ahead) = 0;
};

class Session;

// A write into paged KV memory found no block free: every block of the pool is held by a
// sequence. (The server reserves blocks when it admits a request, so that its requests never
// meet this.)
class KvPoolFull : public Error {
 public:
  using Error::Error;
};

// One row of a batched decode step (Model::forward_batch): a session, the token it runs next
// and the position that token takes in the session's cache.
struct BatchRow {
  Session* session = nullptr;
  int token = 0;
  int pos = 0;
};

// A loaded model: its configuration, its weights on a device, and what every sequence shares
// there (decode graphs' recipe, scratch activations, the prefill's workspace). It holds no
// sequence: each sequence is a Session, made by new_session, which owns its KV cache. Sessions
// of one model take turns: a model runs one step at a time, so two sessions are never used
// from two threads at once. A session must not outlive its model.
class Model {
 public:
  virtual ~Model() = default;

  virtual const ModelConfig& config() const = 0;
  // The types of its sessions' K and V caches (--cache-type-k/-v; kernels/attention/kv_quant.h).
  virtual KvCacheTypes cache_types() const { return {}; }
  // A human-readable device description for messages and tables ("CPU (reference, fp32)").
  virtual std::string device_name() const = 0;
  // Whether a forward pass computes on the calling process's cores (the CPU engine), or waits
  // on a device while they idle: host work overlapped with a device's pass is free, with the
  // CPU engine's it takes cores from the pass.
  virtual bool computes_on_host() const { return false; }
  // A new sequence at position 0 with a KV cache of `context` positions (0 = the model's
  // max_position_embeddings), allocated now. A GPU model shortens the context to what fits,
  // with a note on stderr unless `quiet`; throws DeviceError where not even a short one does.
  virtual std::unique_ptr<Session> new_session(int context = 0, bool quiet = true) = 0;

  // A batched decode step: every row's session runs the row's token at the row's position
  // (writing its K/V there, as session->forward(&token, 1, pos, ...) would), and
  // logits [rows.size(), vocab] receive each row's logits, in the order of the rows. Every
  // session must be one of this model's (not a wrapper around one) and appear once; the
  // positions are each session's own. A kestrel::Error names the first bad row.
  //
  // The default runs the rows one after the other, so every engine is correct. An engine that
  // batches for real reads each weight once for all rows (the CPU engine: its linears over the
  // B rows, attention per row over its own cache), and must give each row exactly what a
  // one-token forward gives it (on the CPU engine, bit for bit).
  virtual void forward_batch(std::span<const BatchRow> rows, float* logits);

  // Paged KV memory with shared prefixes (docs/server.md): every session made after this call
  // keeps its K/V in one pool of `positions` positions (rounded up to whole blocks of kKvBlock),
  // taking blocks as its positions are written, and a new prompt reuses the blocks of any
  // earlier sequence that began the same way (Session::adopt_prefix). A session's
  // context_length() is then the most one sequence may hold. A GPU takes fewer positions where
  // fewer fit beside the scratch of `sessions` sessions of `context` positions each (with a note
  // on stderr unless `quiet`), and throws DeviceError where not even `context` do. false where
  // the engine keeps a cache per session only.
  virtual bool use_kv_pool(int64_t /*positions*/, int /*sessions*/ = 1, int /*context*/ = 0,
                           bool /*quiet*/ = true) {
    return false;
  }
  virtual KvPoolUse kv_pool_use() const { return {}; }

  // Bytes of the weights on the model's device.
  virtual size_t weight_bytes() const { return 0; }
  // Device memory the model has taken (free memory before loading minus free memory now):
  // right after loading (weights and scratch), and now (with every session's KV cache). 0
  // where not measured.
  virtual size_t device_bytes_after_load() const { return 0; }
  virtual size_t device_bytes_in_use() const { return 0; }
};

// One sequence over a loaded model: its KV cache, indexed by position (a new conversation
// simply starts again at position 0), and the ids whose K/V the cache holds (prefix reuse).
class Session {
 public:
  explicit Session(Model& model) : model_(model) {}
  virtual ~Session() = default;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  Model& model() const { return model_; }
  const ModelConfig& config() const { return model_.config(); }
  std::string device_name() const { return model_.device_name(); }
  // Positions the KV cache holds; pos + n must stay within it.
  virtual int context_length() const = 0;
  // Bytes of this session's KV cache on the model's device.
  virtual size_t cache_bytes() const { return 0; }

  // Runs tokens[0..n) at positions pos .. pos+n-1, writing their K/V into the cache, and
  // writes the logits of the last token to `logits` [vocab] (fp32, host). When `all_logits`
  // is non-null it receives the logits of every token [n, vocab].
  virtual void forward(const int* tokens, int n, int pos, float* logits,
                       float* all_logits = nullptr) = 0;

  // Greedy fast path: runs one token at `pos` and returns the argmax of its logits. A GPU
  // model picks the token on the device so that only its id crosses to the host.
  virtual int forward_argmax(int token, int pos) {
    std::vector<float> logits(config().vocab);
    forward(&token, 1, pos, logits.data());
    int best = 0;
    for (int i = 1; i < (int)logits.size(); ++i)
      if (logits[i] > logits[best]) best = i;
    return best;
  }

  // Greedy verification of a speculative draft: runs tokens[0..n) at positions pos ..
  // pos+n-1 (as forward, writing their K/V) and writes to out[i] the argmax of token i's
  // logits (the first index on ties), so that out[i] is the greedy successor of tokens[0..i].
  // The default takes every row's logits to the host through forward(all_logits); a GPU model
  // takes the argmax of each row on the device and hands back n ids.
  virtual void forward_argmax_rows(const int* tokens, int n, int pos, int* out);

  // Greedy decoding from `token` at `pos` (DecodeRun). The default runs forward_argmax step by
  // step; a GPU model chains the steps on the device.
  virtual std::unique_ptr<DecodeRun> greedy_run(int token, int pos);
  // Sampled decoding from `token` at `pos`, each token drawn on the device by top-k sampling
  // (kernels/sampling/sample.h: top-k, then top-p, min-p and the temperature, as the host
  // Sampler's top-k path; no penalties) with the device's random numbers seeded by `s.seed`.
  // nullptr where the model cannot (the default): the caller samples on the host.
  virtual std::unique_ptr<DecodeRun> sampled_run(int /*token*/, int /*pos*/,
                                                 const TopKSampling& /*s*/) {
    return nullptr;
  }

  // Runs tokens[0..n) at positions pos.. (as forward) and writes
  // nll[i] = -log p(targets[i] | tokens[0..i]) for targets[i] >= 0, and 0 otherwise. The
  // default takes every token's logits to the host and the log-softmax in double; a GPU
  // model keeps the logits on the device and hands back one float per token.
  virtual void forward_nll(const int* tokens, int n, int pos, const int* targets, double* nll);

  // Runs one decode step op by op with a timer around each, at `pos`. Empty where the
  // model cannot (the CPU reference).
  virtual std::vector<OpTime> profile_step(int /*token*/, int /*pos*/) { return {}; }

  // Paged KV memory (Model::use_kv_pool): lets go of what this session's cache held and maps
  // in the longest run of whole cached blocks that `prompt` begins with (short of its last id,
  // which always runs), from whichever sequence wrote them, setting `cached` to their ids. A
  // session with a cache of its own does nothing and returns false: `cached` already says what
  // it can reuse.
  virtual bool adopt_prefix(std::span<const int> /*prompt*/) { return false; }
  // Paged KV memory: gives back the blocks this session holds (the whole ones stay cached for a
  // later prompt that begins alike, in any session; a GPU session first waits for what it has
  // queued, since another sequence may take them at once) and empties `cached`; a sequence that
  // follows starts from adopt_prefix or position 0. A session with a cache of its own keeps it
  // (and `cached`) and returns false. Never throws: a request's guard calls it from a
  // destructor.
  virtual bool release_kv() { return false; }

  // The ids whose K/V the cache holds from position 0, as generate_cached leaves them: the
  // next prompt runs only past the longest prefix it shares with these.
  std::vector<int> cached;

 private:
  Model& model_;
};

// What Model::forward_batch requires of its rows, checked (for an engine's override too): each a
// session of `model`, once, at a position inside its context, with a token of its vocabulary.
// Throws kestrel::Error naming the row.
void check_batch_rows(const Model& model, std::span<const BatchRow> rows);

}  // namespace kestrel
