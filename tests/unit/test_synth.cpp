// kestrel-synth: the directories it writes load with load_model_spec, hold GPTQ tensors in
// the documented layout with the intended weight statistics, and are reproducible; they are
// written whole or not at all (a non-empty --out needs --force; a failed write or Ctrl-C leaves
// the old model as it was).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sentencepiece_processor.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "base/error.h"
#include "models/io/family.h"
#include "models/io/model_spec.h"
#include "kernels/gptq/gptq_format.h"
#include "models/host_gptq.h"
#include "tests/support/child.h"
#include "tokenizer/tokenizer.h"
#include "tools/synth/synth.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;
using synth::SynthOptions;

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("kestrel_synth_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string sub(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

struct Stats {
  double mean = 0, std = 0;
  bool finite = true;
};

Stats stats(const std::vector<float>& v) {
  Stats s;
  double sum = 0, sq = 0;
  for (float x : v) {
    if (!std::isfinite(x)) s.finite = false;
    sum += x;
    sq += (double)x * x;
  }
  s.mean = sum / v.size();
  s.std = std::sqrt(sq / v.size() - s.mean * s.mean);
  return s;
}

// Dequantizes a GPTQ linear with the reference formula, W [N, K].
std::vector<float> dequantize(const LinearSpec& l) {
  const HostGptq h(l);
  std::vector<float> W(l.N * l.K);
  gptq::dequantize_ref(h.view, W.data());
  return W;
}

// One tokenizer for the whole suite: training it once keeps the suite fast.
class SynthTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir;
    SynthOptions o;
    o.out = dir_->sub("base");
    o.quiet = true;
    synth::write_model(o);
    tokenizer_ = o.out + "/tokenizer.model";
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static SynthOptions tiny(const std::string& name) {
    SynthOptions o;
    o.out = dir_->sub(name);
    o.tokenizer = tokenizer_;
    o.quiet = true;
    o.threads = 2;
    return o;
  }
  static int tokenizer_pieces() {
    sentencepiece::SentencePieceProcessor sp;
    EXPECT_TRUE(sp.Load(tokenizer_).ok());
    return sp.GetPieceSize();
  }

  static TempDir* dir_;
  static std::string tokenizer_;
};
TempDir* SynthTest::dir_ = nullptr;
std::string SynthTest::tokenizer_;

TEST_F(SynthTest, TinyFp16HasTheTinyShapeAndIntendedScales) {
  const SynthOptions o = tiny("fp16");
  synth::write_model(o);
  const ModelSpec spec = load_model_spec(o.out);
  const ModelConfig& c = spec.config;
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.hidden, 256);
  EXPECT_EQ(c.intermediate, 768);
  EXPECT_EQ(c.n_layers, 4);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.max_pos, 2048);
  EXPECT_EQ(c.vocab, tokenizer_pieces());
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c.rope_theta, 10000.0f);
  // The special ids, which the tokenizer reads from config.json.
  const nlohmann::json raw = nlohmann::json::parse(std::ifstream(o.out + "/config.json"));
  EXPECT_EQ(raw.at("bos_token_id"), 1);
  EXPECT_EQ(raw.at("eos_token_id"), 2);
  EXPECT_EQ(c.dtype, DType::F16);
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_FALSE(c.quant.has_value());
  EXPECT_FALSE(fs::exists(o.out + "/quantize_config.json"));
  ASSERT_EQ(spec.layers.size(), 4u);
  EXPECT_NE(spec.lm_head, spec.embed);

  const struct {
    const TensorInfo* t;
    double mean, std;
  } expected[] = {
      {spec.embed, 0.0, 1.0},
      {spec.lm_head, 0.0, 6.0 / 16.0},
      {spec.layers[1].q.weight, 0.0, 1.0 / 16.0},
      {spec.layers[1].k.weight, 0.0, 1.0 / 16.0},
      {spec.layers[2].o.weight, 0.0, 0.5 / 16.0},
      {spec.layers[3].down.weight, 0.0, 0.5 / std::sqrt(768.0)},
      {spec.layers[0].input_norm, 1.0, 0.02},
      {spec.final_norm, 1.0, 0.02},
  };
  for (const auto& e : expected) {
    ASSERT_NE(e.t, nullptr);
    const Stats s = stats(to_float(*e.t));
    EXPECT_TRUE(s.finite) << e.t->name;
    EXPECT_NEAR(s.mean, e.mean, 0.1 * e.std + 1e-3) << e.t->name;
    EXPECT_NEAR(s.std, e.std, 0.1 * e.std) << e.t->name;
  }
}

