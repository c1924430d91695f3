// The tiles of the CPU's 5- and 6-bit GGUF products, of llama.cpp's K-quants (Q5_0, Q5_1, Q2_K .. Q6_K), of its
// non-linear types (IQ4_NL, IQ4_XS; IQ3_XXS .. IQ1_M) and of MXFP4 (gpt-oss's experts), kept as the file stores
// them or, for the IQ3 / IQ2 / IQ1 grids, as each element's code in a 16-entry codebook: the same
// layout of 8 output features per packed block as the 4-bit kernels (quant_tiles.h), x quantized to 8 bits per group
// of 32 the same way (`quantize_rows`), and per group of 32 a nibble plane (as q4's) with, for 5 and 6 bits, a plane
// of the values' high bits after it.
// Contracts: ladle_kernels/reference.py `lowbit_linear`.
//
// Per packed block b and group g of 32, `kLowBitPlane` + 32 * H bytes (H = high bits a value, 0..2):
//   bytes 0..127: the nibble plane: chunk c (0..3), byte 4 * j + i: u[8b + j][32g + 4c + i] & 15 (low nibble) and
//                 u[8b + j][32g + 16 + 4c + i] & 15 (high nibble);
//   H = 1: 32 bytes, byte 4 * j + i: bit 2c the high bit (u >> 4) of element 4c + i, bit 2c + 1 of 16 + 4c + i;
//   H = 2: 64 bytes, chunk c in the 32 bytes at 32 * (c / 2), byte 4 * j + i: bits 4 (c % 2) .. +1 the high
//          bits (u >> 4) of element 4c + i, bits 4 (c % 2) + 2 .. +3 those of 16 + 4c + i.
// Q2_K's 2-bit values (kSuper2) take no nibble plane: their group is `kTwoBitPlane` bytes laid out as the H = 2
// plane, holding u itself (0..3) where that plane holds u >> 4.
// How u becomes a weight, by the scales' kind:
//   kTable (Q5_0, Q5_1): scales, mins [N / 8, K / 32, 8] float16: element = scale * u + min (Q5_0: no mins table,
//           min = -16 * scale, exact in float32, the value a float16 table of them would hold);
//   kSuper (Q4_K, Q5_K): `scales` [N / 8, K / 256, 16] float16 (8 features' d, then their dmin) and `mins`
//           [N / 8, K / 32, 16] uint8 (8 features' 6-bit sc, then their m): element = (d * sc) * u - dmin * m;
//   kSuper6 (Q6_K, H = 2; Q3_K, H = 0): `scales` as kSuper (dmin zero) and `mins` [N / 8, K / 32, 16] int8 (the
//           scales of the group's two 16-element halves: 8 features' first, then their second): element =
//           (d * sc) * (u - o), o = kSuper6Offset<H> (Q6_K's 32, Q3_K's 4; Q3_K's sc is its 6-bit scale less 32);
//   kSuper2 (Q2_K, the 2-bit plane): `scales` as kSuper and `mins` [N / 8, K / 32, 16] uint8 (the bytes of the
//           group's two 16-element halves as Q2_K stores them, sc | m << 4, 8 features' first half, then their
//           second): element = (d * sc) * u - dmin * m, per half;
//   kE8M0 (MXFP4, H = 0): `scales` [N / 8, K / 32, 8] uint8, each group's E8M0 exponent e (no mins table), and
//           the nibbles e2m1 codes: u = kE2M1Offset[code] (twice the code's value, plus 12: 0..24, looked up in
//           registers), element = 2^(e - 128) * (u - 12), so scale 2^(e - 128) and min -12 * scale, both exact;
//   kCodebook (IQ4_NL, H = 0): `scales` [N / 8, K / 32, 8] float16 d, `mins` an empty int8 tensor, and the nibbles
//           codes of IQ4_NL's 16-value codebook (kIQ4Values, -127..113): element = d * kIQ4Values[code];
//   kCodebookSuper (IQ4_XS, H = 0): `scales` [N / 8, K / 256, 8] float16 d and `mins` [N / 8, K / 32, 8] int8 (each
//           group's scale sc, -32..31): element = (d * sc) * kIQ4Values[code], the scale d * sc in float32;
//   kCodebookF32 (IQ3_XXS, IQ3_S, IQ2_XXS, H = 0): `scales` [N / 8, K / 32, 8] float32, each group's scale as the
//           file's blocks make it, and `mins` the kind's codebook, 16 int8 (its grid's magnitudes, then their
//           negatives): element = scale * codebook[code];
//   kCodebookHalves (IQ2_XS, IQ2_S, H = 0): `scales` [N / 8, K / 256, 8] float32 d (float16's values; float32 so
//           that no K-quant table is taken for one), `mins` [N / 8, K / 32, 16] int8 (each 16-element half's
//           2s + 1, s its 4-bit scale: 8 features' first halves, then their second), and the codes of kIQ2Values (8, 25, 43, then their negatives): element = (d (2s + 1) / 8) * value, the
//           halves' integer dots combined as kSuper6's;
//   kCodebookHalvesIQ1 (IQ1_M, H = 0): the same with `mins` uint8 (2s + 1, s 3-bit) and the codes of kIQ1Values,
//           8 (g + delta) for IQ1_M's grid values g (-1, 0, 1) and run deltas (+-1/8).
//           The codebook kinds' dots are signed: v . xq, where the VNNI instructions take u = v + 128 (unsigned) and
//           subtract 128 * sum(xq), and AVX2 without them multiplies |xq| by v with xq's signs (exact either way).
// The float steps are q4's per group: for kTable, kSuper and kE8M0, acc += (u . xq) * (scale * dx) then
// acc += min * dx * sum(xq); for the codebook kinds the first of these alone (v . xq); for kSuper6 the halves'
// scales combine the integer dots first, sc0 * (u - o) . xq over the first half plus sc1 * ... over the second,
// exactly in int32, then acc += dot * (d * dx); kSuper2 likewise, then acc -= (m0 * sum0(xq) + m1 * sum1(xq)) *
// (dmin * dx), the mins' integer sum over the halves' sums of xq. Every row of a
// tile runs through the same instructions whatever rows are beside it, so a row's result does not depend on its
// batch.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "avx512_tiles.h"
#include "quant_tiles.h"

