// Weight-only quantized linear layers of the CPU path: y = x @ W^T with W stored in 32-element groups, as
// llama.cpp stores GGUF Q4_0 / Q4_1 / Q8_0, and x (float32) quantized on the fly to 8 bits per 32-element group
// so every group's dot product is an exact integer one (llama.cpp's Q8 activations). Contracts are those of
// `q4_linear` / `q8_linear` in kernels/reference.py:
//   x       [M, K] float32, contiguous rows; K % 32 == 0
//   q4: qs  [N, K / 2] uint8: per group 16 bytes, byte j holds element j (low nibble) and j + 16 (high nibble)
//       scales, mins [N, K / 32] float16 (as GGUF stores them): element = scale * q + min, q in 0..15
//       (Q4_0: min = -8 * scale)
//   q8: qs  [N, K] int8; scales [N, K / 32] float16: element = scale * q
//   x's group g of row m: dx = max|x| / 127, xq = round-half-even(x * (1 / dx)) (dx = 0 and xq = 0 for a zero
//   group)
//   y[m, n] = sum_g scale[n, g] * dx[m, g] * (q . xq) + min[n, g] * dx[m, g] * sum(xq)   -> [M, N] float32
//
// The weights are repacked once (`pack_q4` / `pack_q8`, at load) into blocks of 8 output features, so that one
// AVX2 register holds 4 consecutive K elements of 8 features and `vpmaddubsw` against 4 broadcast activation
// bytes yields 8 features' partial dots at once (32 multiply-adds per instruction, against 8 for a float32 FMA;
// measured on a Zen 3 core: 133 G 8-bit multiply-adds/s against 50 G float32 ones). A group's 8 products per
// lane are summed in int16 (|15 * 127 * 2 * 8| < 32768) and scaled into float32 once per group.
//   packed  [N / 8 (rounded up), K / 32, P, 128] uint8: for block b, group g, plane p, 32-byte chunk c (0..3),
//           byte 4 * j + i holds u[8b + j][32g + 4c + i] (low nibble) and u[8b + j][32g + 16 + 4c + i] (high)
//   q4: P = 1, u = q;  q8: P = 2, u = q + 128 split as u >> 4 (plane 0, weight 16) and u & 15 (plane 1), the
//       kernel subtracting 128 * sum(xq) from each group's integer dot (its mins are zero)
//   scales, mins [N / 8, K / 32, 8] float16; features past N are zero
// Every row of x runs through the same instructions in the same order whatever M is and wherever it falls in a
// tile, so a row's result does not depend on its batch (bit for bit); it matches the reference to float32
// rounding (the reference sums in float64).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LADLE_QUANT_AVX2 1
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlock = 8;                         // output features per packed block
constexpr int64_t kPlaneBytes = kBlock * kGroup / 2;  // one block's group in one plane
// Rows of x in one tile, each unpacked weight chunk serving them all: 6 ran 5-10% faster than 4 on a Zen 3 (the
// int16 sums and the chunk stay in the 16 AVX2 registers; a few float accumulators spill around a group's end).
constexpr int64_t kRowTile = 6;
// Bytes of quantized x one pass over a thread's weight blocks covers: they stay in its L2 cache meanwhile.
constexpr int64_t kRowChunkBytes = 256 * 1024;

inline float to_float(at::Half h) { return static_cast<float>(h); }

// x quantized per 32-element group: int8 values [M, K], each group's scale [M, K / 32], scale * sum(values) and
// sum(values).
struct QuantizedRows {
  at::Tensor storage_values, storage_scales, storage_sums, storage_totals;
  const int8_t* values;
  const float* scales;
  const float* sums;
  const int32_t* totals;
  int64_t k;

  const int8_t* row(int64_t m) const { return values + m * k; }
};

