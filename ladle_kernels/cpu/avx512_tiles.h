// The quantized products' tiles on AVX-512 machines, 16 output features (a pair of packed blocks) at a time, for
// the linear layers (quant_matmul.cpp) and the experts (moe.cpp):
//   - `pair_tile`: up to 8 rows of x through AVX-512 VNNI, `block_tile` (quant_tiles.h) on 512-bit registers (two
//     blocks' 4-byte runs side by side, one `vpdpbusd` for 16 features; the core runs it as often as the 256-bit
//     one: 2x the products per cycle, measured);
//   - `amx_tile` (Intel AMX, Sapphire Rapids and later): 16 rows of x per `tdpbssd`, 16 x 16 x 32 products in one
//     instruction, when a product has kAmxMinRows rows or more.
// Both give `block_tile`'s result bit for bit, so a row's result still does not depend on its batch whichever path
// a step takes: each group's dot product q . xq is the same exact int32, and the float steps are the same in the
// same order:
//   acc = fma(float(dot), scale * x_scale, acc), then for q4 acc = fma(min, x_sum, acc), group after group.
// AMX saves the integer work only; the float steps stay on AVX-512, 16 features per register.
//
// For AMX a pair is first unpacked (`unpack_pair`) into its B layout, signed bytes: for group g, row i (elements
// 4i .. 4i + 3 of the group) holds features 0..15, 4 bytes each. q4 holds q (0..15, its mins carrying the offset);
// q8's two planes of u = q + 128 are put back together and q = u ^ 0x80 (`pair_chunk`). An unpacked pair then
// serves every 16-row tile of x, which `amx_tile` reads in place, 16 rows at a time: a QuantizedRows holds
// kTailRows rows of zeros after its last, so a tile may start at any row.
#pragma once

#include "quant_tiles.h"

#if defined(LADLE_QUANT_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define LADLE_QUANT_AVX512 1
#endif
#if defined(LADLE_QUANT_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define LADLE_QUANT_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>
#include <cstdlib>
#include <memory>

namespace ladle_quant {

constexpr int64_t kPairRows = 8;   // rows of x per pair_tile: 8 sums and 8 accumulators in the 32 registers
constexpr int64_t kAmxRows = 16;  // rows of x per tile
constexpr int64_t kAmxCols = 16;  // output features per tile: two packed blocks
constexpr int64_t kAmxGroupBytes = kGroup * kAmxCols;  // one group of an unpacked pair: 8 rows of 64 bytes
// Rows of a product below which the VNNI tiles run it: a tile's fixed costs (unpacking a pair's weight, storing
// and scaling 16 x 16 sums) need about this many rows to pay.
constexpr int64_t kAmxMinRows = 12;

// Whether AMX is on: built with it, the kernel let this process use its tile registers, and not switched off
// (`torch.ops.ladle_cpu.set_quant_amx`, for the tests that hold both paths to the same bits).
inline std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{true};
  return on;
}

inline bool amx_supported() {
#ifdef LADLE_QUANT_AMX
  // Linux hands out the 8 KB of tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA); once asked, every thread of the process may use it.
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h, the kernel's xstate bit
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
#else
  return false;
#endif
}

inline bool amx_enabled() { return amx_switch().load(std::memory_order_relaxed) && amx_supported(); }

// A pair of packed blocks in AMX's B layout with its scales and mins as floats, group by group.
struct UnpackedPair {
  std::unique_ptr<int8_t[], void (*)(void*)> storage{nullptr, std::free};
  int8_t* weights = nullptr;  // [groups][8][64]
  float* scales = nullptr;    // [groups][16]
  float* mins = nullptr;      // [groups][16]
  int64_t groups = 0;

  explicit UnpackedPair(int64_t group_count) : groups(group_count) {
    const size_t bytes = static_cast<size_t>(groups) * (kAmxGroupBytes + 2 * kAmxCols * sizeof(float));
    storage.reset(static_cast<int8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
    weights = storage.get();
    scales = reinterpret_cast<float*>(weights + groups * kAmxGroupBytes);
    mins = scales + groups * kAmxCols;
  }
};

// One packed weight (`pack_q4` / `pack_q8`): block b's groups, scales and mins.
struct PackedBlocks {
  const uint8_t* packed;
  const at::Half* scales;
  const at::Half* mins;
  int64_t blocks, groups, n_rows;

  const uint8_t* block(int64_t b, int64_t planes) const { return packed + b * groups * planes * kPlaneBytes; }
  const at::Half* scale(int64_t b) const { return scales + b * groups * kBlock; }
  const at::Half* min(int64_t b) const { return mins + b * groups * kBlock; }
};

#ifdef LADLE_QUANT_AVX512

// Blocks 2 * pair and 2 * pair + 1 of a packed weight; past the last block, the pair's second is its first again
// (its 8 features computed and not stored).
struct PairBlocks {
  const uint8_t* block0;
  const uint8_t* block1;
  const at::Half *scales0, *scales1, *mins0, *mins1;

