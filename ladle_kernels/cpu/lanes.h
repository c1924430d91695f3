// Lanes: 16 floats with fused multiply-adds that round once on every machine, for kernels whose results must be
// the same bits on any CPU and in any batch (ladle_kernels/cpu/lora.cpp, ladle_kernels/cpu/paged_attention.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "vec.h"

namespace ladle_cpu {

// Lanes: 16 floats and the few operations the kernels take on them, one register on AVX-512, two on AVX2 (GCC's
// vec16 would go through the stack there), else a vec16 with std::fma per lane. Every path rounds each lane's
// multiply-add once and sums the lanes in `hsum`'s order, so all give the same bits.
#if defined(__AVX512F__)
using Lanes = __m512;

inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
inline Lanes lanes_zero() { return _mm512_setzero_ps(); }
inline Lanes lanes_of(float x) { return _mm512_set1_ps(x); }  // folded into the FMA's operand as {1to16}
inline Lanes lanes_load(const float* p) { return _mm512_loadu_ps(p); }
inline Lanes lanes_load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
inline void lanes_store(float* p, Lanes v) { _mm512_storeu_ps(p, v); }
inline void lanes_store_first(float* p, Lanes v, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), v); }
inline Lanes lanes_fma(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }
inline float lanes_sum(Lanes v) { return hsum((vec16)v); }
inline Lanes lanes_mul(Lanes a, Lanes b) { return _mm512_mul_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
struct Lanes {
  __m256 lo, hi;
};

// Lanes i < n all ones, for maskload / maskstore.
inline __m256i first_lanes(int64_t n, int first) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n) - first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Lanes lanes_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes lanes_of(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Lanes lanes_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Lanes lanes_load_first(const float* p, int64_t n) {
  return {_mm256_maskload_ps(p, first_lanes(n, 0)), _mm256_maskload_ps(p + 8, first_lanes(n, 8))};
}
inline void lanes_store(float* p, Lanes v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void lanes_store_first(float* p, Lanes v, int64_t n) {
  _mm256_maskstore_ps(p, first_lanes(n, 0), v.lo);
  _mm256_maskstore_ps(p + 8, first_lanes(n, 8), v.hi);
}
inline Lanes lanes_fma(Lanes a, Lanes b, Lanes c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline float lanes_sum(Lanes v) {  // hsum's order: lane i of the low half plus lane i of the high, then hsum8
  const __m256 halves = _mm256_add_ps(v.lo, v.hi);
  return hsum8((vec8)halves);
}
inline Lanes lanes_mul(Lanes a, Lanes b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
#else
using Lanes = vec16;

inline Lanes lanes_zero() { return Lanes{}; }
inline Lanes lanes_of(float x) { return Lanes{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline Lanes lanes_load(const float* p) { return load(p); }
inline Lanes lanes_load_first(const float* p, int64_t n) {
  Lanes v{};
  __builtin_memcpy(&v, p, n * sizeof(float));
  return v;
}
inline void lanes_store(float* p, Lanes v) { store(p, v); }
inline void lanes_store_first(float* p, Lanes v, int64_t n) { __builtin_memcpy(p, &v, n * sizeof(float)); }
inline Lanes lanes_fma(Lanes a, Lanes b, Lanes c) {
  Lanes r;
  for (int64_t i = 0; i < kLanes; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
}
inline float lanes_sum(Lanes v) { return hsum(v); }
inline Lanes lanes_mul(Lanes a, Lanes b) { return a * b; }
#endif

// The 16 floats of a Lanes as a vec16 and back (for the arithmetic GCC's vector extensions spell well).
inline vec16 lanes_vec(Lanes v) {
  vec16 out;
  lanes_store(reinterpret_cast<float*>(&out), v);
  return out;
}
inline Lanes vec_lanes(vec16 v) { return lanes_load(reinterpret_cast<const float*>(&v)); }

}  // namespace ladle_cpu