namespace ladle_quant {

constexpr int64_t kLowBitPlane = kPlaneBytes;  // the nibble plane of one block's group
constexpr int64_t kSuperGroups = 8;            // groups of 32 in a K-quant super-block of 256

enum class LowBitScales {
  kTable, kSuper, kSuper6, kSuper2, kE8M0, kCodebook, kCodebookSuper, kCodebookF32, kCodebookHalves,
  kCodebookHalvesIQ1
};

constexpr int64_t kTwoBitPlane = 64;  // a group of Q2_K's 2-bit values, 8 features x 32 elements

// kSuper6's offset of the values: Q6_K's 6-bit u less 32 (two high-bit planes), Q3_K's 3-bit u less 4 (none).
template <int64_t H>
constexpr int32_t kSuper6Offset = H == 2 ? 32 : 4;

// Whether a kind's codes scale each half of a group by d (2s + 1) / 8 (IQ2_XS, IQ2_S; IQ1_M).
constexpr bool codebook_halves(LowBitScales s) {
  return s == LowBitScales::kCodebookHalves || s == LowBitScales::kCodebookHalvesIQ1;
}
// Whether a kind's values are a codebook's signed entries (no min; a scale per group or half).
constexpr bool is_codebook(LowBitScales s) {
  return s == LowBitScales::kCodebook || s == LowBitScales::kCodebookSuper || s == LowBitScales::kCodebookF32 ||
         codebook_halves(s);
}
// Whether a kind runs on AMX tiles (one float scale and min a group, unsigned values): not Q6_K's halves, and not the
// codebooks' signed values.
constexpr bool lowbit_amx(LowBitScales s) {
  return s != LowBitScales::kSuper6 && s != LowBitScales::kSuper2 && !is_codebook(s);
}
// Whether a kind scales each half of a group (16 elements) by its own integer scale: its halves' dots kept apart.
constexpr bool half_scaled(LowBitScales s) {
  return s == LowBitScales::kSuper6 || s == LowBitScales::kSuper2 || codebook_halves(s);
}

// IQ4_NL's (and IQ4_XS's) codebook; the VNNI dots take each codebook's entries plus kIQ4Bias (`code_values`).
alignas(16) constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};
constexpr int32_t kIQ4Bias = 128;
// IQ2_XS's and IQ2_S's codebook: their grids' magnitudes, then the same negative; and the unit of their scales, d / 8
// (their half's scale d (0.5 + s) / 4 = (d / 8) (2s + 1)).
alignas(16) constexpr int8_t kIQ2Values[16] = {8, 25, 43, 0, 0, 0, 0, 0, -8, -25, -43, 0, 0, 0, 0, 0};
constexpr float kIQ2Unit = 0.125f;
// IQ1_M's codebook: a code (g + 1) + 3 (delta < 0) holds 8 (g + delta), its scale's unit d / 8 as IQ2's.
alignas(16) constexpr int8_t kIQ1Values[16] = {-7, 1, 9, -9, -1, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

// u of each e2m1 code (kE8M0): twice its value (0, 0.5, 1, 1.5, 2, 3, 4, 6, then their negatives) plus 12.
alignas(16) constexpr uint8_t kE2M1Offset[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
constexpr float kE2M1Min = -12.f;

// 2^(e - 128), exactly (subnormal for e < 2): an E8M0 exponent's scale, halved so that u's doubled values are right.
inline float e8m0_half_scale(uint8_t e) { return std::ldexp(1.f, static_cast<int>(e) - 128); }

#ifdef LADLE_QUANT_AVX2
// e8m0_half_scale of 8 int32 exponents 0..255: (e - 1) << 23 as a float's bits, 0x00200000 << e below 2 (subnormal).
inline __m256 e8m0_half_scales(__m256i e) {
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}
#endif

inline constexpr int64_t lowbit_group_bytes(int64_t high_bits) { return kLowBitPlane + 32 * high_bits; }
// The bytes of one block's group of kind S with H high-bit planes (Q2_K's: its 2-bit plane alone).
template <int64_t H, LowBitScales S>
constexpr int64_t group_bytes() {
  return S == LowBitScales::kSuper2 ? kTwoBitPlane : lowbit_group_bytes(H);
}

// Sum of each row's first 16 quantized values of each group ([M, K / 32]), for the half-scaled kinds.
inline at::Tensor half_totals(const QuantizedRows& xq, int64_t rows) {
  const int64_t groups = xq.k / kGroup;
  at::Tensor out = at::empty({rows, groups}, at::TensorOptions().dtype(at::kInt));
  int32_t* totals = out.data_ptr<int32_t>();
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* x = xq.row(m) + g * kGroup;
      int32_t sum = 0;
      for (int64_t i = 0; i < kGroup / 2; ++i) sum += x[i];
      totals[m * groups + g] = sum;
    }
  }
  return out;
}

// The scales of one packed weight (see the top of this file).
struct LowBitTables {
  const at::Half* scales;  // kTable: [blocks, groups, 8]; kSuper*: [blocks, groups / 8, 16]
  const at::Half* mins;    // kTable: [blocks, groups, 8], or nullptr for Q5_0's -16 * scale
  const uint8_t* small;    // kSuper*: [blocks, groups, 16]
  const float* group_scales = nullptr;  // kCodebookF32: [blocks, groups, 8]; the halves' kinds' d [blocks, supers, 8]
  const int8_t* codebook = nullptr;     // kCodebookF32: its 16 values
};

#ifdef LADLE_QUANT_AVX2
// The 16 values kind S's nibbles look up (kE8M0 and the codebooks), as the integer dots take them: kE8M0's u
// (unsigned), a codebook's values v signed, or v + 128 (unsigned) with VNNI.
template <LowBitScales S>
inline __m128i code_values(const LowBitTables& t) {
  if constexpr (S == LowBitScales::kE8M0) return _mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Offset));
  const void* table = S == LowBitScales::kCodebookF32         ? static_cast<const void*>(t.codebook)
                      : S == LowBitScales::kCodebookHalves    ? static_cast<const void*>(kIQ2Values)
                      : S == LowBitScales::kCodebookHalvesIQ1 ? static_cast<const void*>(kIQ1Values)
                                                              : static_cast<const void*>(kIQ4Values);
  const __m128i v = _mm_loadu_si128(static_cast<const __m128i*>(table));
#ifdef LADLE_QUANT_VNNI
  return _mm_xor_si128(v, _mm_set1_epi8(static_cast<char>(0x80)));  // v + 128 as an unsigned byte