  PairBlocks(const PackedBlocks& w, int64_t pair, int64_t planes) {
    const int64_t b = 2 * pair, b1 = b + 1 < w.blocks ? b + 1 : b;
    block0 = w.block(b, planes);
    block1 = w.block(b1, planes);
    scales0 = w.scale(b);
    scales1 = w.scale(b1);
    mins0 = w.min(b);
    mins1 = w.min(b1);
  }
};

// Group g's 32-byte chunk c of both blocks as two registers of 16 features x 4 elements: `first` elements
// 4c .. 4c + 3 of the group, `second` 16 + 4c .. 16 + 4c + 3. q4: q (0..15). q8: u = q + 128 (unsigned, for
// `vpdpbusd`), or q itself when Signed (for AMX's `tdpbssd`).
template <int64_t P, bool Signed>
inline void pair_chunk(const PairBlocks& blocks, int64_t g, int64_t c, __m512i& first, __m512i& second) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512i plane[P];
  for (int64_t p = 0; p < P; ++p) {  // block 0's chunk in the low 32 bytes, block 1's in the high 32
    const int64_t at = (g * P + p) * kPlaneBytes + c * 32;
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks.block0 + at));
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks.block1 + at));
    plane[p] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
  if constexpr (P == 1) {
    first = _mm512_and_si512(plane[0], nibble);
    second = _mm512_and_si512(_mm512_srli_epi16(plane[0], 4), nibble);
  } else {  // u's high nibble from plane 0, its low nibble from plane 1
    first = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(plane[0], nibble), 4),
                            _mm512_and_si512(plane[1], nibble));
    second = _mm512_or_si512(_mm512_andnot_si512(nibble, plane[0]),
                             _mm512_and_si512(_mm512_srli_epi16(plane[1], 4), nibble));
    if constexpr (Signed) {  // q = u - 128
      const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
      first = _mm512_xor_si512(first, sign);
      second = _mm512_xor_si512(second, sign);
    }
  }
}

// Group g's 8 + 8 float16 entries of two blocks' tables as 16 floats.
inline __m512 pair_table(const at::Half* table0, const at::Half* table1, int64_t g) {
  const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table0 + g * kBlock)));
  const __m256 high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table1 + g * kBlock)));
  return _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1);
}

// Rows [m0, m0 + R) of y for pair `pair` of w (P planes): y[m0 + r, 16 * pair + 0 .. cols), rows y_stride apart.
template <int64_t P, int64_t R>
void pair_tile(const QuantizedRows& xq, int64_t m0, const PackedBlocks& w, int64_t pair, float* y, int64_t y_stride,
               int64_t cols) {
  const int64_t k = xq.k, groups = k / kGroup;
  const PairBlocks blocks(w, pair, P);
  const float* x_scales = xq.scales + m0 * groups;
  const float* x_sums = xq.sums + m0 * groups;
  const int32_t* x_totals = xq.totals + m0 * groups;
  const int8_t* x = xq.row(m0);
  __m512 acc[R];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // The next pair's group g (quant_tiles.h's prefetch_bytes): blocks 2 and 3 past block0.
    prefetch_bytes(blocks.block0 + (2 * groups + g) * P * kPlaneBytes, P * kPlaneBytes);
    prefetch_bytes(blocks.block0 + (3 * groups + g) * P * kPlaneBytes, P * kPlaneBytes);
    const int8_t* xg = x + g * kGroup;
    __m512i sums[R];
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int64_t c = 0; c < 4; ++c) {
      __m512i first, second;
      pair_chunk<P, false>(blocks, g, c, first, second);
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        int32_t x_first, x_second;
        std::memcpy(&x_first, xg + r * k + 4 * c, 4);
        std::memcpy(&x_second, xg + r * k + 16 + 4 * c, 4);
        sums[r] = _mm512_dpbusd_epi32(sums[r], first, _mm512_set1_epi32(x_first));
        sums[r] = _mm512_dpbusd_epi32(sums[r], second, _mm512_set1_epi32(x_second));
      }
    }
    const __m512 scale = pair_table(blocks.scales0, blocks.scales1, g);
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      __m512i dot = sums[r];
      if constexpr (P == 2) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * x_totals[r * groups + g]));
      const __m512 row_scale = _mm512_mul_ps(scale, _mm512_set1_ps(x_scales[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), row_scale, acc[r]);
    }
    if constexpr (P == 1) {
      const __m512 min = pair_table(blocks.mins0, blocks.mins1, g);
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(x_sums[r * groups + g]), acc[r]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * y_stride, keep, acc[r]);
}

