// GPTQ of one linear layer, step by step as docs/gptq-format.md lists them (the reference
// implementation's fasterquant), with the dense parts on BLAS/LAPACK.
#include "tools/quantize/gptq.h"

#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include <fmt/format.h>

#include "base/dtype.h"
#include "base/error.h"

namespace kestrel::quant {

void validate(const GptqOptions& o) {
  if (o.bits != 2 && o.bits != 3 && o.bits != 4 && o.bits != 8)
    throw Error(fmt::format("--bits must be 2, 3, 4 or 8, got {}", o.bits));
  if (o.group_size == 0 || o.group_size < -1)
    throw Error(fmt::format("--group-size must be positive or -1, got {}", o.group_size));
  if (!(o.damp >= 0.0f && o.damp < 1.0f))
    throw Error(fmt::format("--damp must be in [0, 1), got {}", o.damp));
  if (!(o.mse >= 0.0f && o.mse <= 16.0f))
    throw Error(fmt::format("--mse must be a norm in [0, 16] (0 = off), got {}", o.mse));
  if (o.block_size <= 0)
    throw Error(fmt::format("block size must be positive, got {}", o.block_size));
}

void find_params(const float* x, int64_t ld, int64_t rows, int64_t cols, int bits, bool sym,
                 float* scale, float* zero, float mse) {
  const float maxq = (float)((1 << bits) - 1);
  // The fp16 scale and the zero of the range [lo, hi].
  auto fit = [&](float lo, float hi, float& s, float& z) {
    s = round_to_half((hi - lo) / maxq);
    // A range below fp16's smallest subnormal would store a zero scale: keep the smallest.
    if (s == 0.0f) s = half_to_float(1);
    z = sym ? (maxq + 1.0f) / 2.0f : std::clamp(std::rint(-lo / s), 0.0f, maxq);
  };
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ld;
    float xmin = 0.0f, xmax = 0.0f;
    for (int64_t c = 0; c < cols; ++c) {
      xmin = std::min(xmin, xr[c]);
      xmax = std::max(xmax, xr[c]);
    }
    if (sym) {
      xmax = std::max(-xmin, xmax);
      xmin = -xmax;
    }
    if (xmin == 0.0f && xmax == 0.0f) {
      xmin = -1.0f;
      xmax = 1.0f;
    }
    if (!std::isfinite(round_to_half((xmax - xmin) / maxq)))
      throw Error(fmt::format("weight range [{}, {}] does not fit an fp16 scale", xmin, xmax));
    fit(xmin, xmax, scale[r], zero[r]);
    if (mse <= 0.0f) continue;
    double best = std::numeric_limits<double>::infinity();
    for (int i = 0; i < 80; ++i) {  // grid 100, maxshrink 0.8
      const float p = 1.0f - (float)i / 100.0f;
      float s, z;
      fit(p * xmin, p * xmax, s, z);
      double err = 0.0;
      for (int64_t c = 0; c < cols; ++c)
        err += std::pow(std::fabs(s * (quantize_code(xr[c], s, z, maxq) - z) - xr[c]), mse);
      if (err < best) {
        best = err;
        scale[r] = s;
        zero[r] = z;
      }
    }
  }
}

Hessian::Hessian(int64_t K) : K_(K), h_((size_t)K * K, 0.0f) {}

void Hessian::add(const float* x, int64_t rows) {
  if (rows <= 0) return;
  // H <- H * n/(n+rows) + (2/(n+rows)) x^T x: the running average of the reference.
  const int64_t total = n_ + rows;
  const float beta = (float)((double)n_ / (double)total);
  const float alpha = (float)(2.0 / (double)total);
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, K_, rows, alpha, x, K_, beta, h_.data(), K_);
  n_ = total;
}

std::vector<float> Hessian::matrix() const {
  std::vector<float> H = h_;
  for (int64_t i = 0; i < K_; ++i)
    for (int64_t j = 0; j < i; ++j) H[i * K_ + j] = H[j * K_ + i];
  return H;
}

