// Random checkpoints of every family Kestrel runs (models/io/family.h), at real shapes.
//
// Scaling (why the model stays finite in fp16 and decodes with clear winners):
//   embedding std 1; RMSNorm weights 1 + N(0, 0.02); q/k/v/gate/up std 1/sqrt(K) so their
//   outputs have std ~1; o/down std 0.5/sqrt(K) so each layer adds std <= ~0.6 to the
//   residual stream (a 40-layer model ends near std 4); lm_head std kLogitStd/sqrt(hidden),
//   with log-normal row norms (kHeadRowSpread), so logits have std ~kLogitStd and the top
//   logit typically leads the second by more than 1.
//   Normal draws are bounded (+-3.46 std), so no single weight is an outlier.
//
// GPTQ linears are drawn directly as codes, zeros and scales. Codes of column n in group g
// are uniform in [z - r, z + r] with r = min(z, maxq - z): the dequantized weights have mean 0
// in every group and column. (Uniform codes over all of [0, maxq] would give symmetric models
// a common offset of -scale/2 on every weight: a rank-one part of W that dominates its
// spectrum and amplifies any mean of the input, layer after layer.) Symmetric models get the
// standard zero 2^(b-1), codes [1, maxq]; asymmetric ones a zero drawn from the middle half of
// the code range, so codes reach 0 or maxq. Scales give each (group, column) the intended std:
// the variance of 2r+1 uniform consecutive codes is r(r+1)/3.
#include "tools/synth/synth.h"

#include <sentencepiece_processor.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "base/dtype.h"
#include "base/error.h"
#include "base/staged_output.h"
#include "models/io/config.h"
#include "models/io/family.h"
#include "models/io/safetensors.h"
#include "kernels/gptq/gptq_format.h"
#include "tokenizer/tokenizer.h"
#include "tools/synth/corpus.h"
#include "tools/synth/rng.h"

namespace kestrel::synth {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

constexpr float kLogitStd = 6.0f;
// Log-normal spread of the output head's row norms. Gaussian logits leave the top two only
// ~std/sqrt(2 ln vocab) apart (below 1 half of the time, below 0.05 for 1-3% of tokens), so
// greedy decoding would flip on fp16 rounding; a heavier tail puts the median gap near 4 and
// the top two within 0.05 for well under 1% of tokens, at the same overall logit std.
constexpr float kHeadRowSpread = 0.5f;
constexpr int kTokenizerVocab = 1000;
constexpr int64_t kChunk = int64_t(1) << 16;  // elements per RNG stream of a dense tensor

struct Dims {
  int hidden = 0, intermediate = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0,
      vocab = 0, max_pos = 0;
  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
};

// What the family table leaves to each checkpoint and synth sets as the family's real models
// do: RoPE's base, Llama 3's scaling, a tied head. Everything else a checkpoint holds (config
// keys, blocks, biases, tensor names) follows the table (models/io/family.h). An entry named
// after its family sets that family's values; one named otherwise is an --arch of its own
// (llama3: Llama with Llama 3's RoPE). A family without an entry gets the defaults.
struct Variant {
  const char* name;
  const char* family;
  float rope_theta = 10000.0f;
  float llama3_factor = 0;  // Llama 3's rope scaling (original 8192 positions)
  bool tied = false;        // the output head is the embedding
};

const Variant kVariants[] = {
    {"llama3", "llama", 500000.0f, 8.0f},
    {"qwen2", "qwen2", 1e6f},
    {"qwen3", "qwen3", 1e6f},
    {"opt", "opt", 10000.0f, 0, true},
};

// A family and synth's choices for it.
struct Arch {
  std::string name;  // as --arch gives it
  const Family* family = nullptr;
  float rope_theta = 10000.0f;
  float llama3_factor = 0;
  bool tied = false;
};

}  // namespace

std::vector<std::string> arch_names() {
  std::vector<std::string> out;
  for (const Family& f : all_families()) {
    out.push_back(f.name);
    for (const Variant& v : kVariants)
      if (v.family == f.name && v.name != f.name) out.push_back(v.name);
  }
  return out;
}