// One group of 32 floats -> 32 int8 values, its scale, scale * sum(values) and sum(values).
inline void quantize_group(const float* group, int8_t* q, float* scale_out, float* sum_out, int32_t* total_out) {
#ifdef LADLE_QUANT_AVX2
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(group + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float scale = _mm_cvtss_f32(m) / 127.f;
  const __m256 inverse = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
  __m256i ints[4];
  for (int i = 0; i < 4; ++i) ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // round half even
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
  // packs interleave 128-bit lanes: 4-byte runs come out as 0 2 4 6 1 3 5 7 of the wanted order.
  const __m256i bytes =
      _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const int32_t total_value = _mm_cvtsi128_si32(t);
  *scale_out = scale;
  *sum_out = scale * static_cast<float>(total_value);
  *total_out = total_value;
#else
  float amax = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(group[i]));
  const float scale = amax / 127.f;
  const float inverse = scale > 0.f ? 1.f / scale : 0.f;
  int32_t total = 0;
  for (int64_t i = 0; i < kGroup; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(group[i] * inverse));
    total += q[i];
  }
  *scale_out = scale;
  *sum_out = scale * static_cast<float>(total);
  *total_out = total;
#endif
}

QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kGroup;
  at::Tensor value_tensor = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor scale_tensor = at::empty({rows, groups}, x.options());
  at::Tensor sum_tensor = at::empty({rows, groups}, x.options());
  at::Tensor total_tensor = at::empty({rows, groups}, x.options().dtype(at::kInt));
  const float* src = x.data_ptr<float>();
  int8_t* values = value_tensor.data_ptr<int8_t>();
  float* scales = scale_tensor.data_ptr<float>();
  float* sums = sum_tensor.data_ptr<float>();
  int32_t* totals = total_tensor.data_ptr<int32_t>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, rows * groups, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t m = index / groups, g = index % groups;
      quantize_group(src + m * x_stride + g * kGroup, values + m * k + g * kGroup, scales + index, sums + index,
                     totals + index);
    }
  });
  return QuantizedRows{value_tensor, scale_tensor, sum_tensor, total_tensor, values, scales, sums, totals, k};
}

// Rows [m0, m0 + R) of y for one packed block of P planes: y[m0 + r, 0 .. cols) (cols <= 8), rows y_stride apart.
template <int64_t P, int64_t R>
void block_tile(const QuantizedRows& xq, int64_t m0, const uint8_t* packed, const at::Half* scales,
                const at::Half* mins, float* y, int64_t y_stride, int64_t cols) {
  const int64_t k = xq.k, groups = k / kGroup;
  const float* x_scales = xq.scales + m0 * groups;
  const float* x_sums = xq.sums + m0 * groups;
  const int32_t* x_totals = xq.totals + m0 * groups;
  const int8_t* x = xq.row(m0);
  alignas(32) float out[R][kBlock];
#ifdef LADLE_QUANT_AVX2
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i sixteen = _mm256_set1_epi16(16);
  __m256 acc[R];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* xg = x + g * kGroup;
    __m256i dot[R];
#pragma GCC unroll 2
    for (int64_t p = 0; p < P; ++p) {  // plane by plane, so only R int16 sums are live
      const uint8_t* w = packed + (g * P + p) * kPlaneBytes;
      __m256i sums[R];
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
      // Not unrolled: GCC would hoist every chunk's products ahead of their sums and spill them.
#pragma GCC unroll 1
      for (int64_t c = 0; c < 4; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32));
        const __m256i low = _mm256_and_si256(raw, nibble);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) {
          int32_t x_low, x_high;
          std::memcpy(&x_low, xg + r * k + 4 * c, 4);
          std::memcpy(&x_high, xg + r * k + 16 + 4 * c, 4);
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(low, _mm256_set1_epi32(x_low)));
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(high, _mm256_set1_epi32(x_high)));
        }
      }
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        if (P == 1) {
          dot[r] = _mm256_madd_epi16(sums[r], ones);
        } else if (p == 0) {  // the high nibbles of u = q + 128
          dot[r] = _mm256_madd_epi16(sums[r], sixteen);
        } else {  // q . xq = u . xq - 128 * sum(xq), exactly, in int32
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(sums[r], ones));
          dot[r] = _mm256_sub_epi32(dot[r], _mm256_set1_epi32(128 * x_totals[r * groups + g]));
        }
      }
    }
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + g * kBlock)));
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      const __m256 row_scale = _mm256_mul_ps(scale, _mm256_set1_ps(x_scales[r * groups + g]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), row_scale, acc[r]);
    }
    if constexpr (P == 1) {
      const __m256 min = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g * kBlock)));
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(x_sums[r * groups + g]), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) _mm256_store_ps(out[r], acc[r]);
#else
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < kBlock; ++j) out[r][j] = 0.f;
  }
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = packed + g * P * kPlaneBytes;
    for (int64_t r = 0; r < R; ++r) {
      const int8_t* xg = x + r * k + g * kGroup;
      for (int64_t j = 0; j < kBlock; ++j) {
        int32_t dot = 0;
        for (int64_t p = 0; p < P; ++p) {
          int32_t plane = 0;
          for (int64_t c = 0; c < 4; ++c) {
            for (int64_t i = 0; i < 4; ++i) {
              const uint8_t byte = w[p * kPlaneBytes + c * 32 + 4 * j + i];
              plane += (byte & 0x0F) * xg[4 * c + i] + (byte >> 4) * xg[16 + 4 * c + i];
            }
          }
          dot += (P == 2 && p == 0) ? 16 * plane : plane;
        }
        const float row_scale = to_float(scales[g * kBlock + j]) * x_scales[r * groups + g];
        if (P == 2) dot -= 128 * x_totals[r * groups + g];  // q . xq = u . xq - 128 * sum(xq)
        out[r][j] = std::fma(static_cast<float>(dot), row_scale, out[r][j]);
        if (P == 1) out[r][j] = std::fma(to_float(mins[g * kBlock + j]), x_sums[r * groups + g], out[r][j]);
      }
    }
  }