std::vector<float> inverse_cholesky_upper(std::vector<float> H, int64_t K, const char* what) {
  auto not_pd = [&](int info) {
    return Error(fmt::format("{}: the damped Hessian is not positive definite (leading minor {} "
                             "of {}); raise --damp",
                             what, info, K));
  };
  // H = L L^T, then H^-1 from L (lower triangle), then H^-1 = U^T U.
  int info = LAPACKE_spotrf(LAPACK_ROW_MAJOR, 'L', K, H.data(), K);
  if (info > 0) throw not_pd(info);
  KESTREL_CHECK(info == 0, fmt::format("{}: spotrf failed with {}", what, info));
  info = LAPACKE_spotri(LAPACK_ROW_MAJOR, 'L', K, H.data(), K);
  if (info > 0) throw not_pd(info);
  KESTREL_CHECK(info == 0, fmt::format("{}: spotri failed with {}", what, info));
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = i + 1; j < K; ++j) H[i * K + j] = H[j * K + i];
  info = LAPACKE_spotrf(LAPACK_ROW_MAJOR, 'U', K, H.data(), K);
  if (info > 0) throw not_pd(info);
  KESTREL_CHECK(info == 0, fmt::format("{}: spotrf failed with {}", what, info));
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < i; ++j) H[i * K + j] = 0.0f;
  return H;
}

namespace {

int64_t group_count(int64_t K, int group_size) {
  return group_size <= 0 ? 1 : (K + group_size - 1) / group_size;
}

}  // namespace

QuantizedLinear gptq_quantize(const float* W_in, int64_t N, int64_t K, const float* H_in,
                              const GptqOptions& o, const char* what) {
  validate(o);
  const float maxq = (float)((1 << o.bits) - 1);
  const int gs = o.group_size;
  const int64_t G = group_count(K, gs);
  std::vector<float> W(W_in, W_in + N * K);  // [N, K], updated in place as columns are done
  std::vector<float> H(H_in, H_in + K * K);  // [K, K]
  std::vector<float> scales((size_t)G * N), zeros((size_t)G * N);  // [G, N]

  // Per-row parameters are read from W as given, before dead inputs are zeroed (as the
  // reference, whose quantizer is fitted on entry).
  if (gs == -1) find_params(W.data(), K, N, K, o.bits, o.sym, scales.data(), zeros.data(), o.mse);

  // Dead inputs: never active in the calibration data, so their weights cannot matter.
  for (int64_t i = 0; i < K; ++i)
    if (H[i * K + i] == 0.0f) {
      H[i * K + i] = 1.0f;
      for (int64_t n = 0; n < N; ++n) W[n * K + i] = 0.0f;
    }

  // Static groups: every group's parameters fixed up front from W by original column.
  if (gs != -1 && o.static_groups)
    for (int64_t g = 0; g < G; ++g)
      find_params(W.data() + g * gs, K, N, std::min<int64_t>(gs, K - g * gs), o.bits, o.sym,
                  scales.data() + g * N, zeros.data() + g * N, o.mse);

  // Act-order: columns with the largest Hessian diagonal first.
  std::vector<int32_t> perm(K);
  std::iota(perm.begin(), perm.end(), 0);
  if (o.act_order) {
    std::stable_sort(perm.begin(), perm.end(),
                     [&](int32_t a, int32_t b) { return H[a * K + a] > H[b * K + b]; });
    std::vector<float> Wp(W.size()), Hp(H.size());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < K; ++j) Wp[n * K + j] = W[n * K + perm[j]];
    for (int64_t a = 0; a < K; ++a)
      for (int64_t b = 0; b < K; ++b) Hp[a * K + b] = H[(int64_t)perm[a] * K + perm[b]];
    W.swap(Wp);
    H.swap(Hp);
  }

  double diag_sum = 0.0;
  for (int64_t i = 0; i < K; ++i) diag_sum += H[i * K + i];
  const float damp = o.damp * (float)(diag_sum / (double)K);
  for (int64_t i = 0; i < K; ++i) H[i * K + i] += damp;
  const std::vector<float> U = inverse_cholesky_upper(std::move(H), K, what);

  // Codes and dequantized values in processing (permuted) column order.
  std::vector<uint8_t> codes_p((size_t)N * K);
  std::vector<float> Q_p((size_t)N * K);
  const int64_t B = o.block_size;
  std::vector<float> W1((size_t)N * B), E1((size_t)N * B);  // [N, cnt] block and its errors
  const float* sc = scales.data();
  const float* zr = zeros.data();
  for (int64_t i1 = 0; i1 < K; i1 += B) {
    const int64_t i2 = std::min(i1 + B, K), cnt = i2 - i1;
    for (int64_t n = 0; n < N; ++n)
      std::copy_n(&W[n * K + i1], cnt, &W1[n * cnt]);
    for (int64_t i = 0; i < cnt; ++i) {
      const int64_t col = i1 + i;
      if (gs != -1) {
        if (o.static_groups) {
          const int64_t g = (o.act_order ? perm[col] : col) / gs;
          sc = scales.data() + g * N;
          zr = zeros.data() + g * N;
        } else if (col % gs == 0) {
          // Fitted on W as it stood when this block began: updates made inside the block are
          // not seen, exactly as in the reference.
          const int64_t g = col / gs;
          find_params(W.data() + col, K, N, std::min<int64_t>(gs, K - col), o.bits, o.sym,
                      scales.data() + g * N, zeros.data() + g * N, o.mse);
          sc = scales.data() + g * N;
          zr = zeros.data() + g * N;
        }
      }
      const float d = U[col * K + col];
      const float* u = &U[col * K + i1];  // row col of U over the block's columns
      for (int64_t n = 0; n < N; ++n) {
        float* wr = &W1[n * cnt];
        const float w = wr[i];
        const float q = quantize_code(w, sc[n], zr[n], maxq);
        const float deq = sc[n] * (q - zr[n]);
        codes_p[n * K + col] = (uint8_t)q;
        Q_p[n * K + col] = deq;
        const float err = (w - deq) / d;
        E1[n * cnt + i] = err;
        for (int64_t j = i + 1; j < cnt; ++j) wr[j] -= err * u[j];
      }
    }
    // The block's errors reach every later column at once: W[:, i2:] -= E1 U[i1:i2, i2:].
    if (i2 < K)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, K - i2, cnt, -1.0f, E1.data(),
                  cnt, &U[i1 * K + i2], K, 1.0f, &W[i2], K);
  }

  QuantizedLinear r;
  r.N = N;
  r.K = K;
  r.bits = o.bits;
  r.group_size = gs;
  r.codes.resize((size_t)N * K);
  r.dequant.resize((size_t)N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < K; ++j) {
      r.codes[n * K + perm[j]] = codes_p[n * K + j];
      r.dequant[n * K + perm[j]] = Q_p[n * K + j];
    }
  r.g_idx.resize(K);
  for (int64_t j = 0; j < K; ++j) {
    const int64_t k = perm[j];
    if (gs == -1)
      r.g_idx[k] = 0;
    else if (o.static_groups || !o.act_order)
      r.g_idx[k] = (int32_t)(k / gs);
    else
      r.g_idx[k] = (int32_t)(j / gs);  // groups formed in processing order
  }
  r.scales = std::move(scales);
  r.zeros.resize(zeros.size());
  for (size_t i = 0; i < zeros.size(); ++i) r.zeros[i] = (uint8_t)zeros[i];
  return r;
}

