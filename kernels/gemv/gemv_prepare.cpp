// Load-time repack of GPTQ linears into the GEMV kernels' layout (drawn in weight_decode.cuh), on
// the host.
#include <algorithm>
#include <cstring>
#include <exception>
#include <numeric>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "kernels/common/cuda_utils.h"
#include "kernels/gemv/gemv.h"
#include "kernels/gemv/gemv_format.h"
#include "kernels/gemv/gemv_layout.h"

namespace kestrel::cuda {

using namespace gemv_detail;

namespace {

std::string part_name(size_t i) { return "gemv_prepare: part " + std::to_string(i); }

// Group of input k in part v (g_idx, or k / group_size when the file has none).
int64_t group_of(const gptq::GptqView& v, int64_t k) { return v.group_of(k); }

// Runs fn(begin, end) over [0, n) split across hardware threads (the repack of a 7B model is
// ~7 G codes; one thread would add tens of seconds to load time).
template <class Fn>
void parallel_for(int64_t n, Fn fn) {
  const int64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const int64_t workers = std::min<int64_t>(std::min<int64_t>(hw, 32), (n + 63) / 64);
  if (workers <= 1) {
    fn(int64_t(0), n);
    return;
  }
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(workers);
  for (int64_t t = 0; t < workers; ++t) {
    threads.emplace_back([&, t] {
      try {
        fn(n * t / workers, n * (t + 1) / workers);
      } catch (...) {
        errors[t] = std::current_exception();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

size_t align16(size_t n) { return (n + 15) & ~size_t(15); }

// Writes the permuted, zero-padded codes of one row (cp[j], j < chunks*C) into its chunks,
// each plane p of chunk c at uint4 chunk_index(bits, nch, c, p) of the row.
void pack_row(int bits, int64_t nch, const uint8_t* cp, uint32_t* out /* planes*nch*4 words */) {
  const int C = chunk_codes(bits);
  std::memset(out, 0, static_cast<size_t>(chunk_planes(bits)) * nch * 16);
  for (int64_t c = 0; c < nch; ++c) {
    const uint8_t* q = cp + c * C;
    uint32_t* w = out + chunk_index(bits, nch, c, 0) * 4;
    switch (bits) {
      case 4:
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 8; ++i) w[j] |= uint32_t(q[8 * j + i] & 15u) << nibble_pos(i);
        break;
      case 2:
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 16; ++i) w[j] |= uint32_t(q[16 * j + i] & 3u) << crumb_pos(i);
        break;
      case 8:
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) w[j] |= uint32_t(q[4 * j + i]) << (8 * i);
        break;
      case 3:
        // Piece u (codes 32u..32u+31) lives in word u of planes 0, 1, 2 (a, b, c).
        for (int u = 0; u < 4; ++u) {
          const uint8_t* qu = q + 32 * u;
          for (int i = 0; i < 24; ++i) {
            const int plane = i / 8, ii = i % 8;
            out[chunk_index(bits, nch, c, plane) * 4 + u] |= uint32_t(qu[i] & 7u) << nibble_pos(ii);
          }
          for (int i = 0; i < 8; ++i) {
            const int pos = nibble_pos(i) + 3;
            for (int b = 0; b < 3; ++b)
              out[chunk_index(bits, nch, c, b) * 4 + u] |= uint32_t((qu[24 + i] >> b) & 1u) << pos;
          }
        }
        break;
      default:
        break;
    }
  }
}

}  // namespace

size_t GemvWeight::bytes_moved() const {
  const size_t n = static_cast<size_t>(N), g = static_cast<size_t>(groups);
  size_t b = n * planes * chunks * 16 + n * g * 2 + (zeros ? n * g : 0);
  if (has_perm) b += static_cast<size_t>(chunks) * chunk_codes(bits) * 4;
  return b + static_cast<size_t>(K) * 2 + n * 2;
}

namespace gemv_detail {

// The repacked layout's shape (planes, chunks, effective group size, groups) for K inputs at
// `bits` with the checkpoint's group size gs_in (<= 0 or >= K: one group per row).
void set_layout_shape(GemvWeight& w, int bits, int64_t K, int gs_in) {
  const bool per_row = gs_in <= 0 || gs_in >= K;
  w.planes = chunk_planes(bits);
  const int C = chunk_codes(bits);
  const int UC = unit_chunks(bits);
  w.chunks = ((K + C - 1) / C + UC - 1) / UC * UC;  // whole units
  const int64_t Kp = w.chunks * C;
  // Effective group: the largest of 128, 64, 32 that divides the checkpoint's (scales repeat).
  w.group_size = per_row ? 0 : std::gcd(gs_in, 128);
  // Padded to a multiple of 8: every row starts 16-byte aligned, so the (up to 8) scales of one
  // unit always lie in one aligned 16-byte vector, which a kernel fetches with one load.
  w.groups = ((per_row ? 1 : (Kp + w.group_size - 1) / w.group_size) + 7) / 8 * 8;
}

// Device bytes of each array of the layout: codes | scales | zeros | perm, each 16-byte aligned.
struct DeviceSizes {
  size_t codes, scales, zeros, perm;
  size_t total() const { return codes + scales + zeros + perm; }
};
DeviceSizes device_sizes(const GemvWeight& w, bool zeros, bool perm) {
  const size_t cells = static_cast<size_t>(w.N) * w.groups;
  return {static_cast<size_t>(w.N) * w.planes * w.chunks * 16, align16(cells * 2),
          zeros ? align16(cells) : 0,
          perm ? static_cast<size_t>(w.chunks) * chunk_codes(w.bits) * 4 : 0};
}

HostRepack repack(const std::vector<gptq::GptqView>& parts) {
  if (parts.empty()) throw Error("gemv_prepare: no parts given");
  const gptq::GptqView& p0 = parts[0];
  const int bits = p0.bits;
  const int64_t K = p0.K;
  if (bits != 2 && bits != 3 && bits != 4 && bits != 8)
    throw Error(part_name(0) + ": bits=" + std::to_string(bits) + " is not supported (2, 3, 4, 8)");
  if (K <= 0 || (K * bits) % 32 != 0)
    throw Error(part_name(0) + ": K=" + std::to_string(K) +
                " does not fill whole 32-bit words at " + std::to_string(bits) + " bits");
  if (K > (int64_t(1) << 30)) throw Error(part_name(0) + ": K=" + std::to_string(K) + " too large");
  if (p0.zero_offset != 0 && p0.zero_offset != 1)
    throw Error(part_name(0) + ": zero_offset must be 0 or 1, got " +
                std::to_string(p0.zero_offset));

  int64_t N = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const gptq::GptqView& v = parts[i];
    if (v.K != K)
      throw Error(part_name(i) + ": K=" + std::to_string(v.K) +
                  " differs from part 0's K=" + std::to_string(K));
    if (v.bits != bits)
      throw Error(part_name(i) + ": bits=" + std::to_string(v.bits) +
                  " differs from part 0's bits=" + std::to_string(bits));
    if (v.group_size != p0.group_size)
      throw Error(part_name(i) + ": group_size=" + std::to_string(v.group_size) +
                  " differs from part 0's group_size=" + std::to_string(p0.group_size));
    if (v.zero_offset != p0.zero_offset)
      throw Error(part_name(i) + ": zero_offset=" + std::to_string(v.zero_offset) +
                  " differs from part 0's zero_offset=" + std::to_string(p0.zero_offset));
    if (v.N <= 0) throw Error(part_name(i) + ": N=" + std::to_string(v.N) + " must be positive");
    if (!v.qweight || !v.qzeros || !v.scales)
      throw Error(part_name(i) + ": qweight, qzeros and scales are required");
    N += v.N;
  }
  if (N > (int64_t(1) << 30)) throw Error("gemv_prepare: N=" + std::to_string(N) + " too large");

  // Groups as the checkpoint has them, and g_idx agreement (a missing g_idx means k / group_size).
  const int gs_in = p0.group_size;
  const bool per_row = gs_in <= 0 || gs_in >= K;
  if (!per_row && gs_in % 32 != 0)
    throw Error(part_name(0) + ": group_size=" + std::to_string(gs_in) +
                " is not a multiple of 32 (supported: multiples of 32, -1)");
  const int64_t G_in = p0.groups();
  std::vector<int32_t> gidx(K);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t g = group_of(p0, k);
    if (g < 0 || g >= G_in)
      throw Error(part_name(0) + ": g_idx[" + std::to_string(k) + "]=" + std::to_string(g) +
                  " is outside [0, " + std::to_string(G_in) + ")");
    gidx[k] = static_cast<int32_t>(g);
  }
  for (size_t i = 1; i < parts.size(); ++i)
    for (int64_t k = 0; k < K; ++k)
      if (group_of(parts[i], k) != gidx[k])
        throw Error(part_name(i) + ": g_idx[" + std::to_string(k) +
                    "]=" + std::to_string(group_of(parts[i], k)) + " differs from part 0's " +
                    std::to_string(gidx[k]) + " (fused parts must share g_idx)");

  // act-order: order K by group (stable), and require the groups to come out as consecutive runs
  // of group_size columns, which is what GPTQ writes (g_idx[perm[j]] = j / group_size).
  std::vector<int32_t> perm(K);
  std::iota(perm.begin(), perm.end(), 0);
  std::stable_sort(perm.begin(), perm.end(),
                   [&](int32_t a, int32_t b) { return gidx[a] < gidx[b]; });
  if (!per_row)
    for (int64_t j = 0; j < K; ++j)
      if (gidx[perm[j]] != j / gs_in)
        throw Error(part_name(0) + ": g_idx does not split K into groups of " +
                    std::to_string(gs_in) + " columns (group " + std::to_string(gidx[perm[j]]) +
                    " at sorted position " + std::to_string(j) + ")");
  bool identity = true;
  for (int64_t j = 0; j < K && identity; ++j) identity = perm[j] == j;

  GemvWeight w;
  w.bits = bits;
  w.N = N;
  w.K = K;
  w.has_perm = !identity;
  set_layout_shape(w, bits, K, gs_in);
  const int C = chunk_codes(bits);
  const int64_t Kp = w.chunks * C;
  w.zero_offset = p0.zero_offset;
  const int64_t Ge = w.groups;

  // Scales and zero points at the effective group size. Padding groups (past K) get scale 0.
  std::vector<uint16_t> scales(static_cast<size_t>(N * Ge), 0);
  std::vector<uint8_t> zeros(static_cast<size_t>(N * Ge), 0);
  std::vector<int64_t> part_of_row(N), row_in_part(N);
  {
    int64_t n0 = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      for (int64_t n = 0; n < parts[i].N; ++n) {
        part_of_row[n0 + n] = static_cast<int64_t>(i);
        row_in_part[n0 + n] = n;
      }
      n0 += parts[i].N;
    }
  }
  for (int64_t n = 0; n < N; ++n) {
    const gptq::GptqView& v = parts[part_of_row[n]];
    const int64_t ni = row_in_part[n];
    const int64_t zwords = (v.N * bits + 31) / 32;
    for (int64_t e = 0; e < Ge; ++e) {
      // First permuted k of the group; padding groups lie past K.
      const int64_t j = per_row ? (e == 0 ? 0 : K) : e * w.group_size;
      if (j >= K) continue;
      const int64_t g = per_row ? 0 : j / gs_in;
      scales[n * Ge + e] = v.scales[g * v.N + ni];
      zeros[n * Ge + e] = static_cast<uint8_t>(gptq::read_code(v.qzeros + g * zwords, 1, ni, bits));
    }
  }
  // When every zero point is equal (symmetric quantization) the kernel takes it as a constant.
  // (The effective groups inside K cover each checkpoint group inside K, so this is the same
  // test on the checkpoint's zero points, which the loader runs before placing the weight.)
  const bool uniform = gemv_zero_points_uniform(parts);
  w.zero_const = zeros[0] + w.zero_offset;

