// Helpers for the loader tests: temporary directories, raw files, and a tiny Llama model
// directory whose config and tensors a test edits before writing it out.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/error.h"
#include "models/io/safetensors.h"

namespace kestrel::test {

namespace fs = std::filesystem;
using json = nlohmann::json;

// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = "kestrel_loader_";
    if (info) name += std::string(info->test_suite_name()) + "_" + info->name() + "_";
    name += std::to_string(::getpid()) + "_" + std::to_string(counter++);
    for (char& ch : name)
      if (ch == '/') ch = '_';
    path_ = fs::temp_directory_path() / name;
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

inline void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), (std::streamsize)bytes.size());
  ASSERT_TRUE(out.good()) << path;
}

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

// A raw safetensors file: the 8-byte length, `header` verbatim, then `data_bytes` zero bytes.
inline std::vector<uint8_t> raw_safetensors(const std::string& header, size_t data_bytes,
                                            uint64_t header_len_override = 0) {
  const uint64_t len = header_len_override ? header_len_override : header.size();
  std::vector<uint8_t> b(8 + header.size() + data_bytes, 0);
  for (int i = 0; i < 8; ++i) b[i] = (uint8_t)(len >> (8 * i));
  std::copy(header.begin(), header.end(), b.begin() + 8);
  return b;
}

template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Packs `fields` values of `bits` bits each into little-endian 32-bit words (bit i*bits of
// the stream holds field i), written independently of the loader's own unpacking.
inline std::vector<uint32_t> pack_fields(const std::vector<uint32_t>& fields, int bits) {
  std::vector<uint32_t> words(fields.size() * bits / 32, 0);
  for (size_t i = 0; i < fields.size(); ++i)
    for (int j = 0; j < bits; ++j)
      if (fields[i] >> j & 1u) {
        const size_t bit = i * bits + j;
        words[bit / 32] |= 1u << (bit % 32);
      }
  return words;
}

struct RawTensor {
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// A tiny Llama directory: config.json and model.safetensors (plus quantize_config.json when
// set). Tests edit `config`, `quantize_config` and `tensors`, then call write().
struct TinyModel {
  int hidden = 64, inter = 128, layers = 2, heads = 4, kv_heads = 2, vocab = 96;
  json config;
  json quantize_config;  // null = no quantize_config.json
  std::map<std::string, RawTensor> tensors;

  // gptq_bits = 0: dense F16 linears; otherwise GPTQ with that bit width and group size.
  explicit TinyModel(int gptq_bits = 0, int group_size = 32, bool tie = false) {
    config = {{"architectures", {"LlamaForCausalLM"}},
              {"model_type", "llama"},
              {"hidden_size", hidden},
              {"intermediate_size", inter},
              {"num_hidden_layers", layers},
              {"num_attention_heads", heads},
              {"num_key_value_heads", kv_heads},
              {"rms_norm_eps", 1e-5},
              {"rope_theta", 10000.0},
              {"max_position_embeddings", 256},
              {"vocab_size", vocab},
              {"tie_word_embeddings", tie},
              {"bos_token_id", 1},
              {"eos_token_id", 2},
              {"torch_dtype", "float16"}};
    const int head_dim = hidden / heads;
    add_f16("model.embed_tokens.weight", {vocab, hidden});
    add_f16("model.norm.weight", {hidden});
    if (!tie) add_f16("lm_head.weight", {vocab, hidden});
    for (int i = 0; i < layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      add_f16(p + "input_layernorm.weight", {hidden});
      add_f16(p + "post_attention_layernorm.weight", {hidden});
      const struct {
        const char* name;
        int N, K;
      } linears[] = {{"self_attn.q_proj", heads * head_dim, hidden},
                     {"self_attn.k_proj", kv_heads * head_dim, hidden},
                     {"self_attn.v_proj", kv_heads * head_dim, hidden},
                     {"self_attn.o_proj", hidden, heads * head_dim},
                     {"mlp.gate_proj", inter, hidden},
                     {"mlp.up_proj", inter, hidden},
                     {"mlp.down_proj", hidden, inter}};
      for (const auto& l : linears) {
        if (gptq_bits == 0) {
          add_f16(p + l.name + ".weight", {l.N, l.K});
        } else {
          add_gptq(p + l.name, l.N, l.K, gptq_bits, group_size);
        }
      }
    }
    if (gptq_bits) {
      config["quantization_config"] = {{"quant_method", "gptq"}, {"bits", gptq_bits},
                                       {"group_size", group_size}, {"desc_act", false},
                                       {"sym", true},           {"checkpoint_format", "gptq"}};
    }
  }

  void add_f16(const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<uint16_t> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = float_to_half(0.01f * (float)(i % 97) - 0.4f);
    tensors[name] = {DType::F16, std::move(shape), as_bytes(v)};
  }

  // Symmetric gptq (v1) tensors: stored zeros 2^(bits-1) - 1, g_idx = k / group_size.
  void add_gptq(const std::string& prefix, int64_t N, int64_t K, int bits, int group_size) {
    const int64_t G = group_size == -1 ? 1 : (K + group_size - 1) / group_size;
    std::mt19937 rng(7);
    std::vector<int32_t> qweight(K * bits / 32 * N);
    for (auto& w : qweight) w = (int32_t)rng();
    tensors[prefix + ".qweight"] = {DType::I32, {K * bits / 32, N}, as_bytes(qweight)};
    set_zeros(prefix, N, G, bits, (1u << (bits - 1)) - 1);
    std::vector<uint16_t> scales(G * N, float_to_half(0.01f));
    tensors[prefix + ".scales"] = {DType::F16, {G, N}, as_bytes(scales)};
    std::vector<int32_t> g_idx(K);
    for (int64_t k = 0; k < K; ++k) g_idx[k] = group_size == -1 ? 0 : (int32_t)(k / group_size);
    tensors[prefix + ".g_idx"] = {DType::I32, {K}, as_bytes(g_idx)};
  }

  // Fills every zero field of `prefix`.qzeros ([G, N*bits/32]) with `stored`.
  void set_zeros(const std::string& prefix, int64_t N, int64_t G, int bits, uint32_t stored) {
    std::vector<uint32_t> words;
    for (int64_t g = 0; g < G; ++g) {
      const std::vector<uint32_t> row = pack_fields(std::vector<uint32_t>(N, stored), bits);
      words.insert(words.end(), row.begin(), row.end());
    }
    tensors[prefix + ".qzeros"] = {DType::I32, {G, N * bits / 32}, as_bytes(words)};
  }

  // Writes config.json, quantize_config.json (when set) and `<base>.safetensors`.
  void write(const std::string& dir, const std::string& base = "model") const {
    fs::create_directories(dir);
    write_text(dir + "/config.json", config.dump(2));
    if (!quantize_config.is_null()) write_text(dir + "/quantize_config.json", quantize_config.dump(2));
    SafetensorsWriter w;
    for (const auto& [name, t] : tensors) w.add_data(name, t.dtype, t.shape, t.bytes.data());
    w.write(dir + "/" + base + ".safetensors");
  }
};

// Runs `f`, which must throw kestrel::Error; returns the message ("" and a failure if not).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a kestrel::Error";
  return "";
}

}  // namespace kestrel::test