TEST_F(SynthTest, TrainedTokenizerFollowsLlamaConventions) {
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load(tokenizer_).ok());
  EXPECT_GE(sp.GetPieceSize(), 900);
  EXPECT_LE(sp.GetPieceSize(), 1000);
  EXPECT_EQ(sp.IdToPiece(0), "<unk>");
  EXPECT_EQ(sp.IdToPiece(1), "<s>");
  EXPECT_EQ(sp.IdToPiece(2), "</s>");
  // English text merges into pieces well beyond single characters.
  const std::string text = "Yesterday, the old farmer walked quietly across the village.";
  std::vector<int> ids;
  ASSERT_TRUE(sp.Encode(text, &ids).ok());
  EXPECT_LT(ids.size(), text.size() / 3);
  std::string back;
  ASSERT_TRUE(sp.Decode(ids, &back).ok());
  EXPECT_EQ(back, text);
  // Characters never seen in training fall back to their UTF-8 bytes.
  ASSERT_TRUE(sp.Encode("\xE2\x82\xAC", &ids).ok());  // the euro sign
  int bytes = 0;
  for (int id : ids) bytes += sp.IsByte(id);
  EXPECT_EQ(bytes, 3);
}

// GPTQ orders the columns of linears that read one input by one Hessian, so q, k and v share
// their act-order permutation, as do gate and up; o and down each have their own.
TEST_F(SynthTest, ActOrderPermutationsAreSharedByLinearsOfOneInput) {
  for (const bool per_linear : {false, true}) {
    SCOPED_TRACE(per_linear ? "--g-idx-per-linear" : "default");
    SynthOptions o = tiny(per_linear ? "g_idx_per_linear" : "g_idx_shared");
    o.dtype = "gptq";
    o.act_order = true;
    o.g_idx_per_linear = per_linear;
    o.seed = 5;
    synth::write_model(o);
    const ModelSpec spec = load_model_spec(o.out);
    const LayerSpec& l = spec.layers[0];
    auto g = [](const LinearSpec& s) { return s.g_idx->copy_as<int32_t>(); };
    EXPECT_EQ(g(l.q) == g(l.k), !per_linear);
    EXPECT_EQ(g(l.q) == g(l.v), !per_linear);
    EXPECT_EQ(g(l.gate) == g(l.up), !per_linear);
    EXPECT_NE(g(l.q), g(spec.layers[1].q));  // each layer its own
    EXPECT_NE(g(l.gate), g(l.q));            // same K, another input
  }
}

// bits, format, act-order, asym, group size
using GptqCase = std::tuple<int, std::string, bool, bool, int>;

std::string case_name(const GptqCase& c) {
  const auto& [bits, format, act_order, asym, group] = c;
  return std::to_string(bits) + "bit_" + format + (act_order ? "_actorder" : "") +
         (asym ? "_asym" : "_sym") + "_g" + (group < 0 ? "all" : std::to_string(group));
}

class SynthGptqTest : public SynthTest, public ::testing::WithParamInterface<GptqCase> {};

