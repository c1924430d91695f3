// Decode attention over the paged KV cache for the CPU path: one pass over each row's blocks, no gather.
//
// Contract (see ladle_kernels/reference.py `paged_attention` and engine_server/attention.py):
//   q            [B, H, D] float32, contiguous: the one new token of each decode row
//   kv_cache     [2, num_blocks, block_size, Hkv, D] float32, contiguous (this step's K/V already written), or
//                an FP8 cache: uint8 [..., D + 4], rows of fp8_kv.h, each tile's rows decoded to float32 first
//                (the values ladle_kernels/reference.py `fp8_kv_values` gives: the same bits as a float32 cache of them)
//   block_tables [B, W] int32: row b's token p lives in block block_tables[b][p / block_size]
//   seq_lens     [B] int32: row b attends to positions [0, seq_lens[b])
//   window       a sliding window > 0 narrows that to [seq_lens[b] - window, seq_lens[b]); 0: none
//   softcap      > 0: each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2); 0: none
//   sinks        [H] float32 or none: head h's softmax has one more logit, sinks[h], whose weight is dropped
//                (gpt-oss's attention sinks): out[b, h] is scaled by Z / (Z + exp(sinks[h])), Z its sum of weights
//   alibi_slopes [H] float32 or none: ALiBi (BLOOM's, MPT's): each scaled score of position j plus
//                alibi_slopes[h] * (j - p), p = seq_lens[b] - 1 the row's own position (layers/alibi.py)
//   returns      [B, H, D]: out[b, h] = softmax(scale * q[b, h] . K[j]) @ V[j] over the row's positions j,
//                K/V from KV head h / (H / Hkv).
// Consecutive rows with the same block table (one sequence's tokens of a step: a prompt chunk, or a decode's last
// token and its drafts) are attended together, reading each key and value once for all of them; work is split
// over such groups with at::parallel_for, dealt to the threads round-robin. Positions go by tiles of kTile that
// start at multiples of kTile: each KV head's keys of a tile are transposed once (position across the lanes) and,
// with the tile's values, stay in L1 while every row and query head of the group goes over them, the next
// tile's slots prefetched. A row and head's arithmetic, the same in any group, alone included:
//   - score of position t: q . k_t as Dim fused multiply-adds from 0 in d order (one rounding each; 16 positions
//     per vector, several query heads' chains in flight), then times scale (and soft-capped);
//   - softmax online over the row's tiles (FlashAttention's): the running max, each tile's weights
//     exp(s - max), the running sum and the value sums rescaled when the max grows;
//   - value sums: acc += weight_t * v_t by fused multiply-adds in position order (dims across the lanes);
//   - out = acc * (1 / sum); with a sink s, taken against m = max(running max, s) (std::exp):
//     out = acc * (exp(max - m) / (sum * exp(max - m) + exp(s - m))).
// The fused multiply-adds are explicit (ladle_kernels/cpu/lanes.h: AVX-512, AVX2's FMA, else std::fma), so every x86
// gives the same bits; the build's -ffp-contract=off fuses nothing else. exp is a polynomial with ~1e-7 relative
// error, so results match the reference SDPA to float32 rounding, not bit for bit. Built with -fopenmp, so
// at::parallel_for uses torch's own OpenMP thread pool (the extension resolves libgomp.so.1 to the copy torch
// already loaded).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "fp8_kv.h"
#include "lanes.h"
#include "ops.h"
#include "vec.h"

