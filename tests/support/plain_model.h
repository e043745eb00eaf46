// A deliberately plain Llama forward for the CPU engine's end-to-end tests: it shares nothing
// with the engine but the file reader. It parses config.json itself, dequantizes every weight
// to fp32 up front with its own bit arithmetic, and runs the model as loops in double.
// Mistral's sliding window and a rounding of each K and V row as it enters the cache (a KV
// cache type's, written by the test) are the options it has beyond the plain Llama.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/io/safetensors.h"

namespace kestrel::test {

// fp16 -> float by the definition: (-1)^s * 2^(e-15) * (1 + m/1024), subnormals 2^-14 * m/1024.
inline float plain_half(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  const double v = e == 0 ? std::ldexp(m / 1024.0, -14) : std::ldexp(1.0 + m / 1024.0, e - 15);
  return (float)(s ? -v : v);
}

inline uint32_t word_at(const TensorInfo& t, int64_t i) {
  uint32_t w;
  std::memcpy(&w, t.data + 4 * i, 4);
  return w;
}

// Bit `bit` of the little-endian stream formed by words (row r, column col), r = 0, 1, ...
inline int stream_bit(const TensorInfo& t, int64_t cols, int64_t col, int64_t bit) {
  return (word_at(t, (bit / 32) * cols + col) >> (bit % 32)) & 1;
}

struct Plain {
  nlohmann::json cfg;
  int hidden, inter, layers, heads, kv_heads, head_dim, vocab;
  float eps, theta;
  int window = 0;  // Mistral's sliding_window (0: none)
  // Applied to each K / V row [kv_heads * head_dim] as it enters the cache (unset: kept).
  std::function<std::vector<float>(const std::vector<float>&)> round_k, round_v;
  std::map<std::string, std::vector<float>> w;  // every weight as fp32, linears [N, K]

  std::vector<float> floats(const TensorInfo& t) {
    std::vector<float> out(t.numel());
    for (int64_t i = 0; i < t.numel(); ++i) {
      uint16_t h;
      std::memcpy(&h, t.data + 2 * i, 2);
      out[i] = plain_half(h);
    }
    return out;
  }

