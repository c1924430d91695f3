// The tiles of the CPU's weight-only quantized products, shared by the linear layers (quant_matmul.cpp, whose top
// comment gives the packed layout and the contracts) and the mixture-of-experts op (moe.cpp): x quantized to 8 bits
// per group of 32 (`quantize_rows`), and `block_tile`, which multiplies up to kRowTile such rows by one packed block
// of 8 output features. Every row runs through the same instructions in the same order whatever rows are beside it
// in its tile, so a row's result does not depend on its batch.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LADLE_QUANT_AVX2 1
// AVX-512 VNNI (Ice Lake and later Xeons, Zen 4): `vpdpbusd` adds 4 byte products straight into int32 lanes, one
// instruction where AVX2 takes `vpmaddubsw`, an int16 add and a final `vpmaddwd`. Both sums are exact integers, so the
// two paths give the same bits.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LADLE_QUANT_VNNI 1
#endif
#endif

namespace ladle_quant {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlock = 8;                         // output features per packed block
constexpr int64_t kPlaneBytes = kBlock * kGroup / 2;  // one block's group in one plane
// Rows of x in one tile, each unpacked weight chunk serving them all: 6 ran 5-10% faster than 4 on a Zen 3 (the
// int16 sums and the chunk stay in the 16 AVX2 registers; a few float accumulators spill around a group's end).
// With VNNI (AVX-512VL: 32 registers, no int16 sums) 8 ran 10-15% faster than 6 on a 2-core Xeon, 10 and 12 slower
// (spills).
#ifdef LADLE_QUANT_VNNI
constexpr int64_t kRowTile = 8;
#else
constexpr int64_t kRowTile = 6;
#endif
// Rows of zeros after a QuantizedRows' last row: an AMX tile (amx_tiles.h) reads 16 rows wherever it starts.
constexpr int64_t kTailRows = 16;
// Bytes of quantized x one pass over a thread's weight blocks covers: they stay in its L2 cache meanwhile.
constexpr int64_t kRowChunkBytes = 256 * 1024;

inline float to_float(at::Half h) { return static_cast<float>(h); }

// x quantized per 32-element group: int8 values [M, K] (then kTailRows rows of zeros), each group's scale
// [M, K / 32], scale * sum(values) and sum(values).
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

// int8 storage for `rows` rows of `k` values and the zero rows after them.
inline at::Tensor quantized_values(int64_t rows, int64_t k, const at::Tensor& like) {
  at::Tensor values = at::empty({rows + kTailRows, k}, like.options().dtype(at::kChar));
  std::memset(values.data_ptr<int8_t>() + rows * k, 0, kTailRows * k);
  return values;
}

inline QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kGroup;
  at::Tensor value_tensor = quantized_values(rows, k, x);
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

// Prefetches the cache lines of the `bytes` bytes at p into L2. A single-row product is bound by how fast the
// weight streams in, and a thread's blocks are one contiguous run: the tiles ask for the next block's (the next
// pair's, on AVX-512) group while they multiply this one's, so more of the run is in flight than the hardware
// prefetchers keep on their own (they stop at every 4 KiB page). Measured on a decode step of the Q4_K_M file
// (2-core Zen 5 VM): on AVX-512 the stack 3.02 -> 2.70 ms and the Q8 LM head 1.03 -> 0.76 ms (one pair ahead,
// two, four or eight within noise of each other); built for AVX2 alone, the step 4.35 -> 3.96 ms.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(p) + at, 0, 2);
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
#ifndef LADLE_QUANT_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i sixteen = _mm256_set1_epi16(16);
#endif
  __m256 acc[R];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_bytes(packed + (groups + g) * P * kPlaneBytes, P * kPlaneBytes);  // the next block's group g
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
#ifdef LADLE_QUANT_VNNI
          sums[r] = _mm256_dpbusd_epi32(sums[r], low, _mm256_set1_epi32(x_low));
          sums[r] = _mm256_dpbusd_epi32(sums[r], high, _mm256_set1_epi32(x_high));
#else
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(low, _mm256_set1_epi32(x_low)));
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(high, _mm256_set1_epi32(x_high)));
#endif
        }
      }
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
#ifdef LADLE_QUANT_VNNI  // the sums are int32 dot products already
        if (P == 1) {
          dot[r] = sums[r];
        } else if (p == 0) {
          dot[r] = _mm256_slli_epi32(sums[r], 4);
        } else {
          dot[r] = _mm256_add_epi32(dot[r], sums[r]);
          dot[r] = _mm256_sub_epi32(dot[r], _mm256_set1_epi32(128 * x_totals[r * groups + g]));
        }
#else
        if (P == 1) {
          dot[r] = _mm256_madd_epi16(sums[r], ones);
        } else if (p == 0) {  // the high nibbles of u = q + 128
          dot[r] = _mm256_madd_epi16(sums[r], sixteen);
        } else {  // q . xq = u . xq - 128 * sum(xq), exactly, in int32
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(sums[r], ones));
          dot[r] = _mm256_sub_epi32(dot[r], _mm256_set1_epi32(128 * x_totals[r * groups + g]));
        }
#endif
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

// Below this much work (in 8-feature x 32-element group products) one thread runs it all: waking the others
// costs more than they would save.
constexpr int64_t kMinParallelWork = 2048;

// The grain for splitting `blocks` weight blocks of K = k against m rows: all or nothing, and when split, even
// shares (parallel_for takes max(grain, blocks / threads) per task).
inline int64_t grain_blocks(int64_t blocks, int64_t k, int64_t m) {
  return blocks * (k / kGroup) * m < kMinParallelWork ? blocks : 1;
}

}  // namespace ladle_quant
