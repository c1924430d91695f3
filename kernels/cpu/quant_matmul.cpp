// Weight-only quantized linear layers of the CPU path: y = x @ W^T with W stored in 32-element groups, as
// llama.cpp stores GGUF Q4_0 / Q4_1 / Q8_0, and x (float32) quantized on the fly to 8 bits per 32-element group
// so every group's dot product is an exact integer one (llama.cpp's Q8 activations). Contracts are those of
// `q4_linear` / `q8_linear` in kernels/reference.py:
//   x       [M, K] float32, contiguous rows; K % 32 == 0
//   q4: qs  [N, K / 2] uint8: per group 16 bytes, byte j holds element j (low nibble) and j + 16 (high nibble)
//       scales, mins [N, K / 32] float16 (as GGUF stores them): element = scale * q + min, q in 0..15
//       (Q4_0: min = -8 * scale)
//   q8: qs  [N, K] int8; scales [N, K / 32] float16: element = scale * q
//   x's group g of row m: dx = max|x| / 127, xq = round-half-even(x / dx) (dx = 0 and xq = 0 for a zero group)
//   y[m, n] = sum_g scale[n, g] * dx[m, g] * (q . xq) (+ min[n, g] * dx[m, g] * sum(xq))   -> [M, N] float32
// The integer dot products are exact; the float sums run in 8 lanes (AVX2) or one (the portable loop), so
// results match the reference to float32 rounding, not bit for bit.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LADLE_QUANT_AVX2 1
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// A float16 weight scale as float32 (one instruction with F16C).
inline float to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

constexpr int64_t kGroup = 32;
// Rows of x that share one pass over a weight row's unpacked groups.
constexpr int64_t kRowTile = 4;

// Weight rows one pass over x covers: their groups stay in the L1/L2 cache while every row tile of x meets them.
constexpr int64_t kWeightTile = 32;

// x quantized per 32-element group: int8 values [M, K], each group's scale [M, K / 32] and scale * sum(values).
struct QuantizedRows {
  at::Tensor storage_values, storage_scales, storage_sums;
  const int8_t* values;
  const float* scales;
  const float* sums;
  int64_t k;

  const int8_t* row(int64_t m) const { return values + m * k; }
};

QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kGroup;
  at::Tensor value_tensor = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor scale_tensor = at::empty({rows, groups}, x.options());
  at::Tensor sum_tensor = at::empty({rows, groups}, x.options());
  const float* src = x.data_ptr<float>();
  int8_t* values = value_tensor.data_ptr<int8_t>();
  float* scales = scale_tensor.data_ptr<float>();
  float* sums = sum_tensor.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, rows * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t m = index / groups, g = index % groups;
      const float* group = src + m * x_stride + g * kGroup;
      float amax = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(group[i]));
      const float scale = amax / 127.f;
      const float inverse = scale > 0.f ? 1.f / scale : 0.f;
      int8_t* q = values + m * k + g * kGroup;
      int32_t total = 0;
      for (int64_t i = 0; i < kGroup; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(group[i] * inverse));
        total += q[i];
      }
      scales[index] = scale;
      sums[index] = scale * static_cast<float>(total);
    }
  });
  return QuantizedRows{value_tensor, scale_tensor, sum_tensor, values, scales, sums, k};
}

#ifdef LADLE_QUANT_AVX2
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 unsigned x 32 signed bytes -> 8 int32 partial sums, as floats. Products stay within int16 pairs:
// |15 * 127 * 2| and |128 * 127 * 2| are below 32768.
inline __m256 dot_u8_s8(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

inline __m256i unpack_nibbles(const uint8_t* packed) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}
#endif

