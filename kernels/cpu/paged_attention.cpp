// Decode attention over the paged KV cache for the CPU path: one pass over each row's blocks, no gather.
//
// Contract (see kernels/reference.py `paged_attention` and engine_server/attention.py):
//   q            [B, H, D] float32, contiguous: the one new token of each decode row
//   kv_cache     [2, num_blocks, block_size, Hkv, D] float32, contiguous (this step's K/V already written)
//   block_tables [B, W] int32: row b's token p lives in block block_tables[b][p / block_size]
//   seq_lens     [B] int32: row b attends to positions [0, seq_lens[b])
//   window       a sliding window > 0 narrows that to [seq_lens[b] - window, seq_lens[b]); 0: none
//   softcap      > 0: each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2); 0: none
//   returns      [B, H, D]: out[b, h] = softmax(scale * q[b, h] . K[j]) @ V[j] over the row's positions j,
//                K/V from KV head h / (H / Hkv).
// Consecutive rows with the same block table (one sequence's tokens of a step: a prompt chunk, or a decode's last
// token and its drafts) are attended together, reading each key and value once for all of them; work is split
// over such groups with at::parallel_for. Within a group the positions go by tiles that stay in L1 while every
// row and query head goes over them (`attend`), straight from the blocks, with the next tile's slots prefetched;
// scores eight keys at a time, value sums in registers, groups dealt to the threads round-robin. On AVX-512 two
// rows of a group go side by side through the same 8-float arithmetic in one 16-float register (a prompt chunk's
// scores and value sums take half the instructions). A row's result is the same bits whichever rows share its
// group, and whatever the tiling or pairing. Softmax is exact (max subtracted,
// float32 sums); exp is a polynomial with ~1e-7 relative error, so results match the reference SDPA to float32
// rounding, not bit for bit. Built with -fopenmp, so at::parallel_for uses torch's own OpenMP thread pool (the
// extension resolves libgomp.so.1 to the copy torch already loaded).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "ops.h"
#include "vec.h"