#endif
  for (int64_t r = 0; r < R; ++r) std::memcpy(y + r * y_stride, out[r], cols * sizeof(float));
}

// Calls f(std::integral_constant<int64_t, min(rows, R)>) (rows >= 1), so tiles get their row count at compile time.
template <int64_t R = kRowTile, typename F>
void with_rows(int64_t rows, F&& f) {
  if constexpr (R == 1) {
    f(std::integral_constant<int64_t, 1>{});
  } else {
    if (rows >= R) return f(std::integral_constant<int64_t, R>{});
    with_rows<R - 1>(rows, std::forward<F>(f));
  }
}

void check_input(const at::Tensor& x, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be a [M, K] float32 tensor with a contiguous last dim");
  LADLE_CHECK(x.size(1) % kGroup == 0, "K must be a multiple of 32, got %lld", static_cast<long long>(x.size(1)));
  TORCH_CHECK(scales.dim() == 2 && scales.size(1) == x.size(1) / kGroup && scales.scalar_type() == at::kHalf &&
                  scales.is_contiguous(),
              "scales must be a contiguous [N, K / 32] float16 tensor");
}

// Packs a weight of `n_rows` rows and `k` columns whose element (n, i) is u(n, i) (0..15 for P = 1, 0..255 for
// P = 2) with per-group scale(n, g) and min(n, g), in the layout described at the top.
template <int64_t P, typename U, typename Scale, typename Min>
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack(int64_t n_rows, int64_t k, U&& u, Scale&& scale, Min&& min) {
  const int64_t blocks = (n_rows + kBlock - 1) / kBlock, groups = k / kGroup;
  at::Tensor packed = at::zeros({blocks, groups, P, kPlaneBytes}, at::TensorOptions().dtype(at::kByte));
  at::Tensor scale_table = at::zeros({blocks, groups, kBlock}, at::TensorOptions().dtype(at::kHalf));
  at::Tensor min_table = at::zeros({blocks, groups, kBlock}, at::TensorOptions().dtype(at::kHalf));
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::Half* scale_out = scale_table.data_ptr<at::Half>();
  at::Half* min_out = min_table.data_ptr<at::Half>();
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t j = 0; j < kBlock && b * kBlock + j < n_rows; ++j) {
          const int64_t n = b * kBlock + j;
          scale_out[(b * groups + g) * kBlock + j] = scale(n, g);
          min_out[(b * groups + g) * kBlock + j] = min(n, g);
          for (int64_t p = 0; p < P; ++p) {
            uint8_t* plane = out + ((b * groups + g) * P + p) * kPlaneBytes;
            for (int64_t c = 0; c < 4; ++c) {
              for (int64_t i = 0; i < 4; ++i) {
                uint32_t low = u(n, g * kGroup + 4 * c + i), high = u(n, g * kGroup + 16 + 4 * c + i);
                if (P == 2) {
                  low = p == 0 ? low >> 4 : low & 0x0F;
                  high = p == 0 ? high >> 4 : high & 0x0F;
                }
                plane[c * 32 + 4 * j + i] = static_cast<uint8_t>(low | (high << 4));
              }
            }
          }
        }
      }
    }
  });
  return {packed, scale_table, min_table};
}