  // Codes: unpack 32 codes at a time per column (b words of the packed stream), permute, pack.
  const int64_t row_words = int64_t(w.planes) * w.chunks * 4;
  std::vector<uint32_t> packed(static_cast<size_t>(N * row_words));
  parallel_for(N, [&](int64_t n_begin, int64_t n_end) {
    std::vector<uint8_t> natural(K), permuted(Kp, 0);
    for (int64_t n = n_begin; n < n_end; ++n) {
      const gptq::GptqView& v = parts[part_of_row[n]];
      const int64_t ni = row_in_part[n];
      for (int64_t t = 0; t < K / 32; ++t) {
        uint32_t words[8];
        for (int i = 0; i < bits; ++i) words[i] = v.qweight[(t * bits + i) * v.N + ni];
        for (int i = 0; i < 32; ++i) natural[t * 32 + i] = gptq::read_code(words, 1, i, bits);
      }
      for (int64_t k = (K / 32) * 32; k < K; ++k)  // 8-bit K % 32 != 0 tail
        natural[k] = gptq::read_code(v.qweight + ni, v.N, k, bits);
      for (int64_t j = 0; j < K; ++j) permuted[j] = natural[perm[j]];
      pack_row(bits, w.chunks, permuted.data(), packed.data() + n * row_words);
    }
  });