QuantizedLinear rtn_quantize(const float* W, int64_t N, int64_t K, const GptqOptions& o) {
  validate(o);
  const float maxq = (float)((1 << o.bits) - 1);
  const int gs = o.group_size;
  const int64_t G = group_count(K, gs), width = gs == -1 ? K : gs;
  QuantizedLinear r;
  r.N = N;
  r.K = K;
  r.bits = o.bits;
  r.group_size = gs;
  r.scales.resize((size_t)G * N);
  std::vector<float> zeros((size_t)G * N);
  for (int64_t g = 0; g < G; ++g)
    find_params(W + g * width, K, N, std::min(width, K - g * width), o.bits, o.sym,
                r.scales.data() + g * N, zeros.data() + g * N, o.mse);
  r.codes.resize((size_t)N * K);
  r.dequant.resize((size_t)N * K);
  r.g_idx.resize(K);
  for (int64_t k = 0; k < K; ++k) r.g_idx[k] = (int32_t)(k / width);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = r.g_idx[k];
      const float s = r.scales[g * N + n], z = zeros[g * N + n];
      const float q = quantize_code(W[n * K + k], s, z, maxq);
      r.codes[n * K + k] = (uint8_t)q;
      r.dequant[n * K + k] = s * (q - z);
    }
  r.zeros.resize(zeros.size());
  for (size_t i = 0; i < zeros.size(); ++i) r.zeros[i] = (uint8_t)zeros[i];
  return r;
}

namespace {

// tr(A H A^T) = sum over rows a of a H a^T.
double quadratic(const float* A, int64_t N, int64_t K, const float* H) {
  std::vector<float> AH((size_t)N * K);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, K, K, 1.0f, A, K, H, K, 0.0f,
              AH.data(), K);
  double s = 0.0;
  for (size_t i = 0; i < AH.size(); ++i) s += (double)AH[i] * A[i];
  return s;
}

}  // namespace

double output_error(const float* W, const float* Q, int64_t N, int64_t K, const float* H) {
  std::vector<float> D((size_t)N * K);
  for (size_t i = 0; i < D.size(); ++i) D[i] = W[i] - Q[i];
  return quadratic(D.data(), N, K, H);
}

double relative_error(const float* W, const float* Q, int64_t N, int64_t K, const float* H) {
  const double den = quadratic(W, N, K, H);
  return den > 0.0 ? output_error(W, Q, N, K, H) / den : 0.0;
}

}  // namespace kestrel::quant