#else
  return v;
#endif
}
#endif

// Rows [m0, m0 + R) of y for one packed block: y[m0 + r, 0 .. cols) (cols <= 8), rows y_stride apart. `block`
// points at the block's first group; `half` is `half_totals` (the half-scaled kinds only).
template <int64_t H, LowBitScales S, int64_t R>
void lowbit_tile(const QuantizedRows& xq, const int32_t* half, int64_t m0, const uint8_t* block,
                 const LowBitTables& t, int64_t b, float* y, int64_t y_stride, int64_t cols) {
  const int64_t k = xq.k, groups = k / kGroup, bytes = group_bytes<H, S>();
  const float* x_scales = xq.scales + m0 * groups;
  const float* x_sums = xq.sums + m0 * groups;
  const int32_t* x_totals = xq.totals + m0 * groups;
  const int32_t* x_half = half == nullptr ? nullptr : half + m0 * groups;
  const int8_t* x = xq.row(m0);
  // float16 values per super-block: d alone (8 features), or d and dmin (16)
  const int64_t super_width = S == LowBitScales::kCodebookSuper ? kBlock : 2 * kBlock;
  const at::Half* super = S == LowBitScales::kTable || S == LowBitScales::kE8M0 || S == LowBitScales::kCodebook ||
                                  S == LowBitScales::kCodebookF32 || codebook_halves(S)
                              ? nullptr
                              : t.scales + b * (groups / kSuperGroups) * super_width;
  // the halves' kinds' float32 d of this block's super-blocks
  const float* block_d = codebook_halves(S) ? t.group_scales + b * (groups / kSuperGroups) * kBlock : nullptr;
  alignas(32) float out[R][kBlock];
#ifdef LADLE_QUANT_AVX2
  const __m256i nibble = _mm256_set1_epi8(0x0F);
#ifndef LADLE_QUANT_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  [[maybe_unused]] const __m256i codes = _mm256_broadcastsi128_si256(code_values<S>(t));  // the looked-up kinds'
  __m256 acc[R];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = block + g * bytes;
    prefetch_bytes(w + groups * bytes, bytes);  // the next block's group g (quant_tiles.h)
    const int8_t* xg = x + g * kGroup;
    __m256i first[R], second[R];  // int32 dots of the group's first and second 16 elements (half-scaled), or all
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) first[r] = second[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int64_t c = 0; c < 4; ++c) {
      __m256i low, high;
      if constexpr (S == LowBitScales::kSuper2) {  // chunk c's 2-bit values at bits 4 (c % 2) of part c / 2
        const __m256i two = _mm256_set1_epi8(3);
        const __m256i bits = _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * (c / 2))),
                                              _mm_cvtsi32_si128(static_cast<int>(4 * (c % 2))));
        low = _mm256_and_si256(bits, two);
        high = _mm256_and_si256(_mm256_srli_epi16(bits, 2), two);
      } else {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32));
        low = _mm256_and_si256(raw, nibble);
        high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
      }
      if constexpr (S == LowBitScales::kE8M0 || is_codebook(S)) {
        low = _mm256_shuffle_epi8(codes, low);
        high = _mm256_shuffle_epi8(codes, high);
      } else if constexpr (H == 1) {
        const __m256i bits = _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kLowBitPlane)),
                                              _mm_cvtsi32_si128(static_cast<int>(2 * c)));
        low = _mm256_or_si256(low, _mm256_and_si256(_mm256_slli_epi16(bits, 4), _mm256_set1_epi8(0x10)));
        high = _mm256_or_si256(high, _mm256_and_si256(_mm256_slli_epi16(bits, 3), _mm256_set1_epi8(0x10)));
      } else if constexpr (H == 2) {
        const __m256i bits =
            _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kLowBitPlane + 32 * (c / 2))),
                             _mm_cvtsi32_si128(static_cast<int>(4 * (c % 2))));
        low = _mm256_or_si256(low, _mm256_and_si256(_mm256_slli_epi16(bits, 4), _mm256_set1_epi8(0x30)));
        high = _mm256_or_si256(high, _mm256_and_si256(_mm256_slli_epi16(bits, 2), _mm256_set1_epi8(0x30)));
      }
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        int32_t x_low, x_high;
        std::memcpy(&x_low, xg + r * k + 4 * c, 4);
        std::memcpy(&x_high, xg + r * k + 16 + 4 * c, 4);
        __m256i& other = half_scaled(S) ? second[r] : first[r];
#ifdef LADLE_QUANT_VNNI
        first[r] = _mm256_dpbusd_epi32(first[r], low, _mm256_set1_epi32(x_low));
        other = _mm256_dpbusd_epi32(other, high, _mm256_set1_epi32(x_high));
#else  // u <= 63: each int16 pair sum fits (63 * 127 * 2), widened to int32 per chunk
        if constexpr (is_codebook(S)) {  // |xq| times v with xq's sign: |v|, |xq| <= 127, so the pairs fit too
          const __m256i xl = _mm256_set1_epi32(x_low), xh = _mm256_set1_epi32(x_high);
          const __m256i pl = _mm256_maddubs_epi16(_mm256_abs_epi8(xl), _mm256_sign_epi8(low, xl));
          const __m256i ph = _mm256_maddubs_epi16(_mm256_abs_epi8(xh), _mm256_sign_epi8(high, xh));
          first[r] = _mm256_add_epi32(first[r], _mm256_madd_epi16(pl, ones));
          other = _mm256_add_epi32(other, _mm256_madd_epi16(ph, ones));
          continue;
        }
        first[r] = _mm256_add_epi32(first[r], _mm256_madd_epi16(_mm256_maddubs_epi16(low, _mm256_set1_epi32(x_low)), ones));
        other = _mm256_add_epi32(other, _mm256_madd_epi16(_mm256_maddubs_epi16(high, _mm256_set1_epi32(x_high)), ones));
#endif
      }
    }
    if constexpr (codebook_halves(S)) {  // as kSuper6's, the halves' scales 2s + 1
      const __m256 d = _mm256_mul_ps(_mm256_loadu_ps(block_d + (g / kSuperGroups) * kBlock), _mm256_set1_ps(kIQ2Unit));
      const uint8_t* sc = t.small + (b * groups + g) * 16;
      const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
      const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8)));
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
#ifdef LADLE_QUANT_VNNI  // v . xq = u . xq - 128 * sum(xq), per half
        const int32_t t0 = x_half[r * groups + g], t1 = x_totals[r * groups + g] - t0;
        const __m256i dot0 = _mm256_sub_epi32(first[r], _mm256_set1_epi32(kIQ4Bias * t0));
        const __m256i dot1 = _mm256_sub_epi32(second[r], _mm256_set1_epi32(kIQ4Bias * t1));