  std::vector<float> linear(const ModelFiles& f, const std::string& name, int64_t N, int64_t K,
                            const nlohmann::json& q) {
    if (const TensorInfo* dense = f.find(name + ".weight")) return floats(*dense);
    // Each linear's own width from its qweight's shape ([K*bits/32, N]): the linears of a
    // checkpoint with dynamic rules differ, and this reader need not know the rules.
    const TensorInfo& qw = f.get(name + ".qweight");
    const int bits = (int)(qw.shape[0] * 32 / K);
    const int gs = q["group_size"];
    const bool v2 = q.value("checkpoint_format", "gptq") == "gptq_v2";
    const TensorInfo& qz = f.get(name + ".qzeros");
    const std::vector<float> scales = floats(f.get(name + ".scales"));
    const TensorInfo* gi = f.find(name + ".g_idx");
    std::vector<float> W(N * K);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        int32_t g = gs > 0 ? k / gs : 0;
        if (gi) std::memcpy(&g, gi->data + 4 * k, 4);
        int code = 0, zero = 0;
        for (int b = 0; b < bits; ++b) {
          code |= stream_bit(qw, N, n, k * bits + b) << b;
          // qzeros row g is one stream along N: words g*(N*bits/32) + j.
          const int64_t zbit = n * bits + b;
          zero |= ((word_at(qz, g * (N * bits / 32) + zbit / 32) >> (zbit % 32)) & 1) << b;
        }
        zero += v2 ? 0 : 1;
        W[n * K + k] = scales[g * N + n] * (float)(code - zero);
      }
    }
    return W;
  }

  explicit Plain(const std::string& dir) {
    std::ifstream in(dir + "/config.json");
    cfg = nlohmann::json::parse(in);
    hidden = cfg["hidden_size"];
    inter = cfg["intermediate_size"];
    layers = cfg["num_hidden_layers"];
    heads = cfg["num_attention_heads"];
    kv_heads = cfg["num_key_value_heads"];
    head_dim = cfg.contains("head_dim") && cfg["head_dim"].is_number_integer()
                   ? (int)cfg["head_dim"]
                   : hidden / heads;
    if (cfg.contains("sliding_window") && cfg["sliding_window"].is_number_integer())
      window = cfg["sliding_window"];
    vocab = cfg["vocab_size"];
    eps = cfg["rms_norm_eps"];
    theta = cfg.value("rope_theta", 10000.0f);
    const nlohmann::json q = cfg.value("quantization_config", nlohmann::json::object());
    const ModelFiles f = ModelFiles::open(dir);
    w["embed"] = floats(f.get("model.embed_tokens.weight"));
    w["norm"] = floats(f.get("model.norm.weight"));
    w["lm_head"] = floats(f.get("lm_head.weight"));
    const int kvd = kv_heads * head_dim;
    for (int l = 0; l < layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      w[p + "in"] = floats(f.get(p + "input_layernorm.weight"));
      w[p + "post"] = floats(f.get(p + "post_attention_layernorm.weight"));
      w[p + "q"] = linear(f, p + "self_attn.q_proj", heads * head_dim, hidden, q);
      w[p + "k"] = linear(f, p + "self_attn.k_proj", kvd, hidden, q);
      w[p + "v"] = linear(f, p + "self_attn.v_proj", kvd, hidden, q);
      w[p + "o"] = linear(f, p + "self_attn.o_proj", hidden, heads * head_dim, q);
      w[p + "gate"] = linear(f, p + "mlp.gate_proj", inter, hidden, q);
      w[p + "up"] = linear(f, p + "mlp.up_proj", inter, hidden, q);
      w[p + "down"] = linear(f, p + "mlp.down_proj", hidden, inter, q);
    }
  }

  static std::vector<float> matvec(const std::vector<float>& W, const std::vector<float>& x) {
    const size_t K = x.size(), N = W.size() / K;
    std::vector<float> y(N);
    for (size_t n = 0; n < N; ++n) {
      double acc = 0;
      for (size_t k = 0; k < K; ++k) acc += (double)W[n * K + k] * x[k];
      y[n] = (float)acc;
    }
    return y;
  }

  std::vector<float> rmsnorm(const std::vector<float>& x, const std::vector<float>& g) const {
    double ss = 0;
    for (float v : x) ss += (double)v * v;
    const double r = 1.0 / std::sqrt(ss / x.size() + eps);
    std::vector<float> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = (float)(x[i] * r) * g[i];
    return y;
  }

  void rope(std::vector<float>& v, int n_heads, int pos) const {
    for (int h = 0; h < n_heads; ++h) {
      for (int i = 0; i < head_dim / 2; ++i) {
        const double freq = 1.0 / std::pow((double)theta, 2.0 * i / head_dim);
        const double a = pos * freq;
        float& x0 = v[h * head_dim + i];
        float& x1 = v[h * head_dim + i + head_dim / 2];
        const double r0 = x0 * std::cos(a) - x1 * std::sin(a);
        const double r1 = x1 * std::cos(a) + x0 * std::sin(a);
        x0 = (float)r0;
        x1 = (float)r1;
      }
    }
  }

  // Logits after each token of `tokens`, fed one by one from position 0.
  std::vector<std::vector<float>> run(const std::vector<int>& tokens) {
    std::vector<std::vector<std::vector<float>>> kc(layers), vc(layers);
    std::vector<std::vector<float>> out;
    for (size_t pos = 0; pos < tokens.size(); ++pos) {
      std::vector<float> x(w["embed"].begin() + (size_t)tokens[pos] * hidden,
                           w["embed"].begin() + (size_t)(tokens[pos] + 1) * hidden);
      for (int l = 0; l < layers; ++l) {
        const std::string p = "model.layers." + std::to_string(l) + ".";
        std::vector<float> xb = rmsnorm(x, w[p + "in"]);
        std::vector<float> q = matvec(w[p + "q"], xb), k = matvec(w[p + "k"], xb),
                           v = matvec(w[p + "v"], xb);
        rope(q, heads, (int)pos);
        rope(k, kv_heads, (int)pos);
        kc[l].push_back(round_k ? round_k(k) : k);
        vc[l].push_back(round_v ? round_v(v) : v);
        // Keys [first, pos]: Mistral's window, else all.
        const size_t first = window > 0 && (int)pos >= window ? pos - window + 1 : 0;
        std::vector<float> att(heads * head_dim, 0.0f);
        for (int h = 0; h < heads; ++h) {
          const int kvh = h / (heads / kv_heads);
          std::vector<double> s(pos + 1 - first);
          double mx = -1e300;
          for (size_t t = first; t <= pos; ++t) {
            double d = 0;
            for (int i = 0; i < head_dim; ++i)
              d += (double)q[h * head_dim + i] * kc[l][t][kvh * head_dim + i];
            s[t - first] = d / std::sqrt((double)head_dim);
            mx = std::max(mx, s[t - first]);
          }
          double z = 0;
          for (double& e : s) z += e = std::exp(e - mx);
          for (int i = 0; i < head_dim; ++i) {
            double acc = 0;
            for (size_t t = first; t <= pos; ++t) acc += s[t - first] / z * vc[l][t][kvh * head_dim + i];
            att[h * head_dim + i] = (float)acc;
          }
        }
        const std::vector<float> o = matvec(w[p + "o"], att);
        for (int i = 0; i < hidden; ++i) x[i] += o[i];
        xb = rmsnorm(x, w[p + "post"]);
        std::vector<float> g = matvec(w[p + "gate"], xb);
        const std::vector<float> u = matvec(w[p + "up"], xb);
        for (int i = 0; i < inter; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
        const std::vector<float> d = matvec(w[p + "down"], g);
        for (int i = 0; i < hidden; ++i) x[i] += d[i];
      }
      out.push_back(matvec(w["lm_head"], rmsnorm(x, w["norm"])));
    }
    return out;
  }
};

}  // namespace kestrel::test