  HostRepack h;
  h.meta = w;
  h.codes = std::move(packed);
  h.scales = std::move(scales);
  if (!uniform) h.zeros = std::move(zeros);
  if (w.has_perm) {
    h.perm.assign(static_cast<size_t>(Kp), 0);
    std::copy(perm.begin(), perm.end(), h.perm.begin());
  }
  return h;
}

}  // namespace gemv_detail

bool gemv_zero_points_uniform(const std::vector<gptq::GptqView>& parts) {
  if (parts.empty()) return false;
  const int bits = parts[0].bits;
  if (bits != 2 && bits != 3 && bits != 4 && bits != 8) return false;
  const int64_t groups = parts[0].groups();  // 1 per row (group_size <= 0 or >= K)
  bool seen = false;
  uint32_t first = 0;
  for (const gptq::GptqView& v : parts) {
    if (!v.qzeros || v.bits != bits || v.N <= 0 || v.groups() != groups) return false;
    const int64_t zwords = (v.N * bits + 31) / 32;
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t n = 0; n < v.N; ++n) {
        const uint32_t z = gptq::read_code(v.qzeros + g * zwords, 1, n, bits);
        if (!seen) {
          first = z;
          seen = true;
        } else if (z != first) {
          return false;
        }
      }
  }
  return true;
}