namespace {

using namespace ladle_cpu;

// Prefetches the `bytes` of one cache slot (all KV heads of a token) into cache, a line at a time.
inline void prefetch_slot(const float* slot, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(slot);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

// The most rows of one sequence attended together: their scores (rows x heads x context floats) stay in cache.
constexpr int64_t kMaxGroup = 16;

// Softmax in place over one row's scores s[first, len), whose largest is `m` (taken as the scores were), read in
// whole vectors from the one holding `first`: the lanes before `first` and from `len` to the vector's end are set
// to -inf first (exp turns them into 0).
inline void softmax_row(float* s, int64_t first, int64_t len, float m) {
  const int64_t aligned = first / kLanes * kLanes;
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
  for (int64_t t = aligned; t < first; ++t) s[t] = -__builtin_inff();
  for (int64_t t = len; t < padded; ++t) s[t] = -__builtin_inff();
  vec16 total = {};
  for (int64_t t = aligned; t < padded; t += kLanes) {
    const vec16 e = exp_lanes(load(s + t) - m);
    store(s + t, e);
    total += e;
  }
  const float inv = 1.f / hsum(total);
  for (int64_t t = first; t < len; ++t) s[t] *= inv;
}

// The dot products and value sums run in 8-float vectors with separate multiplies and adds: the bits the engine
// has always had. (16-float vectors and fused multiply-adds on AVX-512 made a long prompt's attention ~20% faster,
// but their other bits flipped the embedded model's greedy answer to "What is the capital of France?".)

// scale * (q . k) for one query head against one key: the chunks' products summed chunk by chunk into one vector,
// whose lanes hsum8 adds up; soft-capped to softcap * tanh(s / softcap) when softcap > 0.
template <int64_t Chunks>
inline float score(const float* qh, const float* k, float scale, float softcap) {
  vec8 dot = load8(qh) * load8(k);
  for (int64_t c = 1; c < Chunks; ++c) dot += load8(qh + c * kLanes8) * load8(k + c * kLanes8);
  const float s = hsum8(dot) * scale;
  return softcap > 0.f ? softcap * std::tanh(s / softcap) : s;
}

// hsum8 of each of eight vectors, as one vector (lane j: hsum8(v[j])): the same additions of the same operands as
// hsum8's tree, ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)), eight lanes at a time, so every lane has the
// bits hsum8 gives (float addition commutes; the tree's shape is what fixes the result).
inline vec8 hsum8_of_8(const vec8 (&v)[8]) {
  // a = v_i + v_(i+4) for i < 4: vectors j and j + 4 side by side.
  vec8 a[4];
  for (int64_t j = 0; j < 4; ++j) {
    a[j] = __builtin_shuffle(v[j], v[j + 4], ivec8{0, 1, 2, 3, 8, 9, 10, 11}) +
           __builtin_shuffle(v[j], v[j + 4], ivec8{4, 5, 6, 7, 12, 13, 14, 15});
  }
  // b0 = a0 + a2, b1 = a1 + a3: [v0's, v0's, v1's, v1's, v4's, v4's, v5's, v5's] from a[0], a[1]; v2.. from a[2..3].
  const vec8 b01 = __builtin_shuffle(a[0], a[1], ivec8{0, 1, 8, 9, 4, 5, 12, 13}) +
                   __builtin_shuffle(a[0], a[1], ivec8{2, 3, 10, 11, 6, 7, 14, 15});
  const vec8 b23 = __builtin_shuffle(a[2], a[3], ivec8{0, 1, 8, 9, 4, 5, 12, 13}) +
                   __builtin_shuffle(a[2], a[3], ivec8{2, 3, 10, 11, 6, 7, 14, 15});
  // b0 + b1, in the order v0, v1, v2, v3, v4, v5, v6, v7.
  return __builtin_shuffle(b01, b23, ivec8{0, 2, 8, 10, 4, 6, 12, 14}) +
         __builtin_shuffle(b01, b23, ivec8{1, 3, 9, 11, 5, 7, 13, 15});
}

// score() of one query head against eight keys at once, into out[0..8): each key's products summed as score()
// sums them, the eight sums reduced together (hsum8_of_8), then scaled (and capped) lane by
// lane: out[j] has the bits score(qh, key[j] + offset) has.
template <int64_t Chunks>
inline void scores8(const float* qh, const float* const* key, int64_t offset, float scale, float softcap,
                    float* out, float& most) {
  vec8 dot[8];
  const vec8 q0 = load8(qh);
#pragma GCC unroll 8
  for (int64_t j = 0; j < 8; ++j) dot[j] = q0 * load8(key[j] + offset);
  for (int64_t c = 1; c < Chunks; ++c) {
    const vec8 qc = load8(qh + c * kLanes8);
#pragma GCC unroll 8
    for (int64_t j = 0; j < 8; ++j) dot[j] += qc * load8(key[j] + offset + c * kLanes8);
  }
  const vec8 s = hsum8_of_8(dot) * scale;
  if (softcap > 0.f) {
    for (int64_t j = 0; j < 8; ++j) {
      out[j] = softcap * std::tanh(s[j] / softcap);
      most = std::max(most, out[j]);
    }
  } else {
    store8(out, s);
    for (int64_t j = 0; j < 8; ++j) most = std::max(most, s[j]);
  }
}

// Value sums of `Heads` query heads (of one KV head) over positions [lo, hi): sums[i][0 .. N * lanes) += weight
// * value for each position in order, weights[i][t] the head's softmax weight and slot[t] + at its value's
// chunks. Each head's sums take the very operations, in the same order, that it would alone.
template <int64_t N, int64_t Heads>
inline void sum_values(const float* const* slot, int64_t at, int64_t lo, int64_t hi, const float* const* weights,
                       float* const* sums) {
  vec8 sum[Heads][N];
#pragma GCC unroll 4
  for (int64_t i = 0; i < Heads; ++i) {
#pragma GCC unroll 8
    for (int64_t c = 0; c < N; ++c) sum[i][c] = load8(sums[i] + c * kLanes8);
  }
  for (int64_t t = lo; t < hi; ++t) {
    const float* v = slot[t] + at;
    vec8 value[N];
#pragma GCC unroll 8
    for (int64_t c = 0; c < N; ++c) value[c] = load8(v + c * kLanes8);
#pragma GCC unroll 4
    for (int64_t i = 0; i < Heads; ++i) {
      const vec8 weight = vec8{} + weights[i][t];
#pragma GCC unroll 8
      for (int64_t c = 0; c < N; ++c) sum[i][c] += weight * value[c];
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < Heads; ++i) {
#pragma GCC unroll 8
    for (int64_t c = 0; c < N; ++c) store8(sums[i] + c * kLanes8, sum[i][c]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// On AVX-512, two rows of one sequence (the same query head, so the same keys and values) go through the same
// 8-float arithmetic side by side in one 16-float register: row a in lanes 0-7, row b in lanes 8-15. Every lane
// takes the very operations, on the very operands, it takes in the 8-float code, so each row keeps its bits;
// the two rows share each instruction, which halves the multiplies and adds of a prompt chunk's attention.
#define LADLE_PAIRED_ROWS 1

// Lanes 0-7 from a, 8-15 from b.
inline vec16 pair_of(const float* a, const float* b) {
  return reinterpret_cast<vec16>(_mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1));
}

// The 8 floats at p in both halves.
inline vec16 both_halves(const float* p) { return reinterpret_cast<vec16>(_mm512_broadcast_f32x8(_mm256_loadu_ps(p))); }

// a in lanes 0-7, b in 8-15.
inline vec16 pair_splat(float a, float b) {
  return reinterpret_cast<vec16>(_mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1));
}

inline vec8 low_half(vec16 v) { return reinterpret_cast<vec8>(_mm512_castps512_ps256(reinterpret_cast<__m512>(v))); }
inline vec8 high_half(vec16 v) {
  return reinterpret_cast<vec8>(_mm512_extractf32x8_ps(reinterpret_cast<__m512>(v), 1));
}

// hsum8_of_8 in each half: the shuffles of hsum8_of_8 with their lane indices moved into the half (an index i < 8
// of the first source is 8h + i, an index 8 + i of the second is 16 + 8h + i), so each half's lanes get the very
// additions of the very operands hsum8_of_8 makes.
inline vec16 hsum8_of_8_halves(const vec16 (&v)[8]) {
  vec16 a[4];
  for (int64_t j = 0; j < 4; ++j) {
    a[j] = __builtin_shuffle(v[j], v[j + 4], ivec16{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
           __builtin_shuffle(v[j], v[j + 4], ivec16{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  }
  const vec16 b01 = __builtin_shuffle(a[0], a[1], ivec16{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
                    __builtin_shuffle(a[0], a[1], ivec16{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  const vec16 b23 = __builtin_shuffle(a[2], a[3], ivec16{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
                    __builtin_shuffle(a[2], a[3], ivec16{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  return __builtin_shuffle(b01, b23, ivec16{0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30}) +
         __builtin_shuffle(b01, b23, ivec16{1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31});
}

// scores8 for two rows at once: qpair[c] holds chunk c of both rows' query head (pair_of); out_a[0..8) and
// out_b[0..8) get the bits scores8 gives each row, their largest folded into most (lanes 0-7: a's, 8-15: b's).
template <int64_t Chunks>
inline void scores8_pair(const vec16* qpair, const float* const* key, int64_t offset, float scale, float softcap,
                         float* out_a, float* out_b, vec16& most) {
  vec16 dot[8];
#pragma GCC unroll 8
  for (int64_t j = 0; j < 8; ++j) dot[j] = qpair[0] * both_halves(key[j] + offset);
  for (int64_t c = 1; c < Chunks; ++c) {
    const vec16 qc = qpair[c];
#pragma GCC unroll 8
    for (int64_t j = 0; j < 8; ++j) dot[j] += qc * both_halves(key[j] + offset + c * kLanes8);
  }
  vec16 s = hsum8_of_8_halves(dot) * scale;
  if (softcap > 0.f) {
    for (int64_t j = 0; j < kLanes; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
  }
  store8(out_a, low_half(s));
  store8(out_b, high_half(s));
  most = most > s ? most : s;
}

// sum_values for two rows at once over positions [lo, hi) (which both attend to): sums_a[i] / sums_b[i] and
// weights_a[i] / weights_b[i] are head i's of row a and row b; each row's sums take the operations sum_values
// makes, in the same order.
template <int64_t N, int64_t Heads>
inline void sum_values_pair(const float* const* slot, int64_t at, int64_t lo, int64_t hi,
                            const float* const* weights_a, const float* const* weights_b, float* const* sums_a,
                            float* const* sums_b) {
  vec16 sum[Heads][N];
#pragma GCC unroll 4
  for (int64_t i = 0; i < Heads; ++i) {
#pragma GCC unroll 8
    for (int64_t c = 0; c < N; ++c) sum[i][c] = pair_of(sums_a[i] + c * kLanes8, sums_b[i] + c * kLanes8);
  }
  for (int64_t t = lo; t < hi; ++t) {
    const float* v = slot[t] + at;
    vec16 value[N];
#pragma GCC unroll 8
    for (int64_t c = 0; c < N; ++c) value[c] = both_halves(v + c * kLanes8);
#pragma GCC unroll 4
    for (int64_t i = 0; i < Heads; ++i) {
      const vec16 weight = pair_splat(weights_a[i][t], weights_b[i][t]);
#pragma GCC unroll 8
      for (int64_t c = 0; c < N; ++c) sum[i][c] += weight * value[c];
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < Heads; ++i) {
#pragma GCC unroll 8
    for (int64_t c = 0; c < N; ++c) {
      store8(sums_a[i] + c * kLanes8, low_half(sum[i][c]));
      store8(sums_b[i] + c * kLanes8, high_half(sum[i][c]));
    }
  }
}
#endif

// Positions whose slots one pass over the keys (or the values) holds: 32 tokens' K or V of every KV head stays in
// L1 while each row and head of the group goes over them.
constexpr int64_t kKeyTile = 32;
// Accumulator vectors a head's value sum keeps in registers over a tile's positions (64 or 128 floats of its dim).
constexpr int64_t kAccChunks = 8;
template <int64_t Dim>
constexpr int64_t sum_chunks() { return Dim / kLanes8 < kAccChunks ? Dim / kLanes8 : kAccChunks; }
// Query heads whose value sums run together: as many as keep their accumulators within half the registers (16
// of AVX-512's 32, 8 of AVX2's 16), at most kMaxSumHeads.
constexpr int64_t kMaxSumHeads = 4;
#ifdef __AVX512F__
constexpr int64_t kSumRegisters = 16;
#else
constexpr int64_t kSumRegisters = 8;
#endif
template <int64_t Dim>
constexpr int64_t kSumHeads = std::max<int64_t>(1, std::min<int64_t>(kMaxSumHeads, kSumRegisters / sum_chunks<Dim>()));
#ifdef LADLE_PAIRED_ROWS
// Query heads whose value sums run together for a pair of rows (sum_values_pair): one or two.
template <int64_t Dim>
constexpr int64_t kPairSumHeads = std::min<int64_t>(2, kSumHeads<Dim>);
#endif

// Rows [0, rows) that share one block table (a sequence's tokens of this step: prompt tokens, or a decode's last
// token and its drafts), row r's query heads at q + r * heads * Dim against positions [first_r, lens[r]) of the
// paged K/V (first_r = max(0, lens[r] - window) with a window, else 0), written to out + r * heads * Dim.
// Positions go by tiles of kKeyTile: each tile's keys are read from the blocks once for all the rows and heads
// (a row alone would read the sequence's whole cache once per row), their scores taken eight keys at a time; the
// same for the values, each head's sum held in registers across the tile. Each row's arithmetic is the single
// row's, in the same order, whatever the tiling: each score as score() computes it, softmax_row, then values
// summed in position order from zero; so a row's result is the same bits in any group, alone included (the build
// has -ffp-contract=off: no fused multiply-adds that could differ).
// `scores` has room for rows * heads * padded(max len) floats, `acc` for rows * heads * (Dim + 1).
template <int64_t Dim>
void attend(const float* q, const float* keys, const float* values, const int32_t* table, const int32_t* lens,
            int64_t rows, int64_t block_size, int64_t kv_heads, int64_t group, int64_t window, float scale,
            float softcap, float* scores, float* acc, float* out) {
  constexpr int64_t chunks = Dim / kLanes8;
  const int64_t token_stride = kv_heads * Dim;
  const int64_t slot_bytes = token_stride * static_cast<int64_t>(sizeof(float));
  const int64_t heads = kv_heads * group;
  auto first_of = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, lens[r] - window) : int64_t{0}; };
  int64_t len = 0, begin = lens[0];
  for (int64_t r = 0; r < rows; ++r) {
    len = std::max<int64_t>(len, lens[r]);
    begin = std::min(begin, first_of(r));
  }
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
  auto row_scores = [&](int64_t r, int64_t h) { return scores + (r * heads + h) * padded; };
  // use(t, offset of position t's slot) for t in [from, to): one division for the run, the block and the place in
  // it stepped along after that (a division per position cost a decode row more than its scores).
  auto each_slot = [&](int64_t from, int64_t to, auto&& use) {
    int64_t block = from / block_size, place = from - block * block_size;
    for (int64_t t = from; t < to; ++t) {
      use(t, (table[block] * block_size + place) * token_stride);
      if (++place == block_size) place = 0, ++block;
    }
  };
  auto prefetch_tile = [&](const float* base, int64_t from) {
    each_slot(from, std::min(len, from + kKeyTile), [&](int64_t, int64_t at) { prefetch_slot(base + at, slot_bytes); });
  };
  const float* tile[kKeyTile];
  // The tile's slots (every KV head of a token) in `base`, with the next tile's prefetched: a row's blocks sit
  // anywhere in the cache, out of the hardware prefetchers' sight.
  auto load_tile = [&](const float* base, int64_t from, int64_t to) {
    each_slot(from, to, [&](int64_t t, int64_t at) { tile[t - from] = base + at; });
    prefetch_tile(base, to);
  };
  prefetch_tile(keys, begin);
  float* maxes = acc + rows * heads * Dim;  // each row and head's largest score, taken as they are written
  std::fill(maxes, maxes + rows * heads, -__builtin_inff());

  int64_t t0 = begin, t1 = begin;  // the tile in hand, [t0, t1)
  // Row r's scores of head h over [from, to) of the tile, as score() computes each.
  auto score_row = [&](int64_t r, int64_t h, int64_t from, int64_t to) {
    const float* qh = q + (r * heads + h) * Dim;
    const int64_t offset = (h / group) * Dim;
    float* s = row_scores(r, h);
    float& most = maxes[r * heads + h];
    int64_t t = from;
    for (; t + 8 <= to; t += 8) scores8<chunks>(qh, tile + (t - t0), offset, scale, softcap, s + t, most);
    for (; t < to; ++t) {
      s[t] = score<chunks>(qh, tile[t - t0] + offset, scale, softcap);
      most = std::max(most, s[t]);
    }
  };
  // The tile's positions row r attends to.
  auto tile_range = [&](int64_t r) {
    return std::pair<int64_t, int64_t>{std::max(t0, first_of(r)), std::min<int64_t>(t1, lens[r])};
  };
  for (; t0 < len; t0 += kKeyTile) {
    t1 = std::min(len, t0 + kKeyTile);
    load_tile(keys, t0, t1);
    for (int64_t r = 0; r < rows;) {
      const auto [lo_a, hi_a] = tile_range(r);
#ifdef LADLE_PAIRED_ROWS
      if (r + 1 < rows) {
        // Rows r and r + 1 side by side over the 8-key blocks both attend to, each alone over the rest.
        const auto [lo_b, hi_b] = tile_range(r + 1);
        const int64_t lo = std::max(lo_a, lo_b), hi = std::min(hi_a, hi_b);
        const int64_t paired_end = lo < hi ? lo + (hi - lo) / 8 * 8 : lo;
        for (int64_t h = 0; h < heads; ++h) {
          float* s_a = row_scores(r, h);
          float* s_b = row_scores(r + 1, h);
          if (paired_end > lo) {
            const float* q_a = q + (r * heads + h) * Dim;
            const float* q_b = q_a + heads * Dim;
            vec16 qpair[chunks];
            for (int64_t c = 0; c < chunks; ++c) qpair[c] = pair_of(q_a + c * kLanes8, q_b + c * kLanes8);
            vec16 most = splat(-__builtin_inff());
            const int64_t offset = (h / group) * Dim;
            for (int64_t t = lo; t < paired_end; t += 8) {
              scores8_pair<chunks>(qpair, tile + (t - t0), offset, scale, softcap, s_a + t, s_b + t, most);
            }
            float most_a = maxes[r * heads + h], most_b = maxes[(r + 1) * heads + h];
            for (int64_t j = 0; j < kLanes8; ++j) {
              most_a = std::max(most_a, most[j]);
              most_b = std::max(most_b, most[kLanes8 + j]);
            }
            maxes[r * heads + h] = most_a;
            maxes[(r + 1) * heads + h] = most_b;
          }
          score_row(r, h, lo_a, std::min(lo, hi_a));
          score_row(r, h, std::max(paired_end, lo_a), hi_a);
          score_row(r + 1, h, lo_b, std::min(lo, hi_b));
          score_row(r + 1, h, std::max(paired_end, lo_b), hi_b);
        }
        r += 2;
        continue;
      }
#endif
      for (int64_t h = 0; h < heads; ++h) score_row(r, h, lo_a, hi_a);
      r += 1;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) softmax_row(row_scores(r, h), first_of(r), lens[r], maxes[r * heads + h]);
  }
  std::fill(acc, acc + rows * heads * Dim, 0.f);
  prefetch_tile(values, begin);
  // Row r's value sums of heads [h0, h0 + count) (of one KV head), chunks from c0, over positions [from, to).
  auto sum_row = [&](int64_t r, int64_t h0, int64_t count, int64_t c0, int64_t from, int64_t to) {
    if (from >= to) return;
    const float* weights[kMaxSumHeads];
    float* sums[kMaxSumHeads];
    for (int64_t i = 0; i < count; ++i) {
      weights[i] = row_scores(r, h0 + i);
      sums[i] = acc + (r * heads + h0 + i) * Dim + c0 * kLanes8;
    }
    const float* const* base = tile - t0;
    const int64_t at = (h0 / group) * Dim + c0 * kLanes8;
    switch (count) {
      case 1: sum_values<sum_chunks<Dim>(), 1>(base, at, from, to, weights, sums); break;
      case 2: sum_values<sum_chunks<Dim>(), 2>(base, at, from, to, weights, sums); break;
      case 3: sum_values<sum_chunks<Dim>(), 3>(base, at, from, to, weights, sums); break;
      default: sum_values<sum_chunks<Dim>(), 4>(base, at, from, to, weights, sums); break;
    }
  };
#ifdef LADLE_PAIRED_ROWS
  // sum_row for rows r and r + 1 side by side over [from, to), which both attend to.
  auto sum_pair = [&](int64_t r, int64_t h0, int64_t count, int64_t c0, int64_t from, int64_t to) {
    const float* weights_a[kMaxSumHeads];
    const float* weights_b[kMaxSumHeads];
    float* sums_a[kMaxSumHeads];
    float* sums_b[kMaxSumHeads];
    for (int64_t i = 0; i < count; ++i) {
      weights_a[i] = row_scores(r, h0 + i);
      weights_b[i] = row_scores(r + 1, h0 + i);
      sums_a[i] = acc + (r * heads + h0 + i) * Dim + c0 * kLanes8;
      sums_b[i] = sums_a[i] + heads * Dim;
    }
    const float* const* base = tile - t0;
    const int64_t at = (h0 / group) * Dim + c0 * kLanes8;
    if (count == 1) {
      sum_values_pair<sum_chunks<Dim>(), 1>(base, at, from, to, weights_a, weights_b, sums_a, sums_b);
    } else {
      sum_values_pair<sum_chunks<Dim>(), 2>(base, at, from, to, weights_a, weights_b, sums_a, sums_b);
    }
  };
#endif
  for (t0 = begin; t0 < len; t0 += kKeyTile) {
    t1 = std::min(len, t0 + kKeyTile);
    load_tile(values, t0, t1);
    for (int64_t r = 0; r < rows;) {
      const auto [lo_a, hi_a] = tile_range(r);
      // The query heads of one KV head a few at a time, sharing each value's loads (and giving the adds enough
      // independent sums to overlap).
#ifdef LADLE_PAIRED_ROWS
      if (r + 1 < rows) {
        // Each row's positions in order: its own before the shared ones, the shared ones side by side, its own
        // after them.
        const auto [lo_b, hi_b] = tile_range(r + 1);
        const int64_t lo = std::max(lo_a, lo_b), hi = std::min(hi_a, hi_b);
        for (int64_t h0 = 0, count = 0; h0 < heads; h0 += count) {
          count = std::min({kPairSumHeads<Dim>, heads - h0, group - h0 % group});
          for (int64_t c0 = 0; c0 < chunks; c0 += kAccChunks) {
            if (lo < hi) {
              sum_row(r, h0, count, c0, lo_a, lo);
              sum_row(r + 1, h0, count, c0, lo_b, lo);
              sum_pair(r, h0, count, c0, lo, hi);
              sum_row(r, h0, count, c0, hi, hi_a);
              sum_row(r + 1, h0, count, c0, hi, hi_b);
            } else {
              sum_row(r, h0, count, c0, lo_a, hi_a);
              sum_row(r + 1, h0, count, c0, lo_b, hi_b);
            }
          }
        }
        r += 2;
        continue;
      }
#endif
      for (int64_t h0 = 0, count = 0; h0 < heads; h0 += count) {
        count = std::min({kSumHeads<Dim>, heads - h0, group - h0 % group});
        for (int64_t c0 = 0; c0 < chunks; c0 += kAccChunks) sum_row(r, h0, count, c0, lo_a, hi_a);
      }
      r += 1;
    }
  }
  std::copy(acc, acc + rows * heads * Dim, out);
}

using AttendFn = void (*)(const float*, const float*, const float*, const int32_t*, const int32_t*, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, float, float*, float*, float*);

// The rows' groups: runs of consecutive rows with the same block table, cut to at most `most` rows each.
std::vector<std::pair<int64_t, int64_t>> row_groups(const int32_t* tables, int64_t rows, int64_t width,
                                                    int64_t most) {
  std::vector<std::pair<int64_t, int64_t>> groups;
  for (int64_t begin = 0; begin < rows;) {
    int64_t end = begin + 1;
    while (end < rows && end - begin < most &&
           std::equal(tables + end * width, tables + (end + 1) * width, tables + begin * width)) {
      ++end;
    }
    groups.emplace_back(begin, end);
    begin = end;
  }
  return groups;
}

AttendFn attend_for(int64_t dim) {
  switch (dim) {
    case 16: return attend<16>;
    case 32: return attend<32>;
    case 64: return attend<64>;
    case 128: return attend<128>;
    case 256: return attend<256>;
    default: return nullptr;
  }
}

}  // namespace

namespace ladle_cpu {

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be [B, H, D] float32");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.scalar_type() == at::kFloat &&
                  kv_cache.is_contiguous(),
              "kv_cache must be [2, num_blocks, block_size, Hkv, D] float32, contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be [B, W] int32");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt, "seq_lens must be [B] int32");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  const int64_t width = block_tables.size(1);
  TORCH_CHECK(kv_cache.size(4) == dim, "head dim of q and kv_cache differ");
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  const AttendFn attend_fn = attend_for(dim);
  LADLE_CHECK(attend_fn != nullptr, "head dim %lld is not one of 16, 32, 64, 128, 256", static_cast<long long>(dim));
  TORCH_CHECK(block_tables.size(0) == rows && seq_lens.size(0) == rows, "one block table and length per row");
  const at::Tensor lens = seq_lens.contiguous();
  const int32_t* lens_ptr = lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lens_ptr[r] >= 1 && lens_ptr[r] <= width * block_size, "seq_lens out of the block table's range");
    for (int64_t i = 0; i < (lens_ptr[r] + block_size - 1) / block_size; ++i) {
      const int32_t block = tables[r * width + i];
      LADLE_CHECK(block >= 0 && block < num_blocks, "block id %d outside the cache", block);
    }
  }
  const int64_t group = heads / kv_heads;
  at::Tensor out = at::empty({rows, heads, dim}, q.options());
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = kv_cache.data_ptr<float>();
  const float* v_ptr = k_ptr + num_blocks * block_size * kv_heads * dim;
  float* out_ptr = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), fsoftcap = static_cast<float>(softcap);

  // Room for the longest row's scores (not the block table's width: a step's tables are as wide as its longest
  // sequence's, or wider).
  const int64_t longest = *std::max_element(lens_ptr, lens_ptr + rows);
  const int64_t max_padded = (longest + kLanes - 1) / kLanes * kLanes;
  // Rows of one sequence share their key and value reads (attend); a run of them is cut into enough groups to
  // give every thread work (a step's drafts), and none larger than kMaxGroup rows (a prompt's scores).
  int64_t longest_run = 1;
  for (const auto& run : row_groups(tables, rows, width, rows)) {
    longest_run = std::max(longest_run, run.second - run.first);
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t most = std::max<int64_t>(1, std::min(kMaxGroup, (longest_run + threads - 1) / threads));
  const auto groups = row_groups(tables, rows, width, most);
  // Groups dealt out round-robin: a prompt's groups are ordered by length (the last ones attend to the most
  // positions), so contiguous shares would give the last thread most of the work.
  const int64_t count_groups = static_cast<int64_t>(groups.size());
  const int64_t shares = std::min(threads, count_groups);
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    // Left uninitialised: attend writes every score and sum it reads.
    const std::unique_ptr<float[]> scores(new float[most * heads * max_padded]);
    const std::unique_ptr<float[]> acc(new float[most * heads * (dim + 1)]);
    for (int64_t share = begin; share < end; ++share) {
      for (int64_t g = share; g < count_groups; g += shares) {
        const int64_t first = groups[g].first, count = groups[g].second - groups[g].first;
        attend_fn(q_ptr + first * heads * dim, k_ptr, v_ptr, tables + first * width, lens_ptr + first, count,
                  block_size, kv_heads, group, window, fscale, fsoftcap, scores.get(), acc.get(),
                  out_ptr + first * heads * dim);
      }
    }
  });
  return out;
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "int window=0, float softcap=0.) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::paged_decode_attention));
}
