// GPTQ and round-to-nearest quantization of one linear layer y = x W^T, W [N out, K in],
// as the reference implementation (IST-DASLab gptq.py) runs it; the steps are listed in
// docs/gptq-format.md, "The quantizer".
//
// One deliberate difference: scales are rounded to fp16 when they are chosen, before any
// weight is quantized with them. The checkpoint stores fp16 scales, so the codes, the error
// that GPTQ feeds forward and the dequantized weights all use exactly the scales a loader will
// read, and `dequant` below equals what gptq::dequantize_ref computes from the packed tensors.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace kestrel::quant {

struct GptqOptions {
  int bits = 4;              // 2, 3, 4 or 8
  int group_size = 128;      // input columns per scale/zero group; -1 = one group per row
  bool act_order = false;    // quantize columns in decreasing Hessian-diagonal order
  bool sym = true;           // zero point fixed at 2^(bits-1)
  bool static_groups = false;  // group scales fixed from W up front, by original column
  float mse = 0.0f;          // > 0: each range shrunk to the scale of least sum |w - q(w)|^mse
  float damp = 0.01f;        // fraction of the mean Hessian diagonal added to the diagonal
  int block_size = 128;      // columns per lazy batch update
};

// One quantized linear, in W's own column order (act-order's permutation undone).
struct QuantizedLinear {
  int64_t N = 0, K = 0;
  int bits = 4;
  int group_size = 128;         // as configured (-1 = one group)
  std::vector<uint8_t> codes;   // [N, K] in [0, 2^bits)
  std::vector<float> scales;    // [G, N], each exactly representable in fp16
  std::vector<uint8_t> zeros;   // [G, N] full zero points in [0, 2^bits)
  std::vector<int32_t> g_idx;   // [K] group of each input column
  std::vector<float> dequant;   // [N, K] = scales[g_idx[k], n] * (codes[n, k] - zeros[g_idx[k], n])

  int64_t groups() const { return (int64_t)scales.size() / (N > 0 ? N : 1); }
};

// Checks bits, group size, damping and block size; throws kestrel::Error naming the option.
void validate(const GptqOptions& o);

// Scale and zero point of each of `rows` rows of x (row r at x + r * ld, `cols` values), as
// GPTQ's Quantizer.find_params: the range [min(x, 0), max(x, 0)], made symmetric when `sym`,
// (-1, 1) when empty; scale = range / maxq rounded to fp16; zero = 2^(bits-1) when `sym`,
// else rint(-min / scale).
// With mse > 0, as the reference's Quantizer(mse=True, norm=mse, grid=100, maxshrink=0.8): the
// range is shrunk by p = 1, 0.99, ..., 0.21 and the p whose codes give the least
// sum |w - q(w)|^mse kept (the first of equals). Clipping the few largest weights of a group
// buys finer steps for all the others; at 2 and 3 bits that is most of the error.
void find_params(const float* x, int64_t ld, int64_t rows, int64_t cols, int bits, bool sym,
                 float* scale, float* zero, float mse = 0.0f);

// The code of value w: clamp(rint(w / scale) + zero, 0, maxq).
inline float quantize_code(float w, float scale, float zero, float maxq);

// The Hessian of one group of linears, H = (2/n) sum over the n input rows x of x x^T,
// accumulated in fp32 (BLAS ssyrk), rescaled as rows arrive so that it stays an average.
class Hessian {
 public:
  explicit Hessian(int64_t K);
  void add(const float* x, int64_t rows);  // x [rows, K]
  // The full symmetric matrix [K, K].
  std::vector<float> matrix() const;
  int64_t K() const { return K_; }
  int64_t samples() const { return n_; }

 private:
  int64_t K_;
  int64_t n_ = 0;
  std::vector<float> h_;  // [K, K], upper triangle kept
};

// U, the upper Cholesky factor of H^-1 (H^-1 = U^T U), [K, K] row-major with zeros below the
// diagonal: Cholesky of H, inverse from it, Cholesky of the inverse (LAPACK spotrf/spotri).
// Throws kestrel::Error naming `what` when H is not positive definite.
std::vector<float> inverse_cholesky_upper(std::vector<float> H, int64_t K, const char* what);

// GPTQ of W [N, K] with the Hessian H [K, K] of its inputs (undamped; dead inputs allowed).
QuantizedLinear gptq_quantize(const float* W, int64_t N, int64_t K, const float* H,
                              const GptqOptions& o, const char* what);

// Round-to-nearest with the same scales and zeros per group (act-order does not apply).
QuantizedLinear rtn_quantize(const float* W, int64_t N, int64_t K, const GptqOptions& o);

// ||W X - Q X||^2 / ||W X||^2 over the inputs X behind H (H any positive multiple of X^T X):
// tr((W-Q) H (W-Q)^T) / tr(W H W^T). 0 when W X is 0.
double relative_error(const float* W, const float* Q, int64_t N, int64_t K, const float* H);

// tr((W-Q) H (W-Q)^T): with H = (2/n) X^T X, twice the mean over the n inputs of the squared
// error of the linear's outputs. GPTQ minimises it; the mixed-precision plan sums it.
double output_error(const float* W, const float* Q, int64_t N, int64_t K, const float* H);

inline float quantize_code(float w, float scale, float zero, float maxq) {
  const float q = std::rint(w / scale) + zero;  // rint: round half to even, as torch.round
  return q < 0.0f ? 0.0f : (q > maxq ? maxq : q);
}

}  // namespace kestrel::quant
