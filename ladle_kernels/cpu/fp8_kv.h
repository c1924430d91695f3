// The rows of an FP8 KV cache (`--kv-cache-dtype fp8`, ladle_kernels/reference.py `fp8_kv_rows`): one token's key or
// value of one KV head as Dim e4m3 bytes (the row's largest magnitude scaled to 448), then its float32 scale.
// Packing gives the reference's bytes bit for bit (the divisions correctly rounded, the rounding to e4m3 to nearest
// with ties to even, as torch's cast); unpacking gives its values exactly (float32(e4m3) * scale).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ladle_cpu {

constexpr int64_t kFp8ScaleBytes = 4;
constexpr float kFp8Max = 448.f;
constexpr float kFp8MinScale = 1e-12f;

// The e4m3 byte of v, |v| <= 448 (NaN: e4m3's NaN), rounded to nearest, ties to even.
inline uint8_t float_to_e4m3(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return sign | 0x7F;
  if ((magnitude >> 23) < 121) {  // below 2^-6: a subnormal, a multiple of 2^-9 (8 of them is 2^-6, encoded 0x08)
    return sign | static_cast<uint8_t>(std::nearbyint(std::fabs(v) * 512.f));
  }
  // 3 mantissa bits kept, to nearest with ties to even; a carry moves into the exponent.
  const uint32_t rounded = (magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u)) & ~0xFFFFFu;
  return sign | static_cast<uint8_t>((((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7u));
}

// x[0, dim) as an FP8 row at `row` (dim bytes, then the scale's 4): scale = max(max|x| / 448, 1e-12), each byte
// the e4m3 of x / scale clamped to +-448.
inline void pack_fp8_row(const float* x, int64_t dim, uint8_t* row) {
  float most = 0.f;
  for (int64_t d = 0; d < dim; ++d) most = std::fmax(most, std::fabs(x[d]));
  const float scale = std::fmax(most / kFp8Max, kFp8MinScale);
  for (int64_t d = 0; d < dim; ++d) row[d] = float_to_e4m3(std::fmin(std::fmax(x[d] / scale, -kFp8Max), kFp8Max));
  std::memcpy(row + dim, &scale, sizeof(scale));
}

typedef uint32_t uvec16 __attribute__((vector_size(64)));

// 16 bytes from p, each widened to 32 bits (GCC's own __builtin_convertvector of bytes goes lane by lane).
inline uvec16 widen_bytes(const uint8_t* p) {
  uvec16 out;
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&out, &wide, sizeof(out));
#elif defined(__AVX2__)
  const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i high = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  std::memcpy(&out, &low, sizeof(low));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(low), &high, sizeof(high));
#else
  for (int64_t i = 0; i < kLanes; ++i) out[i] = p[i];
#endif
  return out;
}

// An FP8 row's values, dim a multiple of 16, into out[0, dim): float32(e4m3) * scale, 16 at a time. An e4m3
// byte's exponent and mantissa, moved into a float's fields as they are, read as that float times 2^-120 (a
// subnormal e4m3 as a subnormal float): one exact multiply by 2^120 restores the value, then the scale's.
inline void unpack_fp8_row(const uint8_t* row, int64_t dim, float* out) {
  float scale;
  std::memcpy(&scale, row + dim, sizeof(scale));
  const vec16 factor = splat(scale), restore = splat(0x1p120f);
  for (int64_t d = 0; d < dim; d += kLanes) {
    const uvec16 b = widen_bytes(row + d);
    const uvec16 bits = ((b & 0x7F) << 20) | ((b & 0x80) << 24);
    vec16 shifted;
    std::memcpy(&shifted, &bits, sizeof(shifted));
    store(out + d, shifted * restore * factor);
  }
}

}  // namespace ladle_cpu