// Below this much work (in 8-feature x 32-element group products) one thread runs it all: waking the others
// costs more than they would save.
constexpr int64_t kMinParallelWork = 2048;

// The grain for splitting `blocks` weight blocks of K = k against m rows: all or nothing, and when split, even
// shares (parallel_for takes max(grain, blocks / threads) per task).
int64_t grain_blocks(int64_t blocks, int64_t k, int64_t m) {
  return blocks * (k / kGroup) * m < kMinParallelWork ? blocks : 1;
}

template <int64_t P>
void run_packed(const QuantizedRows& xq, int64_t m_rows, const uint8_t* packed, const at::Half* scales,
                const at::Half* mins, int64_t blocks, int64_t n_rows, float* y) {
  const int64_t k = xq.k, groups = k / kGroup;
  const int64_t chunk = std::max<int64_t>(kRowTile, kRowChunkBytes / k / kRowTile * kRowTile);
  at::parallel_for(0, blocks, grain_blocks(blocks, k, std::min(m_rows, chunk)), [&](int64_t begin, int64_t end) {
    for (int64_t m_chunk = 0; m_chunk < m_rows; m_chunk += chunk) {
      const int64_t m_end = std::min(m_rows, m_chunk + chunk);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t cols = std::min(kBlock, n_rows - b * kBlock);
        const uint8_t* w = packed + b * groups * P * kPlaneBytes;
        const at::Half* s = scales + b * groups * kBlock;
        const at::Half* z = mins + b * groups * kBlock;
        for (int64_t m0 = m_chunk; m0 < m_end; m0 += kRowTile) {
          with_rows(std::min(kRowTile, m_end - m0), [&](auto tile_rows) {
            block_tile<P, decltype(tile_rows)::value>(xq, m0, w, s, z, y + m0 * n_rows + b * kBlock, n_rows, cols);
          });
        }
      }
    }
  });
}

}  // namespace

