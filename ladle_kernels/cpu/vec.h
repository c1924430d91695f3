// Shared helpers of the CPU kernels: a 16-float vector type (GCC vector extensions, lowered to whatever
// -march=native offers: AVX-512, AVX2, SSE) and the few operations the kernels need on it.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

namespace ladle_cpu {

// f(std::integral_constant<int64_t, n>) for a run-time n in [1, N]: picks a tile's template rows, ranks or heads.
template <int64_t N, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_count<N - 1>(n, std::forward<F>(f));
  }
  f(std::integral_constant<int64_t, N>{});
}

// One vector of floats from p, any alignment: memcpy compiles to a single unaligned load.
template <typename V>
inline V load_lanes(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// 16 floats: one AVX-512 register, two AVX2 ones. GCC lowers the arithmetic to what -march allows.
typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t ivec16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline vec16 load(const float* p) { return load_lanes<vec16>(p); }

inline void store(float* p, vec16 v) { __builtin_memcpy(p, &v, sizeof(v)); }

inline vec16 splat(float x) { return vec16{} + x; }

// 8 floats: one AVX2 register. Loops that keep a few vectors live across iterations (the decode attention's
// per-token loops) work in these: GCC spills vec16 to the stack on AVX2 machines.
typedef float vec8 __attribute__((vector_size(32)));
typedef int32_t ivec8 __attribute__((vector_size(32)));
constexpr int64_t kLanes8 = 8;

inline vec8 load8(const float* p) { return load_lanes<vec8>(p); }

inline void store8(float* p, vec8 v) { __builtin_memcpy(p, &v, sizeof(v)); }

inline float hsum8(vec8 v) {
  v += __builtin_shuffle(v, ivec8{4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, ivec8{2, 3, 0, 1, 6, 7, 4, 5});
  v += __builtin_shuffle(v, ivec8{1, 0, 3, 2, 5, 4, 7, 6});
  return v[0];
}

// Lane i of the low half plus lane i of the high half, then hsum8: the very additions, in the same order, of a
// 16-lane shuffle tree whose first step swaps the halves. The union (punning GCC documents) keeps the halves in
// registers where a memcpy would go through the stack.
inline float hsum(vec16 v) {
  const union {
    vec16 whole;
    vec8 half[2];
  } halves{v};
  return hsum8(halves.half[0] + halves.half[1]);
}

// sum(x[i]^2) of a row of n floats: 16 lanes of partial sums, their tree (hsum), then the tail in order. The order
// depends on n alone (RMSNorm's statistic, the same bits for a row whatever its batch).
inline float sum_of_squares(const float* x, int64_t n) {
  vec16 acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vec16 v = load(x + i);
    acc += v * v;
  }
  float sum = hsum(acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

// exp(x) lane-wise, Cephes' expf scheme: x = n ln2 + r with |r| <= ln2 / 2, a degree-7 polynomial for e^r and
// 2^n put into the exponent bits. Relative error ~1e-7. Below -87.3 (where float's normal range ends) the
// result is 0; above 88.7 it is clamped to e^88.7 (~3.4e38). `V` is a float vector, `IV` the int32 one of its
// lanes: every lane's bits are the same whatever the width.
// Always inlined: out of line, its vector argument and result go through memory.
template <typename V, typename IV>
__attribute__((always_inline)) inline V exp_of_lanes(V x) {
  const V lo = V{} + -87.3f, hi = V{} + 88.7f;
  const IV underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  V n = x * 1.44269504088896341f + 0.5f;
  // floor(n) for n in (-126, 129): truncate towards zero, then step down where that rounded up.
  V t = __builtin_convertvector(__builtin_convertvector(n, IV), V);
  n = t > n ? t - 1.f : t;
  const V r = x - n * 0.693359375f - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const IV bits = (__builtin_convertvector(n, IV) + 127) << 23;
  V scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  const V result = p * scale;
  return underflow ? V{} : result;
}

__attribute__((always_inline)) inline vec16 exp_lanes(vec16 x) { return exp_of_lanes<vec16, ivec16>(x); }

// exp_lanes over 8 lanes (one AVX2 register: loops that keep vectors live across iterations).
__attribute__((always_inline)) inline vec8 exp_lanes8(vec8 x) { return exp_of_lanes<vec8, ivec8>(x); }

}  // namespace ladle_cpu