#else
        const __m256i dot0 = first[r], dot1 = second[r];
#endif
        const __m256i dot = _mm256_add_epi32(_mm256_mullo_epi32(dot0, sc0), _mm256_mullo_epi32(dot1, sc1));
        const __m256 row_scale = _mm256_mul_ps(d, _mm256_set1_ps(x_scales[r * groups + g]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), row_scale, acc[r]);
      }
    } else if constexpr (is_codebook(S)) {
      __m256 scale;
      if constexpr (S == LowBitScales::kCodebook) {
        const at::Half* d = t.scales + (b * groups + g) * kBlock;
        scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)));
      } else if constexpr (S == LowBitScales::kCodebookF32) {
        scale = _mm256_loadu_ps(t.group_scales + (b * groups + g) * kBlock);
      } else {
        const at::Half* d = super + (g / kSuperGroups) * kBlock;
        const uint8_t* sc = t.small + (b * groups + g) * kBlock;
        const __m256i sc32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
        scale = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d))),
                              _mm256_cvtepi32_ps(sc32));
      }
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
#ifdef LADLE_QUANT_VNNI
        const __m256i dot = _mm256_sub_epi32(first[r], _mm256_set1_epi32(kIQ4Bias * x_totals[r * groups + g]));
#else
        const __m256i dot = first[r];