// Rows [m0, m0 + R) of y for one weight row of a Q4 weight. R is a template argument so that the R
// accumulators live in registers; the unpacked weight group serves all R rows.
template <int64_t R>
void q4_tile(const QuantizedRows& xq, int64_t m0, const uint8_t* qs, const at::Half* scales, const at::Half* mins,
             float* y, int64_t y_stride) {
  const int64_t k = xq.k, groups = k / kGroup;
  const float* x_scales = xq.scales + m0 * groups;
  const float* x_sums = xq.sums + m0 * groups;
  const int8_t* x = xq.row(m0);
  float total[R];
#pragma GCC unroll 4
  for (int64_t r = 0; r < R; ++r) {
    float offset = 0.f;
    for (int64_t g = 0; g < groups; ++g) offset += to_float(mins[g]) * x_sums[r * groups + g];
    total[r] = offset;
  }
#ifdef LADLE_QUANT_AVX2
  __m256 acc[R];
#pragma GCC unroll 4
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i q = unpack_nibbles(qs + g * (kGroup / 2));
#pragma GCC unroll 4
    for (int64_t r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * k + g * kGroup));
      const __m256 scale = _mm256_set1_ps(to_float(scales[g]) * x_scales[r * groups + g]);
      acc[r] = _mm256_fmadd_ps(scale, dot_u8_s8(q, xv), acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int64_t r = 0; r < R; ++r) total[r] += hsum8(acc[r]);
#else
  for (int64_t r = 0; r < R; ++r) {
    const int8_t* xv = x + r * k;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      for (int64_t j = 0; j < kGroup / 2; ++j) {
        const uint8_t byte = qs[g * (kGroup / 2) + j];
        dot += (byte & 0x0F) * xv[g * kGroup + j] + (byte >> 4) * xv[g * kGroup + j + kGroup / 2];
      }
      total[r] += to_float(scales[g]) * x_scales[r * groups + g] * static_cast<float>(dot);
    }
  }
#endif
  for (int64_t r = 0; r < R; ++r) y[r * y_stride] = total[r];
}

// Rows [m0, m0 + R) of y for one weight row of a Q8 weight (see q4_tile).
template <int64_t R>
void q8_tile(const QuantizedRows& xq, int64_t m0, const int8_t* qs, const at::Half* scales, float* y,
             int64_t y_stride) {
  const int64_t k = xq.k, groups = k / kGroup;
  const float* x_scales = xq.scales + m0 * groups;
  const int8_t* x = xq.row(m0);
#ifdef LADLE_QUANT_AVX2
  __m256 acc[R];
#pragma GCC unroll 4
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + g * kGroup));
    const __m256i magnitude = _mm256_sign_epi8(w, w);  // |w| as unsigned bytes; the sign moves onto x
#pragma GCC unroll 4
    for (int64_t r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * k + g * kGroup));
      const __m256 scale = _mm256_set1_ps(to_float(scales[g]) * x_scales[r * groups + g]);
      acc[r] = _mm256_fmadd_ps(scale, dot_u8_s8(magnitude, _mm256_sign_epi8(xv, w)), acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int64_t r = 0; r < R; ++r) y[r * y_stride] = hsum8(acc[r]);
#else
  for (int64_t r = 0; r < R; ++r) {
    const int8_t* xv = x + r * k;
    float total = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      for (int64_t j = 0; j < kGroup; ++j) dot += qs[g * kGroup + j] * xv[g * kGroup + j];
      total += to_float(scales[g]) * x_scales[r * groups + g] * static_cast<float>(dot);
    }
    y[r * y_stride] = total;
  }
#endif
}

// Calls f(std::integral_constant<int64_t, rows>) for rows in 1..kRowTile, so tiles get R at compile time.
template <typename F>
void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int64_t, 1>{}); break;
    case 2: f(std::integral_constant<int64_t, 2>{}); break;
    case 3: f(std::integral_constant<int64_t, 3>{}); break;
    default: f(std::integral_constant<int64_t, kRowTile>{}); break;
  }
}

void check_input(const at::Tensor& x, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be a [M, K] float32 tensor with a contiguous last dim");
  TORCH_CHECK(x.size(1) % kGroup == 0, "K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(scales.dim() == 2 && scales.size(1) == x.size(1) / kGroup && scales.scalar_type() == at::kHalf &&
                  scales.is_contiguous(),
              "scales must be a contiguous [N, K / 32] float16 tensor");
}

// Weight rows per task: enough groups that a thread's share outweighs waking it.
int64_t grain_n(int64_t k, int64_t m) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k * m / 32)); }