namespace ladle_cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q4(const at::Tensor& qs, const at::Tensor& scales,
                                                       const at::Tensor& mins) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "qs must be a contiguous [N, K / 2] uint8 tensor");
  const int64_t n_rows = qs.size(0), k = qs.size(1) * 2;
  LADLE_CHECK(k % kGroup == 0, "K must be a multiple of 32, got %lld", static_cast<long long>(k));
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n_rows && scales.size(1) == k / kGroup &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "scales must be a contiguous [N, K / 32] float16 tensor");
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == at::kHalf && mins.is_contiguous(),
              "mins must be a contiguous [N, K / 32] float16 tensor");
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  const at::Half* z = mins.data_ptr<at::Half>();
  const int64_t groups = k / kGroup;
  return pack<1>(
      n_rows, k,
      [&](int64_t n, int64_t i) -> uint32_t {
        const int64_t g = i / kGroup, j = i % kGroup;
        const uint8_t byte = q[n * (k / 2) + g * (kGroup / 2) + j % (kGroup / 2)];
        return j < kGroup / 2 ? byte & 0x0F : byte >> 4;
      },
      [&](int64_t n, int64_t g) { return s[n * groups + g]; }, [&](int64_t n, int64_t g) { return z[n * groups + g]; });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q8(const at::Tensor& qs, const at::Tensor& scales) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kChar && qs.is_contiguous(),
              "qs must be a contiguous [N, K] int8 tensor");
  const int64_t n_rows = qs.size(0), k = qs.size(1);
  LADLE_CHECK(k % kGroup == 0, "K must be a multiple of 32, got %lld", static_cast<long long>(k));
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n_rows && scales.size(1) == k / kGroup &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "scales must be a contiguous [N, K / 32] float16 tensor");
  const int8_t* q = qs.data_ptr<int8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  const int64_t groups = k / kGroup;
  // u = q + 128; the kernel takes the 128 * sum(xq) back off each group's integer dot (mins stay zero).
  return pack<2>(
      n_rows, k, [&](int64_t n, int64_t i) -> uint32_t { return static_cast<uint32_t>(q[n * k + i] + 128); },
      [&](int64_t n, int64_t g) { return s[n * groups + g]; }, [](int64_t, int64_t) { return at::Half(0.f); });
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t n_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be a [M, K] float32 tensor with a contiguous last dim");
  const int64_t m_rows = x.size(0), k = x.size(1);
  LADLE_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) * kGroup == k && (packed.size(2) == 1 || packed.size(2) == 2) &&
                  packed.size(3) == kPlaneBytes,
              "packed must be a contiguous [N / 8, K / 32, 1 | 2, 128] uint8 tensor (pack_q4 / pack_q8) for K = %lld",
              static_cast<long long>(k));
  const int64_t blocks = packed.size(0);
  LADLE_CHECK(n_rows > (blocks - 1) * kBlock && n_rows <= blocks * kBlock, "n = %lld does not fit %lld blocks of 8",
              static_cast<long long>(n_rows), static_cast<long long>(blocks));
  for (const at::Tensor& table : {scales, mins}) {
    TORCH_CHECK(table.dim() == 3 && table.size(0) == blocks && table.size(1) == packed.size(1) &&
                    table.size(2) == kBlock && table.scalar_type() == at::kHalf && table.is_contiguous(),
                "scales and mins must be contiguous [N / 8, K / 32, 8] float16 tensors");
  }
  at::Tensor y = at::empty({m_rows, n_rows}, x.options());
  if (m_rows == 0 || n_rows == 0) return y;
  const QuantizedRows xq = quantize_rows(x);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  const at::Half* z = mins.data_ptr<at::Half>();
  if (packed.size(2) == 1) {
    run_packed<1>(xq, m_rows, w, s, z, blocks, n_rows, y.data_ptr<float>());
  } else {
    run_packed<2>(xq, m_rows, w, s, z, blocks, n_rows, y.data_ptr<float>());
  }
  return y;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins) {
  check_input(x, scales);
  TORCH_CHECK(qs.dim() == 2 && qs.size(0) == scales.size(0) && qs.size(1) == x.size(1) / 2, "qs must be [N, K / 2]");
  const auto [packed, packed_scales, packed_mins] = pack_q4(qs, scales, mins);
  return packed_linear(x, packed, packed_scales, packed_mins, qs.size(0));
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales) {
  check_input(x, scales);
  TORCH_CHECK(qs.dim() == 2 && qs.size(0) == scales.size(0) && qs.size(1) == x.size(1), "qs must be [N, K]");
  const auto [packed, packed_scales, packed_mins] = pack_q8(qs, scales);
  return packed_linear(x, packed, packed_scales, packed_mins, qs.size(0));
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def("pack_q4(Tensor qs, Tensor scales, Tensor mins) -> (Tensor, Tensor, Tensor)");
  m.def("pack_q8(Tensor qs, Tensor scales) -> (Tensor, Tensor, Tensor)");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, int n) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor qs, Tensor scales, Tensor mins) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor qs, Tensor scales) -> Tensor");
  m.impl("pack_q4", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::pack_q4));
  m.impl("pack_q8", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::pack_q8));
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::packed_linear));
  m.impl("q4_linear", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::q4_linear));
  m.impl("q8_linear", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::q8_linear));
}