#endif
        const __m256 row_scale = _mm256_mul_ps(scale, _mm256_set1_ps(x_scales[r * groups + g]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), row_scale, acc[r]);
      }
    } else if constexpr (S == LowBitScales::kSuper2) {
      const at::Half* pair = super + (g / kSuperGroups) * 16;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 8)));
      const uint8_t* halves = t.small + (b * groups + g) * 16;
      const __m256i h0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(halves)));
      const __m256i h1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(halves + 8)));
      const __m256i low4 = _mm256_set1_epi32(0x0F);
      const __m256i sc0 = _mm256_and_si256(h0, low4), sc1 = _mm256_and_si256(h1, low4);
      const __m256i m0 = _mm256_srli_epi32(h0, 4), m1 = _mm256_srli_epi32(h1, 4);
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {  // sc . (u . xq) per half, less m . sum(xq) per half, both in int32
        const int32_t t0 = x_half[r * groups + g], t1 = x_totals[r * groups + g] - t0;
        const __m256i dot = _mm256_add_epi32(_mm256_mullo_epi32(first[r], sc0), _mm256_mullo_epi32(second[r], sc1));
        const __m256i mins = _mm256_add_epi32(_mm256_mullo_epi32(m0, _mm256_set1_epi32(t0)),
                                              _mm256_mullo_epi32(m1, _mm256_set1_epi32(t1)));
        const __m256 dx = _mm256_set1_ps(x_scales[r * groups + g]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, dx), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, dx), acc[r]);
      }
    } else if constexpr (S == LowBitScales::kSuper6) {
      const at::Half* d_half = super + (g / kSuperGroups) * 16;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d_half)));
      const uint8_t* sc = t.small + (b * groups + g) * 16;
      const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
      const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8)));
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {  // (u - o) . xq = u . xq - o * sum(xq), per half
        const int32_t t0 = x_half[r * groups + g], t1 = x_totals[r * groups + g] - t0;
        const __m256i dot0 = _mm256_sub_epi32(first[r], _mm256_set1_epi32(kSuper6Offset<H> * t0));
        const __m256i dot1 = _mm256_sub_epi32(second[r], _mm256_set1_epi32(kSuper6Offset<H> * t1));
        const __m256i dot = _mm256_add_epi32(_mm256_mullo_epi32(dot0, sc0), _mm256_mullo_epi32(dot1, sc1));
        const __m256 row_scale = _mm256_mul_ps(d, _mm256_set1_ps(x_scales[r * groups + g]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), row_scale, acc[r]);
      }
    } else {
      __m256 scale, min;
      if constexpr (S == LowBitScales::kE8M0) {
        const uint8_t* e = t.small + (b * groups + g) * kBlock;
        scale = e8m0_half_scales(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e))));
        min = _mm256_mul_ps(scale, _mm256_set1_ps(kE2M1Min));
      } else if constexpr (S == LowBitScales::kTable) {
        const int64_t at = (b * groups + g) * kBlock;
        scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.scales + at)));
        min = t.mins == nullptr ? _mm256_mul_ps(scale, _mm256_set1_ps(-16.f))
                                : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.mins + at)));
      } else {
        const at::Half* pair = super + (g / kSuperGroups) * 16;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 8)));
        const uint8_t* small = t.small + (b * groups + g) * 16;
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(small))));
        const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(small + 8))));
        scale = _mm256_mul_ps(d, sc);
        min = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, m));
      }
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        const __m256 row_scale = _mm256_mul_ps(scale, _mm256_set1_ps(x_scales[r * groups + g]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first[r]), row_scale, acc[r]);
        acc[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(x_sums[r * groups + g]), acc[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) _mm256_store_ps(out[r], acc[r]);
#else
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < kBlock; ++j) out[r][j] = 0.f;
  }
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = block + g * bytes;
    for (int64_t j = 0; j < kBlock; ++j) {
      int32_t u[kGroup];  // feature j's values of this group (the codebooks' signed)
      for (int64_t c = 0; c < 4; ++c) {
        for (int64_t i = 0; i < 4; ++i) {
          const int64_t at = 4 * j + i;
          const uint8_t byte = S == LowBitScales::kSuper2 ? w[32 * (c / 2) + at] >> (4 * (c % 2)) : w[c * 32 + at];
          uint32_t low = byte & 0x0F, high = byte >> 4;
          if (S == LowBitScales::kSuper2) {
            low = byte & 3;
            high = (byte >> 2) & 3;
          } else if (H == 1) {
            low |= ((w[kLowBitPlane + at] >> (2 * c)) & 1) << 4;
            high |= ((w[kLowBitPlane + at] >> (2 * c + 1)) & 1) << 4;
          } else if (H == 2) {
            const uint8_t bits = w[kLowBitPlane + 32 * (c / 2) + at] >> (4 * (c % 2));
            low |= (bits & 3) << 4;
            high |= ((bits >> 2) & 3) << 4;
          }
          int32_t first_value = static_cast<int32_t>(low), second_value = static_cast<int32_t>(high);
          if (S == LowBitScales::kE8M0) {
            first_value = kE2M1Offset[low];
            second_value = kE2M1Offset[high];
          } else if (is_codebook(S)) {
            const int8_t* values = S == LowBitScales::kCodebookF32         ? t.codebook
                                   : S == LowBitScales::kCodebookHalves    ? kIQ2Values
                                   : S == LowBitScales::kCodebookHalvesIQ1 ? kIQ1Values
                                                                           : kIQ4Values;
            first_value = values[low];
            second_value = values[high];
          }
          u[4 * c + i] = first_value;
          u[16 + 4 * c + i] = second_value;
        }
      }
      float scale = 0.f, min = 0.f;
      int32_t sc0 = 0, sc1 = 0, m0 = 0, m1 = 0;
      if (S == LowBitScales::kE8M0) {
        scale = e8m0_half_scale(t.small[(b * groups + g) * kBlock + j]);
        min = scale * kE2M1Min;
      } else if (S == LowBitScales::kCodebook) {
        scale = to_float(t.scales[(b * groups + g) * kBlock + j]);
      } else if (S == LowBitScales::kCodebookF32) {
        scale = t.group_scales[(b * groups + g) * kBlock + j];
      } else if (codebook_halves(S)) {
        scale = block_d[(g / kSuperGroups) * kBlock + j] * kIQ2Unit;
        sc0 = static_cast<int8_t>(t.small[(b * groups + g) * 16 + j]);
        sc1 = static_cast<int8_t>(t.small[(b * groups + g) * 16 + 8 + j]);
      } else if (S == LowBitScales::kCodebookSuper) {
        const int8_t sc = static_cast<int8_t>(t.small[(b * groups + g) * kBlock + j]);
        scale = to_float(super[(g / kSuperGroups) * kBlock + j]) * static_cast<float>(sc);
      } else if (S == LowBitScales::kTable) {
        scale = to_float(t.scales[(b * groups + g) * kBlock + j]);
        min = t.mins == nullptr ? scale * -16.f : to_float(t.mins[(b * groups + g) * kBlock + j]);
      } else {
        const at::Half* pair = super + (g / kSuperGroups) * 16;
        const uint8_t* small = t.small + (b * groups + g) * 16;
        if (S == LowBitScales::kSuper) {
          scale = to_float(pair[j]) * static_cast<float>(small[j]);
          min = 0.f - to_float(pair[8 + j]) * static_cast<float>(small[8 + j]);
        } else if (S == LowBitScales::kSuper2) {
          scale = to_float(pair[j]);
          min = to_float(pair[8 + j]);  // dmin
          sc0 = small[j] & 0x0F, m0 = small[j] >> 4;
          sc1 = small[8 + j] & 0x0F, m1 = small[8 + j] >> 4;
        } else {
          scale = to_float(pair[j]);
          sc0 = static_cast<int8_t>(small[j]);
          sc1 = static_cast<int8_t>(small[8 + j]);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const int8_t* xg = x + r * k + g * kGroup;
        int32_t dot0 = 0, dot1 = 0;
        for (int64_t i = 0; i < kGroup / 2; ++i) dot0 += u[i] * xg[i];
        for (int64_t i = kGroup / 2; i < kGroup; ++i) dot1 += u[i] * xg[i];
        const float row_scale = scale * x_scales[r * groups + g];
        if (S == LowBitScales::kSuper6) {
          const int32_t t0 = x_half[r * groups + g], t1 = x_totals[r * groups + g] - t0;
          const int32_t dot = (dot0 - kSuper6Offset<H> * t0) * sc0 + (dot1 - kSuper6Offset<H> * t1) * sc1;
          out[r][j] = std::fma(static_cast<float>(dot), row_scale, out[r][j]);
        } else if (codebook_halves(S)) {  // u are the signed values here
          out[r][j] = std::fma(static_cast<float>(dot0 * sc0 + dot1 * sc1), row_scale, out[r][j]);
        } else if (S == LowBitScales::kSuper2) {
          const int32_t t0 = x_half[r * groups + g], t1 = x_totals[r * groups + g] - t0;
          const int32_t mins = m0 * t0 + m1 * t1;
          out[r][j] = std::fma(static_cast<float>(dot0 * sc0 + dot1 * sc1), row_scale, out[r][j]);
          out[r][j] = std::fma(-static_cast<float>(mins), min * x_scales[r * groups + g], out[r][j]);
        } else {
          out[r][j] = std::fma(static_cast<float>(dot0 + dot1), row_scale, out[r][j]);
          if (!is_codebook(S)) out[r][j] = std::fma(min, x_sums[r * groups + g], out[r][j]);
        }
      }
    }
  }
#endif
  for (int64_t r = 0; r < R; ++r) std::memcpy(y + r * y_stride, out[r], cols * sizeof(float));
}

#ifdef LADLE_QUANT_AVX512
// 32 bytes of each of two blocks side by side in one register (features 0..7 of the first, then of the second).
inline __m512i lowbit_pair(const void* a, const void* c) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(static_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(static_cast<const __m256i*>(c)), 1);
}

// 8 float16 of each block -> 16 floats.
inline __m512 lowbit_halves(const at::Half* a, const at::Half* c) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)), 1));
}

// 8 floats of each block -> 16 floats.
inline __m512 lowbit_floats(const float* a, const float* c) {
  const __m512d first = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a)));
  return _mm512_castpd_ps(_mm512_insertf64x4(first, _mm256_castps_pd(_mm256_loadu_ps(c)), 1));
}

// 8 bytes of each block -> one 128-bit lane.
inline __m128i lowbit_bytes16(const uint8_t* a, const uint8_t* c) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
}

// The high-bit planes of one group of two blocks (w0, w1 point at the group).
template <int64_t H>
inline void lowbit_pair_high_bits(const uint8_t* w0, const uint8_t* w1, __m512i (&high_bits)[2]) {
  if constexpr (H >= 1) high_bits[0] = lowbit_pair(w0 + kLowBitPlane, w1 + kLowBitPlane);
  if constexpr (H == 2) high_bits[1] = lowbit_pair(w0 + kLowBitPlane + 32, w1 + kLowBitPlane + 32);
}