// Weight rows split between threads; each thread takes kWeightTile of them at a time past every kRowTile-row
// tile of x, calling tile(std::integral_constant<rows>, m0, n) per weight row n.
template <typename Tile>
void for_each_tile(int64_t m_rows, int64_t n_rows, int64_t k, Tile&& tile) {
  at::parallel_for(0, n_rows, grain_n(k, std::min(m_rows, kRowTile)), [&](int64_t begin, int64_t end) {
    for (int64_t n_tile = begin; n_tile < end; n_tile += kWeightTile) {
      const int64_t n_end = std::min(end, n_tile + kWeightTile);
      for (int64_t m0 = 0; m0 < m_rows; m0 += kRowTile) {
        with_rows(std::min(kRowTile, m_rows - m0), [&](auto tile_rows) {
          for (int64_t n = n_tile; n < n_end; ++n) tile(tile_rows, m0, n);
        });
      }
    }
  });
}

// One Q4 weight row (`groups` groups) as float32: q * scale + min per element, two roundings (no FMA), so the
// values are exactly `Q4Weight.dequantize`'s.
inline void dequantize_q4_row(const uint8_t* qs, const at::Half* scales, const at::Half* mins, int64_t groups,
                              float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* bytes = qs + g * (kGroup / 2);
    const float scale = to_float(scales[g]), min = to_float(mins[g]);
    float* group = out + g * kGroup;
#ifdef LADLE_QUANT_AVX2
    const __m256i values = unpack_nibbles(bytes);  // elements 0..31 of the group, in order
    const __m256 vscale = _mm256_set1_ps(scale), vmin = _mm256_set1_ps(min);
    alignas(32) uint8_t unpacked[kGroup];
    _mm256_store_si256(reinterpret_cast<__m256i*>(unpacked), values);
    for (int64_t c = 0; c < kGroup; c += 8) {
      const __m256i ints = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(unpacked + c)));
      _mm256_storeu_ps(group + c, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(ints), vscale), vmin));
    }
#else
    for (int64_t j = 0; j < kGroup / 2; ++j) {
      group[j] = static_cast<float>(bytes[j] & 0x0F) * scale + min;
      group[j + kGroup / 2] = static_cast<float>(bytes[j] >> 4) * scale + min;
    }
#endif
  }
}

// One Q8 weight row as float32: q * scale per element, exactly `Q8Weight.dequantize`'s values.
inline void dequantize_q8_row(const int8_t* qs, const at::Half* scales, int64_t groups, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = to_float(scales[g]);
#ifdef LADLE_QUANT_AVX2
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t c = 0; c < kGroup; c += 8) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + g * kGroup + c));
      _mm256_storeu_ps(out + g * kGroup + c, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), vscale));
    }
#else
    for (int64_t j = 0; j < kGroup; ++j) out[g * kGroup + j] = static_cast<float>(qs[g * kGroup + j]) * scale;
#endif
  }
}

// From this many rows of x on, a product runs as float32 GEMMs (MKL through at::mm) over weight tiles
// dequantized on the fly: the 8-bit kernels above stream the weight once for every four rows of x and, at the
// same instruction count per multiply-add as float32 FMAs on AVX2, lose to a blocked GEMM once x has tens of
// rows (a prefill chunk, a large decode batch). Measured on a 2-core AMD EPYC: a 128-token prefill of the
// embedded model 711 ms on the 8-bit kernels, <see README> on the GEMM path.
constexpr int64_t kGemmRows = 32;
// Weight rows dequantized at a time: a [kGemmTile, K] float32 tile stays in the L2/L3 cache for its GEMM.
constexpr int64_t kGemmTile = 512;

// Rows [n0, n0 + rows) of a quantized weight as float32 [rows, K]: row(n, out) writes weight row n's K floats,
// element by element exactly as `Q4Weight.dequantize` / `Q8Weight.dequantize` compute them (q * scale, then
// + min: two float32 roundings, no FMA under -ffp-contract=off).
template <typename Row>
at::Tensor dequantize_rows(int64_t n0, int64_t rows, int64_t k, Row&& row) {
  at::Tensor tile = at::empty({rows, k}, at::TensorOptions().dtype(at::kFloat));
  float* out = tile.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(n0 + r, out + r * k);
  });
  return tile;
}

