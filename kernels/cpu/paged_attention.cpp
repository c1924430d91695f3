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
// scores eight keys at a time, value sums in registers, groups dealt to the threads round-robin. A row's result
// is the same bits whichever rows share its group, and whatever the tiling. Softmax is exact (max subtracted,
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
#include <utility>
#include <vector>

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
  auto slot = [&](int64_t t) { return (table[t / block_size] * block_size + t % block_size) * token_stride; };
  const float* tile[kKeyTile];
  // The tile's slots (every KV head of a token) in `base`, with the next tile's prefetched: a row's blocks sit
  // anywhere in the cache, out of the hardware prefetchers' sight.
  auto load_tile = [&](const float* base, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) tile[t - t0] = base + slot(t);
    for (int64_t t = t1; t < std::min(len, t1 + kKeyTile); ++t) prefetch_slot(base + slot(t), slot_bytes);
  };
  for (int64_t t = begin; t < std::min(len, begin + kKeyTile); ++t) prefetch_slot(keys + slot(t), slot_bytes);
  float* maxes = acc + rows * heads * Dim;  // each row and head's largest score, taken as they are written
  std::fill(maxes, maxes + rows * heads, -__builtin_inff());

  for (int64_t t0 = begin; t0 < len; t0 += kKeyTile) {
    const int64_t t1 = std::min(len, t0 + kKeyTile);
    load_tile(keys, t0, t1);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lo = std::max(t0, first_of(r)), hi = std::min<int64_t>(t1, lens[r]);
      for (int64_t h = 0; h < heads && lo < hi; ++h) {
        const float* qh = q + (r * heads + h) * Dim;
        const int64_t offset = (h / group) * Dim;
        float* s = row_scores(r, h);
        float& most = maxes[r * heads + h];
        int64_t t = lo;
        for (; t + 8 <= hi; t += 8) scores8<chunks>(qh, tile + (t - t0), offset, scale, softcap, s + t, most);
        for (; t < hi; ++t) {
          s[t] = score<chunks>(qh, tile[t - t0] + offset, scale, softcap);
          most = std::max(most, s[t]);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) softmax_row(row_scores(r, h), first_of(r), lens[r], maxes[r * heads + h]);
  }
  std::fill(acc, acc + rows * heads * Dim, 0.f);
  for (int64_t t = begin; t < std::min(len, begin + kKeyTile); ++t) prefetch_slot(values + slot(t), slot_bytes);
  for (int64_t t0 = begin; t0 < len; t0 += kKeyTile) {
    const int64_t t1 = std::min(len, t0 + kKeyTile);
    load_tile(values, t0, t1);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lo = std::max(t0, first_of(r)), hi = std::min<int64_t>(t1, lens[r]);
      if (lo >= hi) continue;
      // The query heads of one KV head a few at a time, sharing each value's loads (and giving the adds enough
      // independent sums to overlap).
      for (int64_t h0 = 0, count = 0; h0 < heads; h0 += count) {
        count = std::min({kSumHeads<Dim>, heads - h0, group - h0 % group});
        const int64_t offset = (h0 / group) * Dim;
        for (int64_t c0 = 0; c0 < chunks; c0 += kAccChunks) {
          const float* weights[kMaxSumHeads];
          float* sums[kMaxSumHeads];
          for (int64_t i = 0; i < count; ++i) {
            weights[i] = row_scores(r, h0 + i);
            sums[i] = acc + (r * heads + h0 + i) * Dim + c0 * kLanes8;
          }
          const float* const* base = tile - t0;
          const int64_t at = offset + c0 * kLanes8;
          switch (count) {
            case 1: sum_values<sum_chunks<Dim>(), 1>(base, at, lo, hi, weights, sums); break;
            case 2: sum_values<sum_chunks<Dim>(), 2>(base, at, lo, hi, weights, sums); break;
            case 3: sum_values<sum_chunks<Dim>(), 3>(base, at, lo, hi, weights, sums); break;
            default: sum_values<sum_chunks<Dim>(), 4>(base, at, lo, hi, weights, sums); break;
          }
        }
      }
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

  const int64_t max_padded = (width * block_size + kLanes - 1) / kLanes * kLanes;
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
    std::vector<float> scores(most * heads * max_padded);
    std::vector<float> acc(most * heads * (dim + 1));
    for (int64_t share = begin; share < end; ++share) {
      for (int64_t g = share; g < count_groups; g += shares) {
        const int64_t first = groups[g].first, count = groups[g].second - groups[g].first;
        attend_fn(q_ptr + first * heads * dim, k_ptr, v_ptr, tables + first * width, lens_ptr + first, count,
                  block_size, kv_heads, group, window, fscale, fsoftcap, scores.data(), acc.data(),
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