#endif  // LADLE_QUANT_AVX512

#ifdef LADLE_QUANT_AMX

// The tile registers' shapes (palette 1): tmm0-3 the int32 sums [16][16] of four groups in flight; tmm4, tmm5 x's
// rows [16][32 bytes]; tmm6, tmm7 a group of the weight [8][64 bytes]. Configured for the calling thread while in
// scope.
class AmxScope {
 public:
  AmxScope() {
    alignas(64) uint8_t config[64] = {};
    config[0] = 1;  // palette
    auto shape = [&](int tile, uint16_t bytes_per_row, uint8_t rows) {
      std::memcpy(config + 16 + 2 * tile, &bytes_per_row, 2);
      config[48 + tile] = rows;
    };
    for (int tile = 0; tile < 4; ++tile) shape(tile, 64, 16);
    shape(4, 32, 16);
    shape(5, 32, 16);
    shape(6, 64, 8);
    shape(7, 64, 8);
    // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of `config` (its asm's "m" operand), so the
    // shapes' stores above may be dropped as dead (seen: an out-of-line copy of this constructor loading zero
    // shapes, which faults); the clobber makes every store land first.
    asm volatile("" : : "r"(config) : "memory");
    _tile_loadconfig(config);
  }
  ~AmxScope() { _tile_release(); }
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;
};

// Unpacks pair `pair` of a P-plane packed weight into AMX's layout.
template <int64_t P>
void unpack_pair(const PackedBlocks& w, int64_t pair, UnpackedPair& out) {
  const PairBlocks blocks(w, pair, P);
  for (int64_t g = 0; g < out.groups; ++g) {
    int8_t* rows = out.weights + g * kAmxGroupBytes;
    for (int64_t c = 0; c < 4; ++c) {
      __m512i first, second;
      pair_chunk<P, true>(blocks, g, c, first, second);
      _mm512_store_si512(rows + c * 64, first);
      _mm512_store_si512(rows + (4 + c) * 64, second);
    }
    _mm512_store_ps(out.scales + g * kAmxCols, pair_table(blocks.scales0, blocks.scales1, g));
    _mm512_store_ps(out.mins + g * kAmxCols, pair_table(blocks.mins0, blocks.mins1, g));
  }
}

// Group g's sums (`sums`, [16][16], stored from its tile) scaled into the rows' accumulators: `block_tile`'s float
// steps. Full: all 16 rows.
template <int64_t P, bool Full>
inline void scale_group(const int32_t* sums, const UnpackedPair& w, int64_t g, const float* x_scales,
                        const float* x_sums, int64_t groups, int64_t rows, __m512 (&acc)[kAmxRows]) {
  const __m512 scale = _mm512_load_ps(w.scales + g * kAmxCols);
  const __m512 min = _mm512_load_ps(w.mins + g * kAmxCols);
#pragma GCC unroll 16
  for (int64_t r = 0; r < kAmxRows; ++r) {
    if (!Full && r >= rows) break;
    const __m512 row_scale = _mm512_mul_ps(scale, _mm512_set1_ps(x_scales[r * groups + g]));
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(sums + r * kAmxCols));
    acc[r] = _mm512_fmadd_ps(dot, row_scale, acc[r]);
    if constexpr (P == 1) acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(x_sums[r * groups + g]), acc[r]);
  }
}

