#include "tools/quantize/kl_probe.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "base/error.h"

namespace kestrel::quant {

namespace {

// log sum_v exp(z[v]), in double.
double log_sum_exp(const float* z, int64_t n) {
  const float mx = *std::max_element(z, z + n);
  double s = 0;
  for (int64_t v = 0; v < n; ++v) s += std::exp((double)z[v] - mx);
  return mx + std::log(s);
}

}  // namespace

KlProbe::KlProbe(const ModelSpec& spec, const std::vector<std::vector<int>>& windows)
    : model_(spec), n_((int)windows.size()), T_(windows.empty() ? 0 : (int)windows[0].size()) {
  KESTREL_CHECK(n_ > 0 && T_ > 0, "KlProbe: no windows");
  const ModelConfig& cfg = model_.config();
  seq_ = model_.new_cpu_session(T_);
  const size_t win = (size_t)T_ * cfg.hidden, vocab = cfg.vocab;
  X_.resize(win * n_);
  p_.resize((size_t)n_ * T_ * vocab);
  plogp_.assign((size_t)n_ * T_, 0.0);
  psum_.assign((size_t)n_ * T_, 0.0);
  std::vector<float> x(win), logits((size_t)T_ * vocab);
  for (int w = 0; w < n_; ++w) {
    KESTREL_CHECK((int)windows[w].size() == T_, "KlProbe: windows of unequal lengths");
    model_.embed(windows[w].data(), T_, 0, &X_[w * win]);
    std::copy_n(&X_[w * win], win, x.begin());
    for (int l = 0; l < cfg.n_layers; ++l) seq_->layer_forward(l, x.data(), T_, 0);
    model_.head_forward(x.data(), T_, logits.data());
    for (int t = 0; t < T_; ++t) {
      const float* z = &logits[(size_t)t * vocab];
      const double lse = log_sum_exp(z, (int64_t)vocab);
      float* p = &p_[((size_t)w * T_ + t) * vocab];
      double plogp = 0, psum = 0;
      for (size_t v = 0; v < vocab; ++v) {
        const double logp = (double)z[v] - lse;
        p[v] = (float)std::exp(logp);
        plogp += (double)p[v] * logp;
        psum += p[v];
      }
      plogp_[(size_t)w * T_ + t] = plogp;
      psum_[(size_t)w * T_ + t] = psum;
    }
  }
}

double KlProbe::kl(int layer,
                   const std::vector<std::pair<CpuLinear CpuLayer::*, std::vector<float>*>>& replace) {
  KESTREL_CHECK(layer == at_, fmt::format("KlProbe: asked about layer {} while at layer {}",
                                          layer, at_));
  const ModelConfig& cfg = model_.config();
  CpuLayer& L = model_.layer(layer);
  for (const auto& [lin, w] : replace) {
    KESTREL_CHECK(w->size() == (L.*lin).w.size(), "KlProbe: replacement of the wrong shape");
    std::swap((L.*lin).w, *w);
  }
  const size_t win = (size_t)T_ * cfg.hidden, vocab = cfg.vocab;
  std::vector<float> x(win), logits((size_t)T_ * vocab);
  double total = 0;
  try {
    for (int w = 0; w < n_; ++w) {
      std::copy_n(&X_[w * win], win, x.begin());
      for (int l = layer; l < cfg.n_layers; ++l) seq_->layer_forward(l, x.data(), T_, 0);
      model_.head_forward(x.data(), T_, logits.data());
      for (int t = 0; t < T_; ++t) {
        // KL(p || q) = sum p log p - sum p (z - lse(z)), with p as stored (its sum S within
        // float rounding of 1): the same weights in both terms, so rounding does not bias it.
        const float* z = &logits[(size_t)t * vocab];
        const float* p = &p_[((size_t)w * T_ + t) * vocab];
        double pz = 0;
        for (size_t v = 0; v < vocab; ++v) pz += (double)p[v] * z[v];
        const size_t i = (size_t)w * T_ + t;
        total += plogp_[i] - (pz - log_sum_exp(z, (int64_t)vocab) * psum_[i]);
      }
    }
  } catch (...) {
    for (const auto& [lin, w] : replace) std::swap((L.*lin).w, *w);
    throw;
  }
  for (const auto& [lin, w] : replace) std::swap((L.*lin).w, *w);
  return total / ((double)n_ * T_);
}

void KlProbe::advance(int layer) {
  KESTREL_CHECK(layer == at_, fmt::format("KlProbe: advancing past layer {} while at layer {}",
                                          layer, at_));
  const size_t win = (size_t)T_ * model_.config().hidden;
  for (int w = 0; w < n_; ++w) seq_->layer_forward(layer, &X_[w * win], T_, 0);
  ++at_;
}

}  // namespace kestrel::quant