// A 16-bit-lane shift by S bits, left for S > 0, right for S < 0 (each byte's bits 4..5 come from its own byte).
template <int S>
inline __m512i lowbit_shift(__m512i v) {
  if constexpr (S > 0) return _mm512_slli_epi16(v, S);
  if constexpr (S < 0) return _mm512_srli_epi16(v, -S);
  return v;
}

// Chunk C of one group of two blocks as values u (0..63, so also valid signed bytes): `low` elements 4C .. 4C + 3
// of the group, `high` 16 + 4C .. 16 + 4C + 3, 16 features x 4 elements each. Each value's high bits are shifted
// to bit 4 (and 5) of its byte and merged in one `vpternlogd` (low | (shifted & mask)); kE8M0's codes are looked up.
template <int64_t H, LowBitScales S, int C>
inline void lowbit_pair_chunk(const uint8_t* w0, const uint8_t* w1, const __m512i (&high_bits)[2], __m512i codes,
                              __m512i& low, __m512i& high) {
  constexpr int kOrMasked = 0xF8;  // vpternlogd's table for A | (B & C)
  if constexpr (S == LowBitScales::kSuper2) {  // chunk C's 2-bit values at bits 4 (C % 2) of part C / 2
    const __m512i two = _mm512_set1_epi8(3);
    const __m512i bits = lowbit_shift<-4 * (C % 2)>(lowbit_pair(w0 + 32 * (C / 2), w1 + 32 * (C / 2)));
    low = _mm512_and_si512(bits, two);
    high = _mm512_and_si512(_mm512_srli_epi16(bits, 2), two);
    return;
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i raw = lowbit_pair(w0 + C * 32, w1 + C * 32);
  low = _mm512_and_si512(raw, nibble);
  high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
  if constexpr (S == LowBitScales::kE8M0 || is_codebook(S)) {  // `codes`: code_values (the codebooks v + 128)
    low = _mm512_shuffle_epi8(codes, low);
    high = _mm512_shuffle_epi8(codes, high);
  } else if constexpr (H == 1) {  // bit 2C of a byte is its low element's, bit 2C + 1 its high element's
    const __m512i fifth = _mm512_set1_epi8(0x10);
    low = _mm512_ternarylogic_epi32(low, lowbit_shift<4 - 2 * C>(high_bits[0]), fifth, kOrMasked);
    high = _mm512_ternarylogic_epi32(high, lowbit_shift<3 - 2 * C>(high_bits[0]), fifth, kOrMasked);
  } else if constexpr (H == 2) {  // bits 4 (C % 2) .. +1 the low element's, the next two the high element's
    const __m512i two = _mm512_set1_epi8(0x30);
    low = _mm512_ternarylogic_epi32(low, lowbit_shift<4 - 4 * (C % 2)>(high_bits[C / 2]), two, kOrMasked);
    high = _mm512_ternarylogic_epi32(high, lowbit_shift<2 - 4 * (C % 2)>(high_bits[C / 2]), two, kOrMasked);
  }
}

// f(std::integral_constant<int, C>{}) for the chunks C = 0..3, in order.
template <typename F>
inline void for_each_chunk(F&& f) {
  f(std::integral_constant<int, 0>{});
  f(std::integral_constant<int, 1>{});
  f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 3>{});
}

// Group g's scales and mins of blocks b and b + 1 (kTable, kSuper, kE8M0; the codebooks' scales, min zero) as 16
// floats each: lowbit_tile's values.
template <LowBitScales S>
inline void lowbit_pair_scales(const LowBitTables& t, int64_t b, int64_t g, int64_t groups, __m512& scale,
                               __m512& min) {
  if constexpr (S == LowBitScales::kCodebook) {
    const int64_t at0 = (b * groups + g) * kBlock;
    scale = lowbit_halves(t.scales + at0, t.scales + at0 + groups * kBlock);
    min = _mm512_setzero_ps();
  } else if constexpr (S == LowBitScales::kCodebookF32) {
    const float* s0 = t.group_scales + (b * groups + g) * kBlock;
    scale = lowbit_floats(s0, s0 + groups * kBlock);
    min = _mm512_setzero_ps();
  } else if constexpr (S == LowBitScales::kCodebookSuper) {
    const int64_t supers = groups / kSuperGroups;
    const at::Half* d0 = t.scales + (b * supers + g / kSuperGroups) * kBlock;
    const int8_t* sc0 = reinterpret_cast<const int8_t*>(t.small) + (b * groups + g) * kBlock;
    const __m512 d = lowbit_halves(d0, d0 + supers * kBlock);
    const __m128i sc = lowbit_bytes16(reinterpret_cast<const uint8_t*>(sc0),
                                      reinterpret_cast<const uint8_t*>(sc0 + groups * kBlock));
    scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
    min = _mm512_setzero_ps();
  } else if constexpr (S == LowBitScales::kE8M0) {  // as e8m0_half_scales, 16 lanes
    const uint8_t* e0 = t.small + (b * groups + g) * kBlock;
    const __m512i e = _mm512_cvtepu8_epi32(lowbit_bytes16(e0, e0 + groups * kBlock));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 small = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
    scale = _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, tiny));
    min = _mm512_mul_ps(scale, _mm512_set1_ps(kE2M1Min));
  } else if constexpr (S == LowBitScales::kTable) {
    const int64_t at0 = (b * groups + g) * kBlock, at1 = at0 + groups * kBlock;
    scale = lowbit_halves(t.scales + at0, t.scales + at1);
    min = t.mins == nullptr ? _mm512_mul_ps(scale, _mm512_set1_ps(-16.f)) : lowbit_halves(t.mins + at0, t.mins + at1);
  } else {
    const int64_t supers = groups / kSuperGroups;
    const at::Half* super0 = t.scales + (b * supers + g / kSuperGroups) * 16;
    const at::Half* super1 = super0 + supers * 16;
    const uint8_t* small0 = t.small + (b * groups + g) * 16;
    const uint8_t* small1 = small0 + groups * 16;
    const __m512 d = lowbit_halves(super0, super1), dmin = lowbit_halves(super0 + 8, super1 + 8);
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lowbit_bytes16(small0, small1)));
    const __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lowbit_bytes16(small0 + 8, small1 + 8)));
    scale = _mm512_mul_ps(d, sc);
    min = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, m));
  }
}