// Rows [m0, m0 + rows) (rows <= 16) of y for an unpacked pair: y[m0 + r, 0 .. cols) (cols <= 16), rows y_stride
// apart. Needs an AmxScope on this thread, and xq readable 16 rows from m0 (kTailRows). Four groups are in flight:
// two tiles' products run while the two before them are scaled, group after group in order.
template <int64_t P, bool Full>
void amx_tile(const QuantizedRows& xq, int64_t m0, int64_t rows, const UnpackedPair& w, float* y,
              int64_t y_stride, int64_t cols) {
  const int64_t k = xq.k, groups = k / kGroup;
  const float* x_scales = xq.scales + m0 * groups;
  const float* x_sums = xq.sums + m0 * groups;
  const int8_t* x = xq.row(m0);
  alignas(64) int32_t sums[kAmxRows * kAmxCols];
  __m512 acc[kAmxRows];
#pragma GCC unroll 16
  for (int64_t r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
// The tile intrinsics take their register numbers as literals (GCC pastes them into the instruction's text).
// Group g's product into tile C (x's rows through tile A, the weight's group through tile B):
#define LADLE_AMX_GROUP(C, A, B, g)                                     \
  do {                                                                  \
    _tile_zero(C);                                                      \
    _tile_loadd(A, x + (g) * kGroup, k);                                \
    _tile_loadd(B, w.weights + (g) * kAmxGroupBytes, 64);               \
    _tile_dpbssd(C, A, B);                                              \
  } while (0)
// and tile C's sums (group g) scaled into the accumulators:
#define LADLE_AMX_SCALE(C, g)                                                           \
  do {                                                                                  \
    _tile_stored(C, sums, 64);                                                          \
    scale_group<P, Full>(sums, w, g, x_scales, x_sums, groups, rows, acc);              \
  } while (0)
  LADLE_AMX_GROUP(0, 4, 6, 0);
  if (groups > 1) LADLE_AMX_GROUP(1, 5, 7, 1);
  for (int64_t g = 0; g < groups; g += 4) {
    if (g + 2 < groups) LADLE_AMX_GROUP(2, 4, 6, g + 2);
    if (g + 3 < groups) LADLE_AMX_GROUP(3, 5, 7, g + 3);
    LADLE_AMX_SCALE(0, g);
    if (g + 1 < groups) LADLE_AMX_SCALE(1, g + 1);
    if (g + 4 < groups) LADLE_AMX_GROUP(0, 4, 6, g + 4);
    if (g + 5 < groups) LADLE_AMX_GROUP(1, 5, 7, g + 5);
    if (g + 2 < groups) LADLE_AMX_SCALE(2, g + 2);
    if (g + 3 < groups) LADLE_AMX_SCALE(3, g + 3);
  }
#undef LADLE_AMX_GROUP
#undef LADLE_AMX_SCALE
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
#pragma GCC unroll 16
  for (int64_t r = 0; r < kAmxRows; ++r) {
    if (!Full && r >= rows) break;
    _mm512_mask_storeu_ps(y + r * y_stride, keep, acc[r]);
  }
}

#else  // without AMX: amx_enabled() is false and no tile is configured

class AmxScope {};

#endif  // LADLE_QUANT_AMX

#ifdef LADLE_QUANT_AVX512

constexpr bool kPairTiles = true;

// Whether a product of one row takes its blocks one at a time (the 256-bit VNNI tiles, the same bits) instead of
// in pairs. On AMD's Zen 5 one at a time is faster: a decode step of the Q4_K_M file 3.93 -> 3.49 ms, its Q8 LM
// head 0.77 -> 0.59 ms (a 2-core VM, 3 alternating runs; the pair's two interleaved block streams and lane inserts
// cost more there than the wider multiply saves). On the Intel Xeon of earlier stops the pairs were measured faster
// for short runs of rows (the experts', docs/performance.md), so they stay there.
inline bool single_blocks_for_one_row() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

// Rows [first, last) of y for output features [16 * pair, 16 * pair + 16) of `w` (P planes): with `scratch` (AMX on,
// an AmxScope on this thread) and kAmxMinRows rows or more, the pair unpacked into it and run through AMX tiles;
// otherwise through pair_tile, 8 rows at a time. y points at row 0, feature 0; rows y_stride apart.
template <int64_t P>
void pair_rows(const QuantizedRows& xq, int64_t first, int64_t last, const PackedBlocks& w, int64_t pair,
               UnpackedPair* scratch, float* y, int64_t y_stride) {
  const int64_t b = 2 * pair, cols = std::min(kAmxCols, w.n_rows - b * kBlock);
  float* columns = y + b * kBlock;
#ifdef LADLE_QUANT_AMX
  if (scratch != nullptr && last - first >= kAmxMinRows) {
    unpack_pair<P>(w, pair, *scratch);
    for (int64_t m0 = first; m0 < last; m0 += kAmxRows) {
      float* out = columns + m0 * y_stride;
      if (last - m0 >= kAmxRows) {
        amx_tile<P, true>(xq, m0, kAmxRows, *scratch, out, y_stride, cols);
      } else {
        amx_tile<P, false>(xq, m0, last - m0, *scratch, out, y_stride, cols);
      }
    }
    return;
  }
#endif
  for (int64_t m0 = first; m0 < last; m0 += kPairRows) {
    with_rows<kPairRows>(std::min(kPairRows, last - m0), [&](auto rows) {
      pair_tile<P, decltype(rows)::value>(xq, m0, w, pair, columns + m0 * y_stride, y_stride, cols);
    });
  }
}

#else  // without AVX-512 the callers take block_tile's paths and never reach this

constexpr bool kPairTiles = false;

inline bool single_blocks_for_one_row() { return true; }  // there are no pairs

template <int64_t P>
void pair_rows(const QuantizedRows&, int64_t, int64_t, const PackedBlocks&, int64_t, UnpackedPair*, float*, int64_t) {
  TORCH_CHECK(false, "built without AVX-512");
}

#endif  // LADLE_QUANT_AVX512

}  // namespace ladle_quant