TEST_P(SynthGptqTest, LoadsAndDequantizesToTheIntendedStd) {
  const auto [bits, format, act_order, asym, group] = GetParam();
  SynthOptions o = tiny(case_name(GetParam()));
  o.dtype = "gptq";
  o.bits = bits;
  o.format = format;
  o.act_order = act_order;
  o.asym = asym;
  o.group_size = group;
  o.seed = 11;
  synth::write_model(o);

  const ModelSpec spec = load_model_spec(o.out);
  EXPECT_TRUE(spec.warnings.empty()) << spec.warnings.front();
  ASSERT_TRUE(spec.config.quant.has_value());
  const QuantConfig& q = *spec.config.quant;
  EXPECT_EQ(q.bits, bits);
  EXPECT_EQ(q.group_size, group);
  EXPECT_EQ(q.desc_act, act_order);
  EXPECT_EQ(q.sym, !asym);
  EXPECT_EQ(q.format, format == "gptq" ? GptqFormat::V1 : GptqFormat::V2);
  EXPECT_TRUE(fs::exists(o.out + "/quantize_config.json"));
  EXPECT_EQ(spec.embed->dtype, DType::F16);
  EXPECT_EQ(spec.lm_head->dtype, DType::F16);

  const int offset = format == "gptq" ? 1 : 0;
  const int maxq = (1 << bits) - 1;
  const LayerSpec& layer = spec.layers[1];
  const struct {
    const LinearSpec& l;
    double std;
  } linears[] = {{layer.q, 1.0 / 16.0}, {layer.down, 0.5 / std::sqrt(768.0)}};
  for (const auto& [l, want_std] : linears) {
    SCOPED_TRACE(l.name);
    ASSERT_TRUE(l.quantized);
    ASSERT_NE(l.g_idx, nullptr);
    const int64_t G = group < 0 ? 1 : (l.K + group - 1) / group;
    EXPECT_EQ(l.scales->shape, (std::vector<int64_t>{G, l.N}));

    const Stats s = stats(dequantize(l));
    EXPECT_TRUE(s.finite);
    EXPECT_NEAR(s.std, want_std, 0.1 * want_std);
    EXPECT_NEAR(s.mean, 0.0, 0.05 * want_std);

    const auto g_idx = l.g_idx->copy_as<int32_t>();
    std::vector<int> members(G, 0);
    bool plain = true;
    for (int64_t k = 0; k < l.K; ++k) {
      ++members[g_idx[k]];
      plain &= g_idx[k] == (group < 0 ? 0 : k / group);
    }
    // act-order permutes columns: every group keeps its size but its members scatter.
    for (int64_t g = 0; g < G; ++g)
      EXPECT_EQ(members[g], group < 0 ? l.K : std::min<int64_t>(group, l.K - g * group));
    EXPECT_EQ(plain, !act_order || group < 0);
    EXPECT_EQ(l.act_order, act_order && group > 0);

    const auto qzeros = l.qzeros->copy_as<uint32_t>();
    const auto stored = gptq::unpack_qzeros(qzeros.data(), G, l.N, bits);
    std::set<int> zeros;
    for (uint8_t z : stored) zeros.insert(z + offset);
    if (!asym) {
      EXPECT_EQ(zeros, std::set<int>{1 << (bits - 1)});
      if (format == "gptq") {  // the words docs/gptq-format.md lists for symmetric v1 files
        const std::vector<uint32_t> want =
            bits == 2 ? std::vector<uint32_t>{0x55555555u}
            : bits == 3 ? std::vector<uint32_t>{0xDB6DB6DBu, 0xB6DB6DB6u, 0x6DB6DB6Du}
            : bits == 4 ? std::vector<uint32_t>{0x77777777u}
                        : std::vector<uint32_t>{0x7F7F7F7Fu};
        EXPECT_EQ(std::vector<uint32_t>(qzeros.begin(), qzeros.begin() + want.size()), want);
      }
    } else {
      EXPECT_GT(zeros.size(), 1u);
      EXPECT_GE(*zeros.begin(), 1);  // a v1 file cannot store a zero of 0
      EXPECT_LE(*zeros.rbegin(), maxq);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFormats, SynthGptqTest,
                         ::testing::Combine(::testing::Values(2, 3, 4, 8),
                                            ::testing::Values("gptq", "gptq_v2"),
                                            ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(32, -1)),
                         [](const auto& info) { return case_name(info.param); });

// Groups that do not divide K: the last group is short, G = ceil(K / group_size).
TEST_F(SynthTest, GroupSizeNotDividingK) {
  SynthOptions o = tiny("g96");
  o.dtype = "gptq";
  o.group_size = 96;
  o.act_order = true;
  synth::write_model(o);
  const ModelSpec spec = load_model_spec(o.out);
  EXPECT_EQ(spec.layers[0].q.scales->shape, (std::vector<int64_t>{3, 256}));     // K = 256
  EXPECT_EQ(spec.layers[0].down.scales->shape, (std::vector<int64_t>{8, 256}));  // K = 768
  const Stats s = stats(dequantize(spec.layers[0].q));
  EXPECT_TRUE(s.finite);
  EXPECT_NEAR(s.std, 1.0 / 16.0, 0.1 / 16.0);
}

TEST_F(SynthTest, SameSeedSameFilesRegardlessOfThreads) {
  SynthOptions a = tiny("det_a");
  a.dtype = "gptq";
  a.bits = 3;
  a.asym = true;
  a.act_order = true;
  a.format = "gptq_v2";
  a.seed = 7;
  a.threads = 1;
  a.tokenizer.clear();  // the trained tokenizer must be reproducible too
  SynthOptions b = a;
  b.out = dir_->sub("det_b");
  b.threads = 5;
  SynthOptions c = a;
  c.out = dir_->sub("det_c");
  c.seed = 8;
  for (const SynthOptions& o : {a, b, c}) synth::write_model(o);

  for (const char* f : {"model.safetensors", "config.json", "quantize_config.json",
                        "generation_config.json", "tokenizer.model", "tokenizer_config.json"})
    EXPECT_EQ(read_bytes(a.out + "/" + f), read_bytes(b.out + "/" + f)) << f;
  EXPECT_EQ(read_bytes(a.out + "/config.json"), read_bytes(c.out + "/config.json"));
  EXPECT_EQ(read_bytes(a.out + "/tokenizer.model"), read_bytes(c.out + "/tokenizer.model"));

  // Every tensor differs with the seed, not just some of the file.
  const ModelFiles fa = ModelFiles::open(a.out), fc = ModelFiles::open(c.out);
  for (const std::string& name : fa.names()) {
    const TensorInfo& ta = fa.get(name);
    const TensorInfo& tc = fc.get(name);
    ASSERT_EQ(ta.nbytes, tc.nbytes) << name;
    if (name.ends_with(".g_idx") || name.ends_with("layernorm.weight") || name == "model.norm.weight")
      continue;  // a short g_idx or a norm near 1 may coincide; the rest must not
    EXPECT_NE(std::string((const char*)ta.data, ta.nbytes),
              std::string((const char*)tc.data, tc.nbytes))
        << name;
  }
}

TEST_F(SynthTest, ExplicitDimensionsOverrideTheShape) {
  SynthOptions o = tiny("custom");
  o.shape = "custom";
  o.hidden = 128;
  o.intermediate = 352;
  o.n_layers = 1;
  o.n_heads = 2;
  o.n_kv_heads = 1;
  o.head_dim = 32;  // q_dim 64 != hidden
  o.max_pos = 512;
  o.dtype = "gptq";
  o.bits = 3;
  synth::write_model(o);
  const ModelSpec spec = load_model_spec(o.out);
  EXPECT_EQ(spec.config.head_dim, 32);
  EXPECT_EQ(spec.config.max_pos, 512);
  EXPECT_EQ(spec.layers[0].q.N, 64);
  EXPECT_EQ(spec.layers[0].q.K, 128);
  EXPECT_EQ(spec.layers[0].o.K, 64);
  EXPECT_EQ(spec.layers[0].k.N, 32);
  EXPECT_EQ(spec.layers[0].down.K, 352);
}

// Every family's tiny model, FP16 and GPTQ: the loader reads it as that family, with the
// family's blocks and tensors (models/io/family.h), and Mistral's tiny window crosses short tests.
TEST_F(SynthTest, EveryFamilyLoadsAsItself) {
  for (const std::string arch : {"llama", "llama3", "mistral", "qwen2", "qwen3", "opt"})
    for (const std::string dtype : {"fp16", "gptq"}) {
      SCOPED_TRACE(arch + " " + dtype);
      SynthOptions o = tiny("arch_" + arch + "_" + dtype);
      o.arch = arch;
      o.dtype = dtype;
      synth::write_model(o);
      const ModelSpec spec = load_model_spec(o.out);
      const ModelConfig& c = spec.config;
      EXPECT_EQ(c.family, arch == "llama3" ? "llama" : arch);
      EXPECT_EQ(c.quant.has_value(), dtype == "gptq");
      const LayerSpec& l = spec.layers[0];
      EXPECT_EQ(l.q.bias != nullptr, arch == "qwen2" || arch == "opt");
      EXPECT_EQ(l.o.bias != nullptr, arch == "opt");
      EXPECT_EQ(l.q_norm != nullptr, arch == "qwen3");
      EXPECT_EQ(l.gate.name.empty(), arch == "opt");
      EXPECT_EQ(spec.positions != nullptr, arch == "opt");
      EXPECT_EQ(l.input_norm_bias != nullptr, arch == "opt");
      EXPECT_EQ(c.rope_llama3.factor > 0, arch == "llama3");
      EXPECT_EQ(c.sliding_window, arch == "mistral" ? 32 : 0);
      EXPECT_EQ(c.tie_embeddings, arch == "opt");
    }
}

// Synth writes every family of the table (models/io/family.h) from the table alone: each
// --arch loads as its family, with the table's blocks, and every family has an --arch.
TEST_F(SynthTest, EveryTableFamilyIsWritten) {
  const std::vector<std::string> archs = synth::arch_names();
  for (const Family& f : all_families())
    EXPECT_NE(std::find(archs.begin(), archs.end(), f.name), archs.end()) << f.name;
  for (const std::string& arch : archs) {
    SCOPED_TRACE(arch);
    SynthOptions o = tiny("table_" + arch);
    o.arch = arch;
    o.n_layers = 1;
    synth::write_model(o);
    const ModelConfig c = load_model_spec(o.out).config;
    const Family& f = family_of(c);
    EXPECT_TRUE(arch == f.name || arch == "llama3") << c.family;
    EXPECT_EQ(c.norm, f.blocks.norm);
    EXPECT_EQ(c.mlp, f.blocks.mlp);
    EXPECT_EQ(c.positions, f.blocks.positions);
    EXPECT_EQ(c.position_offset, f.blocks.position_offset);
    EXPECT_EQ(c.qk_norm, f.blocks.qk_norm);
    // Synth writes no optional bias: the family's own are the only ones.
    EXPECT_EQ(c.qkv_bias, f.blocks.qkv_bias);
    EXPECT_EQ(c.o_bias, f.blocks.o_bias);
    EXPECT_EQ(c.mlp_bias, f.blocks.mlp_bias);
    EXPECT_EQ(c.sliding_window > 0, f.switches.sliding_window);
  }
}

// The real shapes of today's families, as their config.json writes them (written FP16 at a
// single layer and a small vocabulary to stay quick; the shape's other dimensions stay).
TEST_F(SynthTest, RealFamilyShapes) {
  struct Want {
    const char* shape;
    const char* family;
    int hidden, inter, heads, kv_heads, head_dim;
  };
  for (const Want& w : {Want{"llama3-8b", "llama", 4096, 14336, 32, 8, 128},
                        Want{"llama3.2-1b", "llama", 2048, 8192, 32, 8, 64},
                        Want{"qwen2.5-7b", "qwen2", 3584, 18944, 28, 4, 128},
                        Want{"qwen3-8b", "qwen3", 4096, 12288, 32, 8, 128},
                        Want{"opt-6.7b", "opt", 4096, 16384, 32, 32, 128}}) {
    SCOPED_TRACE(w.shape);
    SynthOptions o = tiny(std::string("shape_") + w.shape);
    o.shape = w.shape;
    o.n_layers = 1;
    o.vocab = 1024;
    synth::write_model(o);
    const ModelConfig c = load_model_spec(o.out).config;
    EXPECT_EQ(c.family, w.family);
    EXPECT_EQ(c.hidden, w.hidden);
    EXPECT_EQ(c.intermediate, w.inter);
    EXPECT_EQ(c.n_heads, w.heads);
    EXPECT_EQ(c.n_kv_heads, w.kv_heads);
    EXPECT_EQ(c.head_dim, w.head_dim);
    EXPECT_EQ(c.rope_llama3.factor, std::string(w.shape) == "llama3.2-1b" ? 32.0f
                                    : std::string(w.shape) == "llama3-8b"  ? 8.0f
                                                                           : 0.0f);
  }
}

// A Hugging Face tokenizer is copied as it is (tokenizer.json, or a folder with one) and sizes
// the vocabulary; the model then tokenizes with it.
TEST_F(SynthTest, CopiesAHuggingFaceTokenizer) {
  const std::string fixture = std::string(KESTREL_TOKENIZER_FIXTURES) + "/byte_level";
  for (const std::string& given : {fixture, fixture + "/tokenizer.json"}) {
    SCOPED_TRACE(given);
    SynthOptions o = tiny("hf_tokenizer");
    o.tokenizer = given;
    o.force = true;  // the second replaces the first
    synth::write_model(o);
    EXPECT_TRUE(fs::exists(o.out + "/tokenizer.json"));
    EXPECT_FALSE(fs::exists(o.out + "/tokenizer.model"));
    EXPECT_EQ(read_bytes(o.out + "/tokenizer.json"), read_bytes(fixture + "/tokenizer.json"));
    const std::unique_ptr<Tokenizer> tok = Tokenizer::load(o.out);
    const ModelSpec spec = load_model_spec(o.out);
    EXPECT_EQ(spec.config.vocab, tok->vocab_size());
    EXPECT_FALSE(tok->encode("hello world", false).empty());
  }
  SynthOptions bad = tiny("hf_tokenizer_missing");
  bad.tokenizer = fixture + "/nothing.json";
  EXPECT_THROW(synth::write_model(bad), Error);
}

// A bigger shape keeps its own vocab; ids past the small trained tokenizer are padding.
TEST_F(SynthTest, ShapeVocabStaysWhenLargerThanTheTokenizer) {
  SynthOptions o = tiny("1b_small");
  o.shape = "1b";
  o.hidden = 128;
  o.n_heads = 2;
  o.n_kv_heads = 1;
  o.intermediate = 256;
  o.n_layers = 1;
  o.tie_embeddings = true;
  synth::write_model(o);
  const ModelSpec spec = load_model_spec(o.out);
  EXPECT_EQ(spec.config.vocab, 32000);
  EXPECT_EQ(spec.embed->shape, (std::vector<int64_t>{32000, 128}));
  EXPECT_TRUE(spec.config.tie_embeddings);
  EXPECT_EQ(spec.files.find("lm_head.weight"), nullptr);
  EXPECT_EQ(spec.lm_head, spec.embed);
  // Tied: the embedding doubles as the output head, scaled for logits of std ~6.
  const Stats s = stats(to_float(*spec.embed));
  EXPECT_NEAR(s.std, 6.0 / std::sqrt(128.0), 0.05 * 6.0 / std::sqrt(128.0));
}

TEST_F(SynthTest, BadOptionsThrowBeforeWritingAnything) {
  const auto expect_error = [](SynthOptions o, const std::string& needle) {
    try {
      synth::write_model(o);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(o.out + "/model.safetensors")) << needle;
  };
  SynthOptions o = tiny("bad");
  o.dtype = "gptq";
  o.bits = 5;
  expect_error(o, "bits 5");
  o.bits = 4;
  o.group_size = 0;
  expect_error(o, "group-size 0");
  o.group_size = 128;
  o.format = "gptq_v3";
  expect_error(o, "gptq_v3");
  o.format = "gptq";
  o.bits = 3;
  o.hidden = 80;
  o.n_heads = 1;
  o.n_kv_heads = 1;
  expect_error(o, "multiple of 32");
  o = tiny("bad");
  o.shape = "huge";
  expect_error(o, "huge");
  o = tiny("bad");
  o.dtype = "int8";
  expect_error(o, "int8");
  o = tiny("bad");
  o.vocab = 100;
  expect_error(o, "vocab 100");
  o = tiny("bad");
  o.n_kv_heads = 3;
  expect_error(o, "kv heads 3");
  o = tiny("bad");
  o.tokenizer = dir_->sub("no_such_tokenizer.model");
  expect_error(o, "no_such_tokenizer.model");

  // An output path below a regular file cannot be created.
  const std::string file = dir_->sub("a_file");
  std::ofstream(file) << "x";
  o = tiny("bad");
  o.out = file + "/model";
  expect_error(o, "a_file");
  o.out = file;
  o.force = true;
  expect_error(o, "exists and is not a directory");
  EXPECT_EQ(kestrel::test::staging_leftovers(dir_->path()), std::vector<std::string>{});
}

TEST_F(SynthTest, NonEmptyOutNeedsForce) {
  SynthOptions o = tiny("force/out");
  o.n_layers = 1;
  fs::create_directories(o.out);
  synth::write_model(o);  // an empty directory needs no --force
  std::ofstream(o.out + "/notes.txt") << "mine";
  try {
    synth::write_model(o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), o.out + " is not empty; give --force to replace it");
  }
  EXPECT_TRUE(fs::exists(o.out + "/notes.txt"));
  o.force = true;
  o.n_layers = 2;
  synth::write_model(o);
  EXPECT_FALSE(fs::exists(o.out + "/notes.txt"));
  EXPECT_EQ(load_model_spec(o.out).config.n_layers, 2);
  EXPECT_EQ(kestrel::test::staging_leftovers(dir_->sub("force")), std::vector<std::string>{});
}

// The weights' write fails (each file limited to half of the old model.safetensors, as a full
// disk would stop it): the model already at --out stays byte for byte, and nothing is left.
TEST_F(SynthTest, FailingWriteLeavesTheOldModel) {
  SynthOptions o = tiny("fsize/out");
  o.n_layers = 1;
  synth::write_model(o);
  const auto before = kestrel::test::snapshot(o.out);
  const long limit = (long)fs::file_size(o.out + "/model.safetensors") / 2;
  kestrel::test::Child c({KESTREL_SYNTH_BIN, "--out", o.out, "--force", "--layers", "2",
                          "--tokenizer", tokenizer_, "--quiet"},
                         limit);
  EXPECT_EQ(c.wait(), 1) << c.err;
  EXPECT_EQ(std::count(c.err.begin(), c.err.end(), '\n'), 1) << c.err;
  EXPECT_NE(c.err.find("model.safetensors: write failed: File too large; nothing written to " +
                       o.out),
            std::string::npos)
      << c.err;
  EXPECT_EQ(kestrel::test::snapshot(o.out), before);
  EXPECT_EQ(kestrel::test::staging_leftovers(dir_->sub("fsize")), std::vector<std::string>{});
}

// Ctrl-C (and SIGTERM) while the weights are being written: one line says so, the exit code is
// 128 + the signal, an old model stays as it was, and the temporary directory is gone.
TEST_F(SynthTest, InterruptLeavesNothing) {
  SynthOptions o = tiny("interrupt/out");
  o.n_layers = 1;
  synth::write_model(o);
  const auto before = kestrel::test::snapshot(o.out);
  for (const int sig : {SIGINT, SIGTERM}) {
    SCOPED_TRACE(sig);
    const std::string dest = sig == SIGINT ? o.out : dir_->sub("interrupt/new");
    // About 190M parameters on one thread: seconds of work.
    kestrel::test::Child c({KESTREL_SYNTH_BIN, "--out", dest, "--force", "--hidden", "1024",
                            "--intermediate", "4096", "--layers", "8", "--heads", "8",
                            "--kv-heads", "8", "--vocab", "32000", "--threads", "1",
                            "--tokenizer", tokenizer_, "--quiet"});
    const fs::path weights = kestrel::test::staged_temp(dest, c.pid()) / "model.safetensors";
    ASSERT_TRUE(c.wait_until([&] { return fs::exists(weights); })) << "no weights file appeared";
    c.signal_it(sig);
    EXPECT_EQ(c.wait(), 128 + sig);
    EXPECT_EQ(c.err, "kestrel-synth: interrupted; nothing written to " + dest + "\n");
    EXPECT_EQ(kestrel::test::staging_leftovers(dir_->sub("interrupt")), std::vector<std::string>{});
  }
  EXPECT_EQ(kestrel::test::snapshot(o.out), before);
  EXPECT_FALSE(fs::exists(dir_->sub("interrupt/new")));
}

}  // namespace
}  // namespace kestrel