namespace {

Arch arch_named(const std::string& name) {
  Arch a;
  a.name = name;
  std::string family = name;
  for (const Variant& v : kVariants)
    if (v.name == name) {
      family = v.family;
      a.rope_theta = v.rope_theta;
      a.llama3_factor = v.llama3_factor;
      a.tied = v.tied;
    }
  for (const Family& f : all_families())
    if (f.name == family) a.family = &f;
  if (!a.family)
    throw Error(fmt::format("unknown --arch {} (known: {})", name, fmt::join(arch_names(), ", ")));
  return a;
}

struct Preset {
  Dims d;
  const char* arch = "llama";
  bool tied = false;
  float llama3_factor = 0;  // overrides the family's
};

// Shapes of real models. vocab 0 = the tokenizer's size; head_dim (0) = hidden / heads.
Preset preset(const std::string& shape) {
  if (shape == "tiny") return {{256, 768, 4, 4, 2, 0, 0, 2048}};
  if (shape == "1b") return {{2048, 5632, 22, 32, 4, 0, 32000, 2048}};     // TinyLlama 1.1B
  if (shape == "7b") return {{4096, 11008, 32, 32, 32, 0, 32000, 4096}};   // Llama-2-7B
  if (shape == "13b") return {{5120, 13824, 40, 40, 40, 0, 32000, 4096}};  // Llama-2-13B
  if (shape == "llama3-8b") return {{4096, 14336, 32, 32, 8, 128, 128256, 131072}, "llama3"};
  if (shape == "llama3.2-1b")
    return {{2048, 8192, 16, 32, 8, 64, 128256, 131072}, "llama3", true, 32.0f};
  if (shape == "qwen2.5-7b") return {{3584, 18944, 28, 28, 4, 128, 152064, 32768}, "qwen2"};
  if (shape == "qwen3-8b") return {{4096, 12288, 36, 32, 8, 128, 151936, 40960}, "qwen3"};
  if (shape == "opt-6.7b") return {{4096, 16384, 32, 32, 32, 128, 50272, 2048}, "opt", true};
  if (shape == "custom") return {};
  throw Error(fmt::format("unknown --shape {} (known: tiny, 1b, 7b, 13b, llama3-8b, llama3.2-1b, "
                          "qwen2.5-7b, qwen3-8b, opt-6.7b, custom)", shape));
}

Dims resolve_dims(const SynthOptions& o, int tokenizer_pieces) {
  Dims d = preset(o.shape).d;
  const auto apply = [](int& field, int value, const char* flag) {
    KESTREL_CHECK(value >= 0, fmt::format("{} {} must be positive", flag, value));
    if (value > 0) field = value;
  };
  apply(d.hidden, o.hidden, "--hidden");
  apply(d.intermediate, o.intermediate, "--intermediate");
  apply(d.n_layers, o.n_layers, "--layers");
  apply(d.n_heads, o.n_heads, "--heads");
  apply(d.n_kv_heads, o.n_kv_heads, "--kv-heads");
  apply(d.vocab, o.vocab, "--vocab");
  apply(d.max_pos, o.max_pos, "--max-pos");
  if (o.shape == "custom") {
    KESTREL_CHECK(d.hidden && d.intermediate && d.n_layers && d.n_heads,
                  "--shape custom needs --hidden, --intermediate, --layers and --heads");
    if (!d.n_kv_heads) d.n_kv_heads = d.n_heads;
    if (!d.max_pos) d.max_pos = 2048;
  }
  KESTREL_CHECK(o.head_dim >= 0, fmt::format("--head-dim {} must be positive", o.head_dim));
  if (o.head_dim > 0) {
    d.head_dim = o.head_dim;
  } else if (d.head_dim == 0) {
    KESTREL_CHECK(d.hidden % d.n_heads == 0,
                  fmt::format("hidden {} is not a multiple of heads {}: give --head-dim", d.hidden,
                              d.n_heads));
    d.head_dim = d.hidden / d.n_heads;
  }
  KESTREL_CHECK(d.n_kv_heads <= d.n_heads && d.n_heads % d.n_kv_heads == 0,
                fmt::format("heads {} is not a multiple of kv heads {}", d.n_heads, d.n_kv_heads));
  KESTREL_CHECK(d.head_dim % 2 == 0, fmt::format("head_dim {} must be even (rotary pairs)", d.head_dim));
  if (!d.vocab) d.vocab = tokenizer_pieces;
  KESTREL_CHECK(d.vocab >= tokenizer_pieces,
                fmt::format("vocab {} is smaller than the tokenizer's {} pieces", d.vocab,
                            tokenizer_pieces));
  return d;
}

void validate_quant(const SynthOptions& o) {
  KESTREL_CHECK(o.dtype == "fp16" || o.dtype == "gptq",
                fmt::format("unknown --dtype {} (known: fp16, gptq)", o.dtype));
  if (o.dtype != "gptq") return;
  KESTREL_CHECK(o.bits == 2 || o.bits == 3 || o.bits == 4 || o.bits == 8,
                fmt::format("unsupported --bits {} (supported: 2, 3, 4, 8)", o.bits));
  KESTREL_CHECK(o.group_size == -1 || o.group_size > 0,
                fmt::format("--group-size {} must be -1 or positive", o.group_size));
  KESTREL_CHECK(o.format == "gptq" || o.format == "gptq_v2",
                fmt::format("unknown --format {} (known: gptq, gptq_v2)", o.format));
}

// qweight packs K codes per column and qzeros N codes per row into whole 32-bit words.
void validate_packing(const Dims& d, int bits) {
  const int multiple = 32 / std::gcd(bits, 32);
  const std::pair<const char*, int> dims[] = {{"hidden", d.hidden},
                                              {"heads * head_dim", d.q_dim()},
                                              {"kv heads * head_dim", d.kv_dim()},
                                              {"intermediate", d.intermediate}};
  for (const auto& [name, v] : dims)
    KESTREL_CHECK(v % multiple == 0,
                  fmt::format("{}-bit packing needs every linear dimension to be a multiple of {}: "
                              "{} is {}", bits, multiple, name, v));
}

// Runs fn(i) for i in [0, n) on up to `threads` threads; rethrows the first exception.
void parallel_for(int64_t n, int threads, const std::function<void(int64_t)>& fn) {
  const int t = (int)std::min<int64_t>(n, std::max(1, threads));
  if (t <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  std::vector<std::thread> pool;
  for (int w = 0; w < t; ++w)
    pool.emplace_back([&] {
      for (int64_t i; !failed && (i = next++) < n;) {
        try {
          fn(i);
        } catch (...) {
          if (!failed.exchange(true)) error = std::current_exception();
        }
      }
    });
  for (std::thread& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

// ---- dense fp16 tensors -------------------------------------------------------------------

// Values mean + std * N(0, 1). With row_spread > 0, each row of `row_len` values is also
// scaled by exp(row_spread * N(0, 1)) / exp(row_spread^2), which keeps the overall std.
struct DenseInit {
  float mean = 0, std = 1;
  float row_spread = 0;
  int64_t row_len = 1;
};

void fill_normal_f16(uint8_t* dst, int64_t numel, const DenseInit& init, uint64_t seed,
                     int threads) {
  const uint64_t row_seed = derive_seed(seed, ~0ull);
  const float norm = std::exp(-init.row_spread * init.row_spread);
  parallel_for((numel + kChunk - 1) / kChunk, threads, [&](int64_t c) {
    Rng rng(derive_seed(seed, (uint64_t)c));
    const int64_t begin = c * kChunk, end = std::min(numel, begin + kChunk);
    std::vector<uint16_t> h(end - begin);
    int64_t row = -1;
    float std = init.std;
    for (int64_t i = begin; i < end; ++i) {
      if (init.row_spread > 0 && i / init.row_len != row) {
        row = i / init.row_len;
        Rng row_rng(derive_seed(row_seed, (uint64_t)row));
        std = init.std * norm * std::exp(init.row_spread * row_rng.normal());
      }
      h[i - begin] = float_to_half(init.mean + std * rng.normal());
    }
    std::memcpy(dst + begin * 2, h.data(), h.size() * 2);
  });
}

// ---- GPTQ linears -------------------------------------------------------------------------

struct QuantLinear {
  int bits = 4;
  int64_t K = 0, N = 0, G = 1;
  int group_size = 128;  // -1 = one group
  bool act_order = false, asym = false;
  int zero_offset = 1;
  float std = 0;         // intended std of the dequantized weights
  uint64_t seed = 0;     // of this linear
  uint64_t perm_seed = 0;  // of its act-order permutation: shared by linears of one input

  int maxq() const { return (1 << bits) - 1; }
};

// Zero point z and code range [lo, lo + span) of every (group, column), [G * N].
struct Zeros {
  std::vector<uint8_t> z, lo, span;
};

Zeros draw_zeros(const QuantLinear& q) {
  Zeros out;
  const size_t n = (size_t)(q.G * q.N);
  out.z.resize(n);
  out.lo.resize(n);
  out.span.resize(n);
  Rng rng(derive_seed(q.seed, 1));
  const int half = 1 << (q.bits - 1), quarter = half / 2;
  for (size_t i = 0; i < n; ++i) {
    // asym: the middle half of the code range, [2^(b-2), 3*2^(b-2) - 1]; never 0, so a v1
    // file (zero stored minus one) can hold it.
    const int z = q.asym ? quarter + (int)rng.below((uint32_t)half) : half;
    const int r = std::min(z, q.maxq() - z);
    out.z[i] = (uint8_t)z;
    out.lo[i] = (uint8_t)(z - r);
    out.span[i] = (uint8_t)(2 * r + 1);
  }
  return out;
}

std::vector<int32_t> draw_g_idx(const QuantLinear& q) {
  std::vector<int32_t> g_idx(q.K, 0);
  if (q.group_size <= 0) return g_idx;
  if (!q.act_order) {
    for (int64_t k = 0; k < q.K; ++k) g_idx[k] = (int32_t)(k / q.group_size);
    return g_idx;
  }
  std::vector<int32_t> perm(q.K);
  std::iota(perm.begin(), perm.end(), 0);
  Rng rng(derive_seed(q.perm_seed, 2));
  for (int64_t i = q.K - 1; i > 0; --i) std::swap(perm[i], perm[rng.below((uint32_t)(i + 1))]);
  return gptq::act_order_g_idx(perm, q.group_size);
}

// qweight [K*b/32, N]: code k of column n at bit b*k of the column's word stream. The K axis
// is cut into blocks of 32 codes, which fill exactly b word rows: blocks are independent.
void fill_qweight(uint8_t* dst, const QuantLinear& q, int threads) {
  const Zeros zeros = draw_zeros(q);
  const std::vector<int32_t> g_idx = draw_g_idx(q);
  const int b = q.bits;
  const int64_t N = q.N;
  parallel_for((q.K + 31) / 32, threads, [&](int64_t blk) {
    Rng rng(derive_seed(q.seed, 1000 + (uint64_t)blk));
    const int64_t k0 = blk * 32, k1 = std::min(q.K, k0 + 32);
    const int64_t row0 = k0 * b / 32, rows = (k1 - k0) * b / 32;
    std::vector<uint32_t> words(rows * N + N, 0);  // + a spill row for straddling codes
    for (int64_t k = k0; k < k1; ++k) {
      const uint8_t* lo = &zeros.lo[(size_t)g_idx[k] * N];
      const uint8_t* span = &zeros.span[(size_t)g_idx[k] * N];
      const int64_t bit = (k - k0) * b;
      const int shift = (int)(bit & 31);
      uint32_t* row = &words[(bit >> 5) * N];
      uint64_t r = 0;
      for (int64_t n = 0; n < N; ++n) {
        if ((n & 3) == 0) r = rng.next();
        const uint32_t code = lo[n] + (((uint32_t)(r & 0xFFFF) * span[n]) >> 16);
        r >>= 16;
        const uint64_t v = (uint64_t)code << shift;
        row[n] |= (uint32_t)v;
        row[n + N] |= (uint32_t)(v >> 32);
      }
    }
    std::memcpy(dst + row0 * N * 4, words.data(), (size_t)(rows * N * 4));
  });
}

// qzeros [G, N*b/32]: the stored zero is z - zero_offset.
void fill_qzeros(uint8_t* dst, const QuantLinear& q) {
  const Zeros zeros = draw_zeros(q);
  const int64_t row_words = q.N * q.bits / 32;
  std::vector<uint32_t> words(q.G * row_words, 0);
  for (int64_t g = 0; g < q.G; ++g)
    for (int64_t n = 0; n < q.N; ++n)
      gptq::write_code(&words[g * row_words], 1, n, q.bits,
                       (uint32_t)(zeros.z[g * q.N + n] - q.zero_offset));
  std::memcpy(dst, words.data(), words.size() * 4);
}

// scales [G, N] fp16: std / code std, times a jitter in [0.75, 1.25] as real scales vary.
void fill_scales(uint8_t* dst, const QuantLinear& q) {
  const Zeros zeros = draw_zeros(q);
  Rng rng(derive_seed(q.seed, 3));
  const double jitter_rms = std::sqrt(1.0 + 0.25 / 12.0);  // E[j^2] of uniform [0.75, 1.25]
  std::vector<uint16_t> h(q.G * q.N);
  for (size_t i = 0; i < h.size(); ++i) {
    const double r = (zeros.span[i] - 1) / 2;
    const double jitter = (0.75 + 0.5 * rng.uniform()) / jitter_rms;
    h[i] = float_to_half((float)(q.std / std::sqrt(r * (r + 1) / 3.0) * jitter));
  }
  std::memcpy(dst, h.data(), h.size() * 2);
}

// ---- the model ----------------------------------------------------------------------------

struct Plan {
  SynthOptions opt;
  // --dynamic: each linear's format by name, nullopt = FP16; empty = all in opt's format.
  std::map<std::string, std::optional<LinearQuant>> formats;
  Dims d;
  Arch arch;
  bool tied = false;     // embedding shared with the output head
  int window = 0;        // Mistral's sliding window, else 0
  int threads = 1;
  int64_t params = 0;
};

void add_dense(SafetensorsWriter& w, const std::shared_ptr<const Plan>& p, const std::string& name,
               std::vector<int64_t> shape, DenseInit init) {
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  const uint64_t seed = derive_seed(p->opt.seed, name_hash(name));
  w.add(name, DType::F16, std::move(shape), [p, numel, init, seed](uint8_t* dst, size_t) {
    fill_normal_f16(dst, numel, init, seed, p->threads);
  });
}

// `input`: the linears that read the same input (q, k, v; gate, up) share it, and GPTQ then
// orders their columns alike (one Hessian, one act-order permutation); --g-idx-per-linear
// draws one permutation per linear instead.
void add_linear(SafetensorsWriter& w, const std::shared_ptr<const Plan>& p, const std::string& name,
                const std::string& input, int64_t N, int64_t K, float std) {
  LinearQuant f{p->opt.bits, p->opt.group_size, p->opt.act_order, !p->opt.asym};
  if (auto it = p->formats.find(name); it != p->formats.end()) {
    if (!it->second) return add_dense(w, p, name + ".weight", {N, K}, {0.0f, std});
    f = *it->second;
  }
  if (p->opt.dtype == "fp16") {
    add_dense(w, p, name + ".weight", {N, K}, {0.0f, std});
    return;
  }
  QuantLinear q;
  q.bits = f.bits;
  q.K = K;
  q.N = N;
  q.group_size = f.group_size;
  q.G = q.group_size <= 0 ? 1 : (K + q.group_size - 1) / q.group_size;
  q.act_order = f.desc_act;
  q.asym = !f.sym;
  q.zero_offset = p->opt.format == "gptq" ? 1 : 0;
  q.std = std;
  q.seed = derive_seed(p->opt.seed, name_hash(name));
  q.perm_seed = p->opt.g_idx_per_linear ? q.seed : derive_seed(p->opt.seed, name_hash(input));
  const int b = q.bits;
  w.add(name + ".qweight", DType::I32, {K * b / 32, N},
        [p, q](uint8_t* dst, size_t) { fill_qweight(dst, q, p->threads); });
  w.add(name + ".qzeros", DType::I32, {q.G, N * b / 32},
        [q](uint8_t* dst, size_t) { fill_qzeros(dst, q); });
  w.add(name + ".scales", DType::F16, {q.G, N}, [q](uint8_t* dst, size_t) { fill_scales(dst, q); });
  w.add(name + ".g_idx", DType::I32, {K}, [q](uint8_t* dst, size_t) {
    const std::vector<int32_t> g = draw_g_idx(q);
    std::memcpy(dst, g.data(), g.size() * 4);
  });
}

void add_tensors(SafetensorsWriter& w, const std::shared_ptr<Plan>& plan) {
  const Dims& d = plan->d;
  const Blocks& b = plan->arch.family->blocks;
  const TensorNames& n = plan->arch.family->names;
  const int64_t H = d.hidden, I = d.intermediate, Q = d.q_dim(), KV = d.kv_dim(), V = d.vocab;
  const float in_std = 1.0f / std::sqrt((float)H);
  int64_t params = 0;
  auto dense = [&](const std::string& name, std::vector<int64_t> shape, DenseInit init) {
    int64_t numel = 1;
    for (int64_t x : shape) numel *= x;
    params += numel;
    add_dense(w, plan, name, std::move(shape), init);
  };
  // A norm's weight near 1 (and LayerNorm's bias near 0).
  auto norm = [&](const std::string& name, int64_t width) {
    dense(name + ".weight", {width}, {1.0f, 0.02f});
    if (b.norm == NormKind::Layer) dense(name + ".bias", {width}, {0.0f, 0.02f});
  };
  // A linear (dense or GPTQ) and its bias, small enough not to shift the activations' scale.
  auto linear = [&](const std::string& name, const std::string& input, int64_t N, int64_t K,
                    float std, bool bias) {
    add_linear(w, plan, name, input, N, K, std);
    params += N * K;
    if (bias) dense(name + ".bias", {N}, {0.0f, 0.1f});
  };
  // With tied embeddings the embedding is also the output head: scale it for the logits.
  const DenseInit head{0.0f, kLogitStd / std::sqrt((float)H), kHeadRowSpread, H};
  dense(n.embed + ".weight", {V, H}, plan->tied ? head : DenseInit{0.0f, 1.0f});
  if (b.positions == PositionKind::Learned)  // rows offset by the family's offset
    dense(n.positions + ".weight", {d.max_pos + b.position_offset, H}, {0.0f, 0.1f});
  for (int l = 0; l < d.n_layers; ++l) {
    const std::string pre = fmt::format("{}{}.", n.layer, l);
    norm(pre + n.input_norm, H);
    const std::string attn_in = pre + "self_attn.input", mlp_in = pre + "mlp.input";
    linear(pre + n.q, attn_in, Q, H, in_std, b.qkv_bias);
    linear(pre + n.k, attn_in, KV, H, in_std, b.qkv_bias);
    linear(pre + n.v, attn_in, KV, H, in_std, b.qkv_bias);
    if (b.qk_norm) {
      dense(pre + n.q_norm + ".weight", {d.head_dim}, {1.0f, 0.02f});
      dense(pre + n.k_norm + ".weight", {d.head_dim}, {1.0f, 0.02f});
    }
    linear(pre + n.o, pre + n.o, H, Q, 0.5f / std::sqrt((float)Q), b.o_bias);
    norm(pre + n.post_norm, H);
    if (b.mlp == MlpKind::GatedSiLU) linear(pre + n.gate, mlp_in, I, H, in_std, b.mlp_bias);
    linear(pre + n.up, mlp_in, I, H, in_std, b.mlp_bias);
    linear(pre + n.down, pre + n.down, H, I, 0.5f / std::sqrt((float)I), b.mlp_bias);
  }
  norm(n.final_norm, H);
  if (!plan->tied) dense(n.lm_head + ".weight", {V, H}, head);
  plan->params = params;
}

// ---- files --------------------------------------------------------------------------------

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  KESTREL_CHECK(f, fmt::format("{}: cannot create: {}", path.string(), std::strerror(errno)));
  f << text;
  f.close();
  KESTREL_CHECK(f, fmt::format("{}: write failed", path.string()));
}

std::string read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  KESTREL_CHECK(f, fmt::format("{}: cannot open tokenizer", path.string()));
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

ojson quant_json(const SynthOptions& o) {
  ojson q{{"bits", o.bits},
               {"group_size", o.group_size},
               {"desc_act", o.act_order},
               {"sym", !o.asym},
               {"checkpoint_format", o.format},
               {"quant_method", "gptq"},
               {"damp_percent", 0.01},
               {"static_groups", false},
               {"true_sequential", true}};
  if (!o.dynamic.empty()) q["dynamic"] = ojson::parse(o.dynamic);
  return q;
}

// --dynamic: every linear's format under the rules, as the loader resolves them (a rule that
// matches no linear, or a value Kestrel does not run, is refused here, before any work).
std::map<std::string, std::optional<LinearQuant>> resolve_dynamic(const SynthOptions& o,
                                                                  const Dims& d, const Arch& arch) {
  KESTREL_CHECK(o.dtype == "gptq", "--dynamic goes with --dtype gptq");
  ojson rules;
  try {
    rules = ojson::parse(o.dynamic);
  } catch (const ojson::exception&) {
    throw Error(fmt::format("--dynamic: not valid JSON: {}", o.dynamic));
  }
  KESTREL_CHECK(rules.is_object(), "--dynamic must be a JSON object of module regexes");
  const QuantConfig q = parse_quant_config(quant_json(o).dump(), "--dynamic");
  const TensorNames& n = arch.family->names;
  std::vector<std::string> modules;
  for (int l = 0; l < d.n_layers; ++l) {
    const std::string pre = fmt::format("{}{}.", n.layer, l);
    for (const std::string* s : {&n.q, &n.k, &n.v, &n.o, &n.gate, &n.up, &n.down})
      if (s != &n.gate || arch.family->blocks.mlp == MlpKind::GatedSiLU) modules.push_back(pre + *s);
  }
  modules.push_back(n.lm_head);
  const std::vector<std::optional<LinearQuant>> f =
      resolve_modules(q.base(), q.dynamic, modules, "--dynamic");
  std::map<std::string, std::optional<LinearQuant>> out;
  for (size_t i = 0; i + 1 < modules.size(); ++i) {  // lm_head stays FP16 whatever a rule says
    out[modules[i]] = f[i];
    if (f[i]) validate_packing(d, f[i]->bits);
  }
  return out;
}

ojson config_json(const Plan& p, int bos, int eos) {
  const SynthOptions& o = p.opt;
  const Dims& d = p.d;
  const Arch& a = p.arch;
  const Family& f = *a.family;
  ojson c;
  if (f.keys == ConfigKeys::Opt) {
    c = {{"architectures", {f.architecture}},
         {"model_type", f.name},
         {"hidden_size", d.hidden},
         {"ffn_dim", d.intermediate},
         {"num_hidden_layers", d.n_layers},
         {"num_attention_heads", d.n_heads},
         {"max_position_embeddings", d.max_pos},
         {"vocab_size", d.vocab},
         {"word_embed_proj_dim", d.hidden},
         {"do_layer_norm_before", true},
         {"activation_function", "relu"},
         {"enable_bias", true},
         {"layer_norm_elementwise_affine", true},
         {"tie_word_embeddings", p.tied}};
  } else {
    c = {{"architectures", {f.architecture}},
         {"model_type", f.name},
         {"hidden_size", d.hidden},
         {"intermediate_size", d.intermediate},
         {"num_hidden_layers", d.n_layers},
         {"num_attention_heads", d.n_heads},
         {"num_key_value_heads", d.n_kv_heads},
         {"head_dim", d.head_dim},
         {"hidden_act", "silu"},
         {"max_position_embeddings", d.max_pos},
         {"vocab_size", d.vocab},
         {"rms_norm_eps", 1e-5},
         {"rope_theta", a.rope_theta},
         {"tie_word_embeddings", p.tied}};
    if (a.llama3_factor > 0)
      c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", a.llama3_factor},
                           {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                           {"original_max_position_embeddings", 8192}};
    const Switches& s = f.switches;
    if (s.sliding_window) c["sliding_window"] = p.window;
    if (s.use_sliding_window) c["use_sliding_window"] = false;
    // No biases beyond the family's own: attention_bias false wherever q, k, v have none (a
    // family that does not read it ignores it, as transformers does), mlp_bias where it is read.
    if (!f.blocks.qkv_bias) c["attention_bias"] = false;
    if (s.mlp_bias) c["mlp_bias"] = false;
  }
  c["bos_token_id"] = bos;
  c["eos_token_id"] = eos;
  c["torch_dtype"] = "float16";
  c["use_cache"] = true;
  if (o.dtype == "gptq") c["quantization_config"] = quant_json(o);
  return c;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (b >= 1000 && u < 4) b /= 1000, ++u;
  return fmt::format("{:.{}f} {}", b, u ? 2 : 0, units[u]);
}

std::string human_count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  return fmt::format("{:.0f}", n);
}

// The files of a Hugging Face tokenizer at `path` (a tokenizer.json, or a folder holding one,
// or GPT-2's vocab.json + merges.txt), with the tokenizer_config.json beside them; empty for a
// SentencePiece model or no path.
std::vector<std::string> hf_tokenizer_files(const std::string& path) {
  if (path.empty()) return {};
  const fs::path p = path;
  std::vector<std::string> files;
  fs::path folder;
  if (fs::is_directory(p)) {
    folder = p;
    if (fs::exists(p / "tokenizer.json")) {
      files.push_back((p / "tokenizer.json").string());
    } else if (!fs::exists(p / "tokenizer.model") && fs::exists(p / "vocab.json") &&
               fs::exists(p / "merges.txt")) {
      files = {(p / "vocab.json").string(), (p / "merges.txt").string()};
    } else {
      KESTREL_CHECK(fs::exists(p / "tokenizer.model"),
                    fmt::format("--tokenizer {}: no tokenizer.json, tokenizer.model or vocab.json + "
                                "merges.txt in it", path));
    }
  } else if (p.filename() == "tokenizer.json") {
    KESTREL_CHECK(fs::is_regular_file(p), fmt::format("--tokenizer {}: no such file", path));
    folder = p.parent_path();
    files.push_back(p.string());
  }
  if (!files.empty() && fs::is_regular_file(folder / "tokenizer_config.json"))
    files.push_back((folder / "tokenizer_config.json").string());
  return files;
}

}  // namespace

void write_model(const SynthOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  KESTREL_CHECK(!opt.out.empty(), "no output directory (--out)");
  validate_quant(opt);
  const Preset pre = preset(opt.shape);  // an unknown shape fails before any work
  Arch arch = arch_named(opt.arch.empty() ? pre.arch : opt.arch);
  if (pre.llama3_factor > 0 && arch.llama3_factor > 0) arch.llama3_factor = pre.llama3_factor;

  // Everything is written into a temporary directory beside --out that takes its name once
  // complete (base/staged_output.h): a failure leaves an existing --out as it was.
  StagedDir out(opt.out, opt.force);
  const fs::path dir = out.path();

  // Tokenizer first: its size is the vocab of shapes that do not fix one. A SentencePiece
  // model (given or trained here) gets a tokenizer_config.json written for it; a Hugging Face
  // tokenizer's files are copied as they are, and read back for its size and special ids.
  const std::vector<std::string> hf_files = hf_tokenizer_files(opt.tokenizer);
  std::string tok_bytes;
  int pieces = 0, bos = 1, eos = 2;
  sentencepiece::SentencePieceProcessor sp;
  if (!hf_files.empty()) {
    for (const std::string& f : hf_files) fs::copy_file(f, dir / fs::path(f).filename());
    const std::unique_ptr<Tokenizer> tok = Tokenizer::load(dir.string());
    pieces = tok->vocab_size();
    eos = tok->eos_ids().empty() ? std::max(tok->bos_id(), 0) : tok->eos_ids().front();
    bos = tok->bos_id() >= 0 ? tok->bos_id() : eos;
  } else {
    if (!opt.tokenizer.empty()) {
      fs::path src = opt.tokenizer;
      if (fs::is_directory(src)) src /= "tokenizer.model";
      tok_bytes = read_file(src);
    } else {
      tok_bytes = train_tokenizer(kTokenizerVocab);
    }
    KESTREL_CHECK(sp.LoadFromSerializedProto(tok_bytes).ok(),
                  fmt::format("{}: not a SentencePiece model", opt.tokenizer));
    pieces = sp.GetPieceSize();
    bos = sp.bos_id() >= 0 ? sp.bos_id() : 1;
    eos = sp.eos_id() >= 0 ? sp.eos_id() : 2;
  }

  auto plan = std::make_shared<Plan>();
  plan->opt = opt;
  plan->d = resolve_dims(opt, pieces);
  plan->arch = arch;
  // OPT's keys have no num_key_value_heads nor head_dim: one KV head per head, hidden split.
  const bool opt_keys = arch.family->keys == ConfigKeys::Opt;
  if (opt_keys && opt.n_kv_heads == 0) plan->d.n_kv_heads = plan->d.n_heads;
  plan->tied = opt.tie_embeddings || pre.tied || arch.tied;
  if (arch.family->switches.sliding_window)
    plan->window = opt.sliding_window >= 0 ? opt.sliding_window : opt.shape == "tiny" ? 32 : 4096;
  KESTREL_CHECK(!opt_keys || plan->d.n_kv_heads == plan->d.n_heads,
                fmt::format("--arch {} has no grouped-query attention: --kv-heads must equal --heads",
                            arch.name));
  KESTREL_CHECK(!opt_keys || plan->d.head_dim * plan->d.n_heads == plan->d.hidden,
                fmt::format("--arch {} needs heads * head_dim = hidden", arch.name));
  if (opt.dtype == "gptq") validate_packing(plan->d, opt.bits);
  if (!opt.dynamic.empty()) plan->formats = resolve_dynamic(opt, plan->d, plan->arch);
  plan->threads = opt.threads > 0 ? opt.threads : (int)std::max(1u, std::thread::hardware_concurrency());
  const Dims& d = plan->d;

  if (opt.dtype == "gptq" && opt.asym && opt.format == "gptq" && !opt.quiet)
    std::cerr << fmt::format("kestrel-synth: warning: format gptq stores zero points minus one and "
                             "cannot hold a zero point of 0; asymmetric zeros are drawn in [1, {}] "
                             "(use --format gptq_v2 for asymmetric models)\n",
                             (1 << opt.bits) - 1);

  SafetensorsWriter writer;
  try {
    write_text(dir / "config.json", config_json(*plan, bos, eos).dump(2) + "\n");
    if (opt.dtype == "gptq")
      write_text(dir / "quantize_config.json", quant_json(opt).dump(2) + "\n");
    write_text(dir / "generation_config.json",
               ojson{{"bos_token_id", bos}, {"eos_token_id", eos}, {"do_sample", false},
                     {"max_length", d.max_pos}}.dump(2) + "\n");
    if (hf_files.empty()) {
      write_text(dir / "tokenizer.model", tok_bytes);
      write_text(dir / "tokenizer_config.json",
                 ojson{{"add_bos_token", true},
                       {"add_eos_token", false},
                       {"bos_token", sp.IdToPiece(bos)},
                       {"eos_token", sp.IdToPiece(eos)},
                       {"unk_token", sp.unk_id() >= 0 ? sp.IdToPiece(sp.unk_id()) : "<unk>"},
                       {"model_max_length", d.max_pos},
                       {"tokenizer_class", "LlamaTokenizer"},
                       {"clean_up_tokenization_spaces", false}}.dump(2) + "\n");
    }

    add_tensors(writer, plan);
    writer.write_model(dir.string());
    out.commit();
  } catch (const std::exception& e) {
    throw Error(fmt::format("{}; nothing written to {}", e.what(), opt.out));
  }

  if (opt.quiet) return;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string quant =
      opt.dtype == "fp16"
          ? "fp16"
          : fmt::format("gptq {}-bit group {} {}{} {}{}", opt.bits, opt.group_size,
                        opt.asym ? "asym" : "sym", opt.act_order ? " act-order" : "", opt.format,
                        opt.dynamic.empty() ? "" : " with dynamic overrides");
  std::cout << fmt::format("kestrel-synth: {} {} {} (hidden {}, {} layers, vocab {}): {} params, {} "
                           "-> {} in {:.1f} s\n",
                           opt.shape, arch.name, quant, d.hidden, d.n_layers, d.vocab,
                           human_count((double)plan->params), human_bytes((double)writer.total_bytes()),
                           opt.out, secs);
}

}  // namespace kestrel::synth