// lowbit_tile for two blocks at once, b and b + 1, in 512-bit registers (features 0..7 of b in the low half of
// every lane group, of b + 1 in the high half): the same integer dots and float steps lane for lane, so the same
// bits as two lowbit_tile calls, in about half the instructions. y gets cols0 columns of b and cols1 of b + 1.
template <int64_t H, LowBitScales S, int64_t R>
void lowbit_pair_tile(const QuantizedRows& xq, const int32_t* half, int64_t m0, const uint8_t* block0,
                      const uint8_t* block1, const LowBitTables& t, int64_t b, float* y, int64_t y_stride,
                      int64_t cols0, int64_t cols1) {
  const int64_t k = xq.k, groups = k / kGroup, bytes = group_bytes<H, S>(), supers = groups / kSuperGroups;
  [[maybe_unused]] const __m512i codes = _mm512_broadcast_i32x4(code_values<S>(t));  // the looked-up kinds'
  const float* x_scales = xq.scales + m0 * groups;
  const float* x_sums = xq.sums + m0 * groups;
  const int32_t* x_totals = xq.totals + m0 * groups;
  const int32_t* x_half = half == nullptr ? nullptr : half + m0 * groups;
  const int8_t* x = xq.row(m0);
  __m512 acc[R];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w0 = block0 + g * bytes;
    const uint8_t* w1 = block1 + g * bytes;
    prefetch_bytes(w0 + 2 * (block1 - block0), bytes);  // the next pair's group g (quant_tiles.h)
    prefetch_bytes(w1 + 2 * (block1 - block0), bytes);
    const int8_t* xg = x + g * kGroup;
    __m512i first[R], second[R];
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) first[r] = second[r] = _mm512_setzero_si512();
    __m512i high_bits[2];
    lowbit_pair_high_bits<H>(w0, w1, high_bits);
    for_each_chunk([&](auto chunk) {
      constexpr int c = decltype(chunk)::value;
      __m512i low, high;
      lowbit_pair_chunk<H, S, c>(w0, w1, high_bits, codes, low, high);
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        int32_t x_low, x_high;
        std::memcpy(&x_low, xg + r * k + 4 * c, 4);
        std::memcpy(&x_high, xg + r * k + 16 + 4 * c, 4);
        first[r] = _mm512_dpbusd_epi32(first[r], low, _mm512_set1_epi32(x_low));
        __m512i& other = half_scaled(S) ? second[r] : first[r];
        other = _mm512_dpbusd_epi32(other, high, _mm512_set1_epi32(x_high));
      }
    });
    if constexpr (codebook_halves(S)) {  // the blocks' d / 8 and the halves' 2s + 1
      const float* d0 = t.group_scales + (b * supers + g / kSuperGroups) * kBlock;
      const __m512 d = _mm512_mul_ps(lowbit_floats(d0, d0 + supers * kBlock), _mm512_set1_ps(kIQ2Unit));
      const uint8_t* small0 = t.small + (b * groups + g) * 16;
      const uint8_t* small1 = small0 + groups * 16;
      const __m512i sc0 = _mm512_cvtepi8_epi32(lowbit_bytes16(small0, small1));
      const __m512i sc1 = _mm512_cvtepi8_epi32(lowbit_bytes16(small0 + 8, small1 + 8));
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {  // v . xq = u . xq - 128 * sum(xq), per half
        const int32_t t0 = x_half[r * groups + g], t1 = x_totals[r * groups + g] - t0;
        const __m512i dot0 = _mm512_sub_epi32(first[r], _mm512_set1_epi32(kIQ4Bias * t0));
        const __m512i dot1 = _mm512_sub_epi32(second[r], _mm512_set1_epi32(kIQ4Bias * t1));
        const __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(dot0, sc0), _mm512_mullo_epi32(dot1, sc1));
        const __m512 row_scale = _mm512_mul_ps(d, _mm512_set1_ps(x_scales[r * groups + g]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), row_scale, acc[r]);
      }
    } else if constexpr (S == LowBitScales::kSuper2) {  // the blocks' d and dmin, the halves' sc and m of this group
      const at::Half* super0 = t.scales + (b * supers + g / kSuperGroups) * 16;
      const at::Half* super1 = super0 + supers * 16;
      const uint8_t* halves0 = t.small + (b * groups + g) * 16;
      const uint8_t* halves1 = halves0 + groups * 16;
      const __m512 d = lowbit_halves(super0, super1), dmin = lowbit_halves(super0 + 8, super1 + 8);
      const __m512i h0 = _mm512_cvtepu8_epi32(lowbit_bytes16(halves0, halves1));
      const __m512i h1 = _mm512_cvtepu8_epi32(lowbit_bytes16(halves0 + 8, halves1 + 8));
      const __m512i low4 = _mm512_set1_epi32(0x0F);
      const __m512i sc0 = _mm512_and_si512(h0, low4), sc1 = _mm512_and_si512(h1, low4);
      const __m512i m0 = _mm512_srli_epi32(h0, 4), m1 = _mm512_srli_epi32(h1, 4);
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        const int32_t t0 = x_half[r * groups + g], t1 = x_totals[r * groups + g] - t0;
        const __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(first[r], sc0), _mm512_mullo_epi32(second[r], sc1));
        const __m512i mins = _mm512_add_epi32(_mm512_mullo_epi32(m0, _mm512_set1_epi32(t0)),
                                              _mm512_mullo_epi32(m1, _mm512_set1_epi32(t1)));
        const __m512 dx = _mm512_set1_ps(x_scales[r * groups + g]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, dx), acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, dx), acc[r]);
      }
    } else if constexpr (S == LowBitScales::kSuper6) {  // the blocks' d and the halves' scales of this group
      const at::Half* super0 = t.scales + (b * supers + g / kSuperGroups) * 16;
      const at::Half* super1 = super0 + supers * 16;
      const uint8_t* small0 = t.small + (b * groups + g) * 16;
      const uint8_t* small1 = small0 + groups * 16;
      const __m512 d = lowbit_halves(super0, super1);
      const __m512i sc0 = _mm512_cvtepi8_epi32(lowbit_bytes16(small0, small1));
      const __m512i sc1 = _mm512_cvtepi8_epi32(lowbit_bytes16(small0 + 8, small1 + 8));
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        const int32_t t0 = x_half[r * groups + g], t1 = x_totals[r * groups + g] - t0;
        const __m512i dot0 = _mm512_sub_epi32(first[r], _mm512_set1_epi32(kSuper6Offset<H> * t0));
        const __m512i dot1 = _mm512_sub_epi32(second[r], _mm512_set1_epi32(kSuper6Offset<H> * t1));
        const __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(dot0, sc0), _mm512_mullo_epi32(dot1, sc1));
        const __m512 row_scale = _mm512_mul_ps(d, _mm512_set1_ps(x_scales[r * groups + g]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), row_scale, acc[r]);
      }
    } else {
      __m512 scale, min;
      lowbit_pair_scales<S>(t, b, g, groups, scale, min);
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        const __m512 row_scale = _mm512_mul_ps(scale, _mm512_set1_ps(x_scales[r * groups + g]));
        if constexpr (is_codebook(S)) {  // v . xq = u . xq - 128 * sum(xq)
          const __m512i dot = _mm512_sub_epi32(first[r], _mm512_set1_epi32(kIQ4Bias * x_totals[r * groups + g]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), row_scale, acc[r]);
          continue;
        }
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first[r]), row_scale, acc[r]);
        acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(x_sums[r * groups + g]), acc[r]);
      }
    }
  }
  alignas(64) float out[kBlock * 2];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) {
    _mm512_store_ps(out, acc[r]);
    std::memcpy(y + r * y_stride, out, cols0 * sizeof(float));
    std::memcpy(y + r * y_stride + kBlock, out + kBlock, cols1 * sizeof(float));
  }
}
constexpr bool kLowBitPairs = true;