std::string gemv_format_problem(int bits, int group_size, int64_t K) {
  // The format checks of repack(), which come with the parts' names of the call instead.
  if (bits != 2 && bits != 3 && bits != 4 && bits != 8)
    return std::to_string(bits) + "-bit weights (the kernels take 2, 3, 4 or 8 bits)";
  if (K <= 0 || (K * bits) % 32 != 0)
    return "K=" + std::to_string(K) + ", which does not fill whole 32-bit words at " +
           std::to_string(bits) + " bits";
  const bool per_row = group_size <= 0 || group_size >= K;
  if (!per_row && group_size % 32 != 0)
    return "groups of " + std::to_string(group_size) +
           " columns (the kernels take multiples of 32, or one group per row)";
  return "";
}

size_t gemv_device_bytes_bound(int bits, int group_size, int64_t N, int64_t K, bool act_order,
                               bool zero_points) {
  // A format gemv_prepare refuses: nothing to place.
  if (chunk_codes(bits) == 0 || bits == 16 || N <= 0 || K <= 0) return 0;
  GemvWeight w;
  w.bits = bits;
  w.N = N;
  w.K = K;
  set_layout_shape(w, bits, K, group_size);
  return device_sizes(w, zero_points, /*perm=*/act_order).total();
}

GemvWeight gemv_prepare(const std::vector<gptq::GptqView>& parts, cudaStream_t s) {
  return gemv_prepare(parts, s, nullptr, 0);
}