// y = x W^T as float32 GEMMs over dequantized tiles of W (`tile(n0, rows)` returns W[n0 : n0 + rows] in float32).
template <typename Tile>
at::Tensor tiled_gemm(const at::Tensor& x, int64_t n_rows, Tile&& tile) {
  at::Tensor y = at::empty({x.size(0), n_rows}, x.options());
  for (int64_t n0 = 0; n0 < n_rows; n0 += kGemmTile) {
    const int64_t rows = std::min(kGemmTile, n_rows - n0);
    y.narrow(1, n0, rows).copy_(at::mm(x, tile(n0, rows).t()));
  }
  return y;
}

}  // namespace

namespace ladle_cpu {

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins) {
  check_input(x, scales);
  const int64_t m_rows = x.size(0), k = x.size(1), n_rows = scales.size(0);
  TORCH_CHECK(qs.dim() == 2 && qs.size(0) == n_rows && qs.size(1) == k / 2 && qs.scalar_type() == at::kByte &&
                  qs.is_contiguous(),
              "qs must be a contiguous [N, K / 2] uint8 tensor");
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == at::kHalf && mins.is_contiguous(),
              "mins must be a contiguous [N, K / 32] float16 tensor");
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  const at::Half* z = mins.data_ptr<at::Half>();
  const int64_t groups = k / kGroup;
  if (m_rows >= kGemmRows && n_rows > 0) {
    return tiled_gemm(x, n_rows, [&](int64_t n0, int64_t rows) {
      return dequantize_rows(n0, rows, k, [&](int64_t n, float* out) {
        dequantize_q4_row(q + n * (k / 2), s + n * groups, z + n * groups, groups, out);
      });
    });
  }
  at::Tensor y = at::empty({m_rows, n_rows}, x.options());
  if (m_rows == 0 || n_rows == 0) return y;
  const QuantizedRows xq = quantize_rows(x);
  float* out = y.data_ptr<float>();
  for_each_tile(m_rows, n_rows, k, [&](auto tile_rows, int64_t m0, int64_t n) {
    q4_tile<decltype(tile_rows)::value>(xq, m0, q + n * (k / 2), s + n * groups, z + n * groups,
                                        out + m0 * n_rows + n, n_rows);
  });
  return y;
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales) {
  check_input(x, scales);
  const int64_t m_rows = x.size(0), k = x.size(1), n_rows = scales.size(0);
  TORCH_CHECK(qs.dim() == 2 && qs.size(0) == n_rows && qs.size(1) == k && qs.scalar_type() == at::kChar &&
                  qs.is_contiguous(),
              "qs must be a contiguous [N, K] int8 tensor");
  const int8_t* q = qs.data_ptr<int8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  const int64_t groups = k / kGroup;
  if (m_rows >= kGemmRows && n_rows > 0) {
    return tiled_gemm(x, n_rows, [&](int64_t n0, int64_t rows) {
      return dequantize_rows(n0, rows, k, [&](int64_t n, float* out) {
        dequantize_q8_row(q + n * k, s + n * groups, groups, out);
      });
    });
  }
  at::Tensor y = at::empty({m_rows, n_rows}, x.options());
  if (m_rows == 0 || n_rows == 0) return y;
  const QuantizedRows xq = quantize_rows(x);
  float* out = y.data_ptr<float>();
  for_each_tile(m_rows, n_rows, k, [&](auto tile_rows, int64_t m0, int64_t n) {
    q8_tile<decltype(tile_rows)::value>(xq, m0, q + n * k, s + n * groups, out + m0 * n_rows + n, n_rows);
  });
  return y;
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def("q4_linear(Tensor x, Tensor qs, Tensor scales, Tensor mins) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor qs, Tensor scales) -> Tensor");
  m.impl("q4_linear", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::q4_linear));
  m.impl("q8_linear", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::q8_linear));
}