#ifdef LADLE_QUANT_AMX
// Blocks b and b + 1 (kTable, kSuper or kE8M0) unpacked into AMX's B layout (avx512_tiles.h's `unpack_pair`): the
// values u as signed bytes, the scales and mins as lowbit_tile's floats, so `amx_tile<1, ...>` gives lowbit_tile's
// bits.
template <int64_t H, LowBitScales S>
void unpack_lowbit_pair(const uint8_t* block0, const uint8_t* block1, const LowBitTables& t, int64_t b,
                        int64_t groups, UnpackedPair& out) {
  static_assert(lowbit_amx(S), "Q6_K's halves take two scales a group, the codebooks signed values: not AMX's");
  const int64_t bytes = lowbit_group_bytes(H);
  const __m512i codes = _mm512_broadcast_i32x4(code_values<S>(t));  // kE8M0's
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w0 = block0 + g * bytes;
    const uint8_t* w1 = block1 + g * bytes;
    int8_t* rows = out.weights + g * kAmxGroupBytes;
    __m512i high_bits[2];
    lowbit_pair_high_bits<H>(w0, w1, high_bits);
    for_each_chunk([&](auto chunk) {
      constexpr int c = decltype(chunk)::value;
      __m512i low, high;
      lowbit_pair_chunk<H, S, c>(w0, w1, high_bits, codes, low, high);
      _mm512_store_si512(rows + c * 64, low);
      _mm512_store_si512(rows + (4 + c) * 64, high);
    });
    __m512 scale, min;
    lowbit_pair_scales<S>(t, b, g, groups, scale, min);
    _mm512_store_ps(out.scales + g * kAmxCols, scale);
    _mm512_store_ps(out.mins + g * kAmxCols, min);
  }
}
#endif  // LADLE_QUANT_AMX
#else
constexpr bool kLowBitPairs = false;
#endif  // LADLE_QUANT_AVX512

// Rows [first, last) of y for block b of a packed weight (`packed` its first block's first group), and block b + 1
// with it where `paired` (kLowBitPairs only): y points at row 0, feature 0, rows y_stride apart, n_rows features.
// AMX tiles where `scratch` is given (AMX on, an AmxScope on this thread; never for the half-scaled kinds), the
// pair and kAmxMinRows rows or more; otherwise lowbit_pair_tile or lowbit_tile, kRowTile rows at a time. Every path
// gives lowbit_tile's bits. The dense products (quant_matmul.cpp's run_lowbit) and the experts' (moe.cpp) both run
// their rows through here.
template <int64_t H, LowBitScales S>
void lowbit_rows(const QuantizedRows& xq, const int32_t* half, int64_t first, int64_t last, const uint8_t* packed,
                 const LowBitTables& t, int64_t b, bool paired, UnpackedPair* scratch, float* y, int64_t y_stride,
                 int64_t n_rows) {
  const int64_t groups = xq.k / kGroup, block_bytes = groups * group_bytes<H, S>();
  const uint8_t* block = packed + b * block_bytes;
  const int64_t cols = std::min(kBlock, n_rows - b * kBlock);
  float* columns = y + b * kBlock;
#ifdef LADLE_QUANT_AMX
  if constexpr (lowbit_amx(S)) {
    if (scratch != nullptr && paired && last - first >= kAmxMinRows) {
      unpack_lowbit_pair<H, S>(block, block + block_bytes, t, b, groups, *scratch);
      const int64_t both = std::min(2 * kBlock, n_rows - b * kBlock);
      for (int64_t m0 = first; m0 < last; m0 += kAmxRows) {
        float* out = columns + m0 * y_stride;
        if (last - m0 >= kAmxRows) {
          amx_tile<1, true>(xq, m0, kAmxRows, *scratch, out, y_stride, both);
        } else {
          amx_tile<1, false>(xq, m0, last - m0, *scratch, out, y_stride, both);
        }
      }
      return;
    }
  }
#else
  (void)scratch;
#endif
  for (int64_t m0 = first; m0 < last; m0 += kRowTile) {
    with_rows(std::min(kRowTile, last - m0), [&](auto tile_rows) {
      constexpr int64_t R = decltype(tile_rows)::value;
      float* out = columns + m0 * y_stride;
#ifdef LADLE_QUANT_AVX512
      if (paired) {
        const int64_t cols1 = std::min(kBlock, n_rows - (b + 1) * kBlock);
        return lowbit_pair_tile<H, S, R>(xq, half, m0, block, block + block_bytes, t, b, out, y_stride, cols, cols1);
      }
#endif
      lowbit_tile<H, S, R>(xq, half, m0, block, t, b, out, y_stride, cols);
    });
  }
}

}  // namespace ladle_quant