namespace {

using namespace ladle_cpu;

// Prefetches the `bytes` of one cache slot (all KV heads of a token) into cache, a line at a time.
inline void prefetch_slot(const void* slot, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(slot);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

// The most rows of one sequence attended together: each tile's keys and values are read (and the keys transposed)
// once per group, so larger groups stream the cache fewer times (64 over 16: ~10% faster on a long prompt).
constexpr int64_t kMaxGroup = 64;
// Positions per tile (four vectors of scores per query head). Tiles start at multiples of kTile, so the tiles a row
// goes through depend on its own positions only.
constexpr int64_t kTile = 64;
constexpr int64_t kTileVectors = kTile / kLanes;
#ifdef __AVX512F__
constexpr int64_t kScoreHeads = 3;    // query heads scored together: 12 independent FMA chains, 12 of 32 zmm
constexpr int64_t kSumFloats = 256;   // value-sum accumulators held in registers (16 zmm)
constexpr int64_t kPassFloats = 128;  // a head's dims per value-sum pass (8 zmm)
#else
constexpr int64_t kScoreHeads = 1;  // a Lanes is two ymm on AVX2: 8 accumulators of 16
constexpr int64_t kSumFloats = 64;
constexpr int64_t kPassFloats = 32;
#endif
constexpr int64_t kMaxSumHeads = 4;

// One stage of an in-register transpose of W vectors of W lanes: for each pair (i, i + B) with bit B of i clear,
// the B x B blocks off the diagonal swap (lo / hi pick a's and c's lanes). After the stages B = W / 2, ..., 1,
// r[i][j] holds what r[j][i] held.
template <int64_t B, typename V, typename I, int64_t W>
inline void swap_blocks(V (&r)[W], I lo, I hi) {
#pragma GCC unroll 16
  for (int64_t i = 0; i < W; ++i) {
    if (i & B) continue;
    const V a = r[i], c = r[i | B];
    r[i] = __builtin_shuffle(a, c, lo);
    r[i | B] = __builtin_shuffle(a, c, hi);
  }
}

#ifdef __AVX512F__
using KeyVec = vec16;
constexpr int64_t kKeyLanes = 16;
inline void transpose(vec16 (&r)[16]) {
  swap_blocks<8>(r, ivec16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                 ivec16{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  swap_blocks<4>(r, ivec16{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                 ivec16{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  swap_blocks<2>(r, ivec16{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                 ivec16{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  swap_blocks<1>(r, ivec16{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
                 ivec16{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
}
#else
using KeyVec = vec8;
constexpr int64_t kKeyLanes = 8;
inline void transpose(vec8 (&r)[8]) {
  swap_blocks<4>(r, ivec8{0, 1, 2, 3, 8, 9, 10, 11}, ivec8{4, 5, 6, 7, 12, 13, 14, 15});
  swap_blocks<2>(r, ivec8{0, 1, 8, 9, 4, 5, 12, 13}, ivec8{2, 3, 10, 11, 6, 7, 14, 15});
  swap_blocks<1>(r, ivec8{0, 8, 2, 10, 4, 12, 6, 14}, ivec8{1, 9, 3, 11, 5, 13, 7, 15});
}
#endif

// One KV head's keys of a tile, position across the lanes: kt[d * kTile + t] = dim d of the key at `keys + at[t] +
// offset` for t < n, 0 for n <= t < kTile.
template <int64_t Dim>
void transpose_keys(const float* keys, const int64_t* at, int64_t offset, int64_t n, float* kt) {
  constexpr int64_t W = kKeyLanes;
  for (int64_t t0 = 0; t0 < kTile; t0 += W) {
    if (t0 >= n) {
      for (int64_t d = 0; d < Dim; ++d) std::fill(kt + d * kTile + t0, kt + d * kTile + t0 + W, 0.f);
      continue;
    }
    for (int64_t d0 = 0; d0 < Dim; d0 += W) {
      KeyVec r[W];
#pragma GCC unroll 16
      for (int64_t i = 0; i < W; ++i) {
        r[i] = t0 + i < n ? load_lanes<KeyVec>(keys + at[t0 + i] + offset + d0) : KeyVec{};
      }
      transpose(r);
#pragma GCC unroll 16
      for (int64_t j = 0; j < W; ++j) __builtin_memcpy(kt + (d0 + j) * kTile + t0, &r[j], sizeof(KeyVec));
    }
  }
}

// The tile's scores of B query heads: s[b][v] lane i is q_b . (the key of tile position v * kLanes + i), summed as
// Dim fused multiply-adds from 0 in d order. The B heads' chains run side by side; each lane's operations are its
// own, so a head's scores are the same bits in any batch.
template <int64_t Dim, int64_t B>
inline void tile_scores(const float* const* qs, const float* kt, Lanes (&s)[B][kTileVectors]) {
  Lanes acc[B][kTileVectors];  // in registers (s may alias the queries: written to once, at the end)
#pragma GCC unroll 4
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t v = 0; v < kTileVectors; ++v) acc[b][v] = lanes_zero();
  }
#pragma GCC unroll 4
  for (int64_t d = 0; d < Dim; ++d) {
    Lanes k[kTileVectors];
    for (int64_t v = 0; v < kTileVectors; ++v) k[v] = lanes_load(kt + d * kTile + v * kLanes);
#pragma GCC unroll 4
    for (int64_t b = 0; b < B; ++b) {
      const Lanes qd = lanes_of(qs[b][d]);
      for (int64_t v = 0; v < kTileVectors; ++v) acc[b][v] = lanes_fma(qd, k[v], acc[b][v]);
    }
  }
#pragma GCC unroll 4
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t v = 0; v < kTileVectors; ++v) s[b][v] = acc[b][v];
  }
}

// One row and head's step of the online softmax over a tile whose positions [lo, hi) are the row's: the scores
// scaled (and capped; with an ALiBi `slope`, plus slope * (t + offset) at the tile's position t, offset the tile's
// start less the row's position), the others masked out; running = {max so far, sum of exp(s - max) so far} brought up to
// date; weights[t] = exp(s_t - max) (0 outside [lo, hi)). Returns the factor that rescales the value sums so far.
__attribute__((always_inline)) inline float softmax_tile(const Lanes (&s)[kTileVectors], int64_t lo, int64_t hi,
                                                         float scale, float softcap, float slope, int64_t offset,
                                                         float* running, float* weights) {
  const vec16 none = splat(-__builtin_inff());
  vec16 x[kTileVectors];
  for (int64_t v = 0; v < kTileVectors; ++v) {
    x[v] = lanes_vec(s[v]) * scale;
    if (softcap > 0.f) {
      for (int64_t i = 0; i < kLanes; ++i) x[v][i] = softcap * std::tanh(x[v][i] / softcap);
    }
    if (slope != 0.f) {  // the distance is exact in float32 (positions < 2^24); one product, one sum
      for (int64_t i = 0; i < kLanes; ++i) x[v][i] += slope * static_cast<float>(offset + v * kLanes + i);
    }
  }
  if (lo > 0 || hi < kTile) {
    const ivec16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t v = 0; v < kTileVectors; ++v) {
      const ivec16 position = lane + static_cast<int32_t>(v * kLanes);
      x[v] = (position >= static_cast<int32_t>(lo)) & (position < static_cast<int32_t>(hi)) ? x[v] : none;
    }
  }
  // The tile's largest score, in every lane (max is exact: any order gives it).
  vec16 top = x[0];
  for (int64_t v = 1; v < kTileVectors; ++v) top = top > x[v] ? top : x[v];
  for (const ivec16 swap : {ivec16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                            ivec16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                            ivec16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                            ivec16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}}) {
    const vec16 other = __builtin_shuffle(top, swap);
    top = top > other ? top : other;
  }
  // exp(0) is exactly 1 (exp_lanes' polynomial and scale are 1 there): a max that holds needs no exp.
  const float most = std::max(running[0], top[0]);
  const float rescale = most == running[0] ? 1.f : exp_lanes(splat(running[0] - most))[0];
  vec16 total = {};
  for (int64_t v = 0; v < kTileVectors; ++v) {
    const vec16 e = exp_lanes(x[v] - most);
    store(weights + v * kLanes, e);
    total += e;
  }
  running[0] = most;
  running[1] = running[1] * rescale + hsum(total);
  return rescale;
}

// Value sums of `Heads` query heads of one row (one KV head), floats [0, N * kLanes) from sums[i]: rescaled by
// rescale[i], then sums[i] += weights[i][t] * v_t by fused multiply-adds for the tile's positions t in [lo, hi)
// in order (v_t at values + at[t] + offset). The heads share each value's loads; each head's operations are its
// own.
template <int64_t N, int64_t Heads>
inline void sum_values(const float* values, const int64_t* at, int64_t offset, int64_t lo, int64_t hi,
                       const float* const* weights, const float* rescale, float* const* sums) {
  Lanes sum[Heads][N];
#pragma GCC unroll 4
  for (int64_t i = 0; i < Heads; ++i) {
    const Lanes factor = lanes_of(rescale[i]);
#pragma GCC unroll 8
    for (int64_t c = 0; c < N; ++c) sum[i][c] = lanes_mul(lanes_load(sums[i] + c * kLanes), factor);
  }
  for (int64_t t = lo; t < hi; ++t) {
    const float* v = values + at[t] + offset;
    Lanes value[N];
#pragma GCC unroll 8
    for (int64_t c = 0; c < N; ++c) value[c] = lanes_load(v + c * kLanes);
#pragma GCC unroll 4
    for (int64_t i = 0; i < Heads; ++i) {
      const Lanes weight = lanes_of(weights[i][t]);
#pragma GCC unroll 8
      for (int64_t c = 0; c < N; ++c) sum[i][c] = lanes_fma(weight, value[c], sum[i][c]);
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < Heads; ++i) {
#pragma GCC unroll 8
    for (int64_t c = 0; c < N; ++c) lanes_store(sums[i] + c * kLanes, sum[i][c]);
  }
}

// A thread's working memory for one group of up to `rows` rows: the value sums, the running softmax state, the
// current tile's weights and rescale factors, one KV head's transposed keys of the tile and, for an FP8 cache
// (`tile_rows` > 0), the tile's keys and values decoded.
struct Scratch {
  Scratch(int64_t rows, int64_t heads, int64_t dim, int64_t tile_rows)
      : acc(new float[rows * heads * dim]),
        running(new float[rows * heads * 2]),
        rescale(new float[rows * heads]),
        weights(new float[rows * heads * kTile]),
        keys(new float[dim * kTile]),
        tile_keys(new float[tile_rows * dim]),
        tile_values(new float[tile_rows * dim]) {}
  std::unique_ptr<float[]> acc, running, rescale, weights, keys, tile_keys, tile_values;
};

// Rows [0, rows) that share one block table (a sequence's tokens of this step: prompt tokens, or a decode's last
// token and its drafts), row r's query heads at q + r * heads * Dim against positions [first_r, lens[r]) of the
// paged K/V (first_r = max(0, lens[r] - window) with a window, else 0), written to out + r * heads * Dim. Each
// row and head takes the arithmetic the file's header states, tile by tile over its own positions, so its
// result is the same bits in any group, alone included. `Cache` is float (a float32 cache's rows of Dim) or
// uint8_t (an FP8 cache's rows of Dim + 4 bytes, each tile's decoded into the scratch before it is read).
template <int64_t Dim, typename Cache>
void attend(const float* q, const Cache* keys, const Cache* values, const int32_t* table, const int32_t* lens,
            int64_t rows, int64_t block_size, int64_t kv_heads, int64_t group, int64_t window, float scale,
            float softcap, const float* sinks, const float* slopes, Scratch& scratch, float* out) {
  constexpr bool fp8 = std::is_same_v<Cache, uint8_t>;
  constexpr int64_t row_length = fp8 ? Dim + kFp8ScaleBytes : Dim;  // of a cached row, in Cache elements
  constexpr int64_t pass = std::gcd(Dim, kPassFloats);  // a divisor of Dim: DeepSeek's 576 in passes of 64
  constexpr int64_t pass_chunks = pass / kLanes;
  const int64_t sum_heads = std::max<int64_t>(1, std::min<int64_t>(kMaxSumHeads, kSumFloats / pass));
  const int64_t token_stride = kv_heads * row_length;
  const int64_t slot_bytes = token_stride * static_cast<int64_t>(sizeof(Cache));
  const int64_t heads = kv_heads * group;
  float* const acc = scratch.acc.get();
  float* const running = scratch.running.get();
  float* const rescale = scratch.rescale.get();
  float* const weights = scratch.weights.get();
  float* const kt = scratch.keys.get();
  auto first_of = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, lens[r] - window) : int64_t{0}; };
  int64_t len = 0, begin = lens[0];
  for (int64_t r = 0; r < rows; ++r) {
    len = std::max<int64_t>(len, lens[r]);
    begin = std::min(begin, first_of(r));
  }
  // use(t, offset of position t's slot) for t in [from, to): one division for the run, the block and the place in
  // it stepped along after that (a division per position cost a decode row more than its scores).
  auto each_slot = [&](int64_t from, int64_t to, auto&& use) {
    int64_t block = from / block_size, place = from - block * block_size;
    for (int64_t t = from; t < to; ++t) {
      use(t, (table[block] * block_size + place) * token_stride);
      if (++place == block_size) place = 0, ++block;
    }
  };
  // A row's blocks sit anywhere in the cache, out of the hardware prefetchers' sight.
  auto prefetch_tile = [&](int64_t from) {
    each_slot(from, std::min(len, from + kTile), [&](int64_t, int64_t at) {
      prefetch_slot(keys + at, slot_bytes);
      prefetch_slot(values + at, slot_bytes);
    });
  };
  std::fill(acc, acc + rows * heads * Dim, 0.f);
  for (int64_t i = 0; i < rows * heads; ++i) running[2 * i] = -__builtin_inff(), running[2 * i + 1] = 0.f;
  // at[t]: where the tile's position t0 + t starts in tile_keys / tile_values (the cache itself, or the decoded
  // rows of an FP8 one); cached[t]: where it starts in the cache.
  int64_t at[kTile], cached[kTile];
  const float* tile_keys = fp8 ? scratch.tile_keys.get() : reinterpret_cast<const float*>(keys);
  const float* tile_values = fp8 ? scratch.tile_values.get() : reinterpret_cast<const float*>(values);
  const int64_t start = begin / kTile * kTile;
  prefetch_tile(start);
  for (int64_t t0 = start; t0 < len; t0 += kTile) {
    const int64_t t1 = std::min(len, t0 + kTile);
    each_slot(t0, t1, [&](int64_t t, int64_t offset) { cached[t - t0] = offset; });
    if constexpr (fp8) {
      for (int64_t t = 0; t < t1 - t0; ++t) {
        at[t] = t * kv_heads * Dim;
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
          unpack_fp8_row(keys + cached[t] + kh * row_length, Dim, scratch.tile_keys.get() + at[t] + kh * Dim);
          unpack_fp8_row(values + cached[t] + kh * row_length, Dim, scratch.tile_values.get() + at[t] + kh * Dim);
        }
      }
    } else {
      std::copy(cached, cached + (t1 - t0), at);
    }
    prefetch_tile(t1);
    // Row r's positions of the tile, [lo, hi) counted from t0 (empty where lo >= hi).
    auto tile_range = [&](int64_t r) {
      return std::pair<int64_t, int64_t>{std::max(t0, first_of(r)) - t0, std::min<int64_t>(t1, lens[r]) - t0};
    };
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      transpose_keys<Dim>(tile_keys, at, kh * Dim, t1 - t0, kt);
      // Scores and softmax steps of this KV head's (row, query head) pairs that see the tile, kScoreHeads at once.
      int64_t batch[kScoreHeads];  // row * heads + head
      int64_t batched = 0;
      auto score_batch = [&]() {
        with_count<kScoreHeads>(batched, [&](auto count) {
          constexpr int64_t B = decltype(count)::value;
          const float* qs[B];
          for (int64_t b = 0; b < B; ++b) qs[b] = q + batch[b] * Dim;
          Lanes s[B][kTileVectors];
          tile_scores<Dim, B>(qs, kt, s);
          for (int64_t b = 0; b < B; ++b) {
            const int64_t row = batch[b] / heads;
            const auto [lo, hi] = tile_range(row);
            const float slope = slopes != nullptr ? slopes[batch[b] % heads] : 0.f;
            rescale[batch[b]] = softmax_tile(s[b], lo, hi, scale, softcap, slope, t0 - (lens[row] - 1),
                                             running + 2 * batch[b], weights + batch[b] * kTile);
          }
        });
        batched = 0;
      };
      for (int64_t r = 0; r < rows; ++r) {
        const auto [lo, hi] = tile_range(r);
        if (lo >= hi) continue;
        for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
          batch[batched++] = r * heads + h;
          if (batched == kScoreHeads) score_batch();
        }
      }
      if (batched > 0) score_batch();
      // Value sums: each row's heads of this KV head a few at a time, sharing each value's loads.
      for (int64_t r = 0; r < rows; ++r) {
        const auto [lo, hi] = tile_range(r);
        if (lo >= hi) continue;
        for (int64_t h0 = kh * group, count = 0; h0 < (kh + 1) * group; h0 += count) {
          count = std::min(sum_heads, (kh + 1) * group - h0);
          const int64_t first = r * heads + h0;
          for (int64_t c0 = 0; c0 < Dim; c0 += pass) {
            const float* head_weights[kMaxSumHeads];
            float* sums[kMaxSumHeads];
            for (int64_t i = 0; i < count; ++i) {
              head_weights[i] = weights + (first + i) * kTile;
              sums[i] = acc + (first + i) * Dim + c0;
            }
            with_count<kMaxSumHeads>(count, [&](auto n) {
              sum_values<pass_chunks, decltype(n)::value>(tile_values, at, kh * Dim + c0, lo, hi, head_weights,
                                                           rescale + first, sums);
            });
          }
        }
      }
    }
  }
  for (int64_t i = 0; i < rows * heads; ++i) {
    float factor = 1.f / running[2 * i + 1];
    if (sinks != nullptr) {
      const float sink = sinks[i % heads], most = std::max(running[2 * i], sink);
      const float kept = std::exp(running[2 * i] - most);
      factor = kept / (running[2 * i + 1] * kept + std::exp(sink - most));
    }
    const vec16 inv = splat(factor);
    for (int64_t d = 0; d < Dim; d += kLanes) store(out + i * Dim + d, load(acc + i * Dim + d) * inv);
  }
}

template <typename Cache>
using AttendFn = void (*)(const float*, const Cache*, const Cache*, const int32_t*, const int32_t*, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, float, const float*, const float*, Scratch&,
                          float*);

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

template <typename Cache>
AttendFn<Cache> attend_for(int64_t dim) {
  switch (dim) {
    case 16: return attend<16, Cache>;
    case 32: return attend<32, Cache>;
    case 64: return attend<64, Cache>;
    case 128: return attend<128, Cache>;
    case 256: return attend<256, Cache>;
    case 512: return attend<512, Cache>;  // Gemma 4's full-attention layers
    case 576: return attend<576, Cache>;  // DeepSeek's latent rows (layers/mla.py): 512 + 64 rope dims
    default: return nullptr;
  }
}

}  // namespace

namespace ladle_cpu {

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                                  const std::optional<at::Tensor>& sinks,
                                  const std::optional<at::Tensor>& alibi_slopes) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be [B, H, D] float32");
  const bool fp8 = kv_cache.scalar_type() == at::kByte;
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && (fp8 || kv_cache.scalar_type() == at::kFloat) &&
                  kv_cache.is_contiguous(),
              "kv_cache must be [2, num_blocks, block_size, Hkv, D] float32, or uint8 [..., D + 4], contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be [B, W] int32");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt, "seq_lens must be [B] int32");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  const int64_t width = block_tables.size(1);
  TORCH_CHECK(kv_cache.size(4) == (fp8 ? dim + kFp8ScaleBytes : dim), "head dim of q and kv_cache differ");
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(!sinks.has_value() || (sinks->dim() == 1 && sinks->size(0) == heads &&
                                     sinks->scalar_type() == at::kFloat && sinks->is_contiguous()),
              "sinks must be [H] float32, contiguous");
  const float* sinks_ptr = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  TORCH_CHECK(!alibi_slopes.has_value() ||
                  (alibi_slopes->dim() == 1 && alibi_slopes->size(0) == heads &&
                   alibi_slopes->scalar_type() == at::kFloat && alibi_slopes->is_contiguous()),
              "alibi_slopes must be [H] float32, contiguous");
  const float* slopes_ptr = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  LADLE_CHECK(attend_for<float>(dim) != nullptr, "head dim %lld is not one of 16, 32, 64, 128, 256, 512, 576",
              static_cast<long long>(dim));
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
  const int64_t half = num_blocks * block_size * kv_heads * kv_cache.size(4);  // elements of K, then of V
  float* out_ptr = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), fsoftcap = static_cast<float>(softcap);

  // Rows of one sequence share their key and value reads (attend); a run of them is cut into enough groups to
  // give every thread work (a step's drafts), and none larger than kMaxGroup rows.
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
  // The groups over a cache of Cache elements (float32, or an FP8 one's bytes): K, then V `half` elements on.
  auto attend_groups = [&](const auto* cache) {
    const auto attend_fn = attend_for<std::remove_cv_t<std::remove_pointer_t<decltype(cache)>>>(dim);
    at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
      // Left uninitialised: attend writes everything before it reads it.
      Scratch scratch(most, heads, dim, fp8 ? kTile * kv_heads : 0);
      for (int64_t share = begin; share < end; ++share) {
        for (int64_t g = share; g < count_groups; g += shares) {
          const int64_t first = groups[g].first, count = groups[g].second - groups[g].first;
          attend_fn(q_ptr + first * heads * dim, cache, cache + half, tables + first * width, lens_ptr + first,
                    count, block_size, kv_heads, group, window, fscale, fsoftcap, sinks_ptr, slopes_ptr, scratch,
                    out_ptr + first * heads * dim);
        }
      }
    });
  };
  if (fp8) {
    attend_groups(kv_cache.data_ptr<uint8_t>());
  } else {
    attend_groups(kv_cache.data_ptr<float>());
  }
  return out;
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "int window=0, float softcap=0., Tensor? sinks=None, Tensor? alibi_slopes=None) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::paged_decode_attention));
}