GemvWeight gemv_prepare(const std::vector<gptq::GptqView>& parts, cudaStream_t s, void* dst,
                        size_t capacity) {
  HostRepack h = repack(parts);
  GemvWeight w = h.meta;
  // One block of device memory: codes | scales | zeros | perm.
  const DeviceSizes sz = device_sizes(w, !h.zeros.empty(), !h.perm.empty());
  w.device_bytes = sz.total();
  DeviceBuffer buf;
  char* base = static_cast<char*>(dst);
  if (dst) {
    if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || capacity < w.device_bytes)
      throw Error("gemv_prepare: the given device memory (" + std::to_string(capacity) +
                  " bytes) is unaligned or smaller than the weight's " +
                  std::to_string(w.device_bytes));
  } else {
    buf = DeviceBuffer(w.device_bytes);
    base = buf.as<char>();
  }
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(base, h.codes.data(), sz.codes, cudaMemcpyHostToDevice, s));
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(base + sz.codes, h.scales.data(), h.scales.size() * 2,
                                     cudaMemcpyHostToDevice, s));
  w.codes = reinterpret_cast<const uint4*>(base);
  w.scales = reinterpret_cast<const __half*>(base + sz.codes);
  if (!h.zeros.empty()) {
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(base + sz.codes + sz.scales, h.zeros.data(), h.zeros.size(),
                                       cudaMemcpyHostToDevice, s));
    w.zeros = reinterpret_cast<const uint8_t*>(base + sz.codes + sz.scales);
  }
  if (!h.perm.empty()) {
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(base + sz.codes + sz.scales + sz.zeros, h.perm.data(),
                                       sz.perm, cudaMemcpyHostToDevice, s));
    w.perm = reinterpret_cast<const int32_t*>(base + sz.codes + sz.scales + sz.zeros);
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));  // the host buffers die with this scope

  w.smem_bytes = smem_bytes(w.bits, w.chunks, w.has_perm);
  w.launch = plan_quant_launch(w.bits, w.group_size, GemvLaunch{});
  w.owns_device = dst == nullptr;
  w.device = dst ? dst : buf.release();
  return w;
}

void gemv_free(GemvWeight& w) {
  if (w.device && w.owns_device) cudaFree(w.device);
  w = GemvWeight{};
}

GemvWeight gemv_clone(const GemvWeight& w, cudaStream_t s) {
  if (!w.device) throw Error("gemv_clone: the weight is empty");
  DeviceBuffer buf(w.device_bytes);
  KESTREL_CUDA_CHECK(
      cudaMemcpyAsync(buf.get(), w.device, w.device_bytes, cudaMemcpyDeviceToDevice, s));
  GemvWeight c = w;
  c.owns_device = true;
  const char* old_base = static_cast<const char*>(w.device);
  char* nb = buf.as<char>();
  auto rebase = [&](const auto* p) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(p)>>;
    return p ? reinterpret_cast<const T*>(nb + (reinterpret_cast<const char*>(p) - old_base))
             : nullptr;
  };
  c.codes = rebase(w.codes);
  c.scales = rebase(w.scales);
  c.zeros = rebase(w.zeros);
  c.perm = rebase(w.perm);
  c.device = buf.release();
  return c;
}

std::vector<int32_t> gemv_input_index(const GemvWeight& w, cudaStream_t s) {
  if (!w.device) throw Error("gemv_input_index: the weight is empty");
  std::vector<int32_t> idx(static_cast<size_t>(w.K));
  if (!w.perm) {
    std::iota(idx.begin(), idx.end(), 0);
    return idx;
  }
  std::vector<int32_t> perm(static_cast<size_t>(w.K));
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(perm.data(), w.perm, perm.size() * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, s));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  for (size_t k = 0; k < perm.size(); ++k)
    idx[static_cast<size_t>(perm[k])] = static_cast<int32_t>(k);
  return idx;
}

GemvWeight gemv_input_permuted(const GemvWeight& w) {
  if (!w.device) throw Error("gemv_input_permuted: the weight is empty");
  GemvWeight v = w;
  v.owns_device = false;
  v.has_perm = false;
  v.perm = nullptr;
  v.smem_bytes = smem_bytes(v.bits, v.chunks, /*has_perm=*/false);
  return v;
}

}  // namespace kestrel::cuda
