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
// over such groups with at::parallel_for. Within a group each key is loaded once for the query heads of its GQA
// group, straight from the blocks, block by block with the next slots prefetched. A row's result is the same bits
// whichever rows share its group. Softmax is exact (max subtracted, float32 sums); exp is a polynomial with
// ~1e-7 relative error, so results match the reference SDPA to float32 rounding, not bit for bit. Built with
// -fopenmp, so at::parallel_for uses torch's own OpenMP thread pool (the extension resolves libgomp.so.1 to the
// copy torch already loaded).

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

// Tokens ahead of the one being read whose slots are prefetched: the blocks of a row sit anywhere in the cache,
// so the hardware prefetchers cannot see the next one coming.
constexpr int64_t kPrefetchAhead = 32;

// The most rows of one sequence attended together: their scores (rows x heads x context floats) stay in cache.
constexpr int64_t kMaxGroup = 16;

// One decode row: all `heads` query heads at `q` (contiguous, Dim floats each) against positions [0, len) of the
// paged K/V, written to `out` (contiguous). A token's slot holds every KV head (token_stride floats); the loops
// go KV head by KV head, so a head's keys are read once for the query heads of its group, and the slots of the
// next tokens are prefetched (a row's blocks sit anywhere in the cache, out of the hardware prefetchers' sight).
// `scores` has room for heads * padded(len) floats.
// Calls visit(t, slot) for positions t in [begin, len) in order, `slot` pointing at t's token in `cache` (every
// KV head of it): block by block, so the block table is read once per block, not once per token.
template <typename Visit>
inline void for_each_token(const float* cache, const int32_t* table, int64_t begin, int64_t len,
                           int64_t block_size, int64_t token_stride, Visit&& visit) {
  for (int64_t block = begin / block_size, start = block * block_size; start < len; start += block_size, ++block) {
    const float* base = cache + static_cast<int64_t>(table[block]) * block_size * token_stride;
    const int64_t count = std::min(block_size, len - start);
    for (int64_t j = std::max<int64_t>(0, begin - start); j < count; ++j) visit(start + j, base + j * token_stride);
  }
}

// Softmax in place over one row's scores s[first, len), read in whole vectors from the one holding `first`: the
// lanes before `first` and from `len` to the vector's end are set to -inf first (exp turns them into 0).
inline void softmax_row(float* s, int64_t first, int64_t len) {
  const int64_t aligned = first / kLanes * kLanes;
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
  for (int64_t t = aligned; t < first; ++t) s[t] = -__builtin_inff();
  for (int64_t t = len; t < padded; ++t) s[t] = -__builtin_inff();
  vec16 mx = splat(-__builtin_inff());
  for (int64_t t = aligned; t < padded; t += kLanes) {
    const vec16 v = load(s + t);
    mx = v > mx ? v : mx;
  }
  float m = mx[0];
  for (int64_t l = 1; l < kLanes; ++l) m = mx[l] > m ? mx[l] : m;
  vec16 total = {};
  for (int64_t t = aligned; t < padded; t += kLanes) {
    const vec16 e = exp_lanes(load(s + t) - m);
    store(s + t, e);
    total += e;
  }
  const float inv = 1.f / hsum(total);
  for (int64_t t = first; t < len; ++t) s[t] *= inv;
}

// scale * (q . k) for one query head against one key, `k` already in registers; soft-capped to
// softcap * tanh(s / softcap) when softcap > 0.
template <int64_t Chunks>
inline float score(const float* qh, const vec8 (&k)[Chunks], float scale, float softcap) {
  vec8 dot = load8(qh) * k[0];
  for (int64_t c = 1; c < Chunks; ++c) dot += load8(qh + c * kLanes8) * k[c];
  const float s = hsum8(dot) * scale;
  return softcap > 0.f ? softcap * std::tanh(s / softcap) : s;
}

// Rows [0, rows) that share one block table (a sequence's tokens of this step: prompt tokens, or a decode's last
// token and its drafts), row r's query heads at q + r * heads * Dim against positions [first_r, lens[r]) of the
// paged K/V (first_r = max(0, lens[r] - window) with a window, else 0), written to out + r * heads * Dim. Each key
// and value is read once for all the rows (a row alone would read the sequence's whole cache once per row), while
// each row's arithmetic is the single row's, in the same order: scores by key, softmax_row, then values summed in
// position order; so a row's result is the same bits in any group, alone included (the build has
// -ffp-contract=off: no fused multiply-adds that could differ).
// `scores` has room for rows * heads * padded(max len) floats, `acc` for rows * heads * Dim.
template <int64_t Dim>
void attend(const float* q, const float* keys, const float* values, const int32_t* table, const int32_t* lens,
            int64_t rows, int64_t block_size, int64_t kv_heads, int64_t group, int64_t window, float scale,
            float softcap, float* scores, vec8* acc, float* out) {
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

  for (int64_t t = begin; t < std::min(len, begin + kPrefetchAhead); ++t) {
    prefetch_slot(keys + slot(t), slot_bytes);
    prefetch_slot(values + slot(t), slot_bytes);
  }
  for_each_token(keys, table, begin, len, block_size, token_stride, [&](int64_t t, const float* token) {
    if (t + kPrefetchAhead < len) {  // the values too: their pass then reads them from cache
      prefetch_slot(keys + slot(t + kPrefetchAhead), slot_bytes);
      prefetch_slot(values + slot(t + kPrefetchAhead), slot_bytes);
    }
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      vec8 k[chunks];
      for (int64_t c = 0; c < chunks; ++c) k[c] = load8(token + kvh * Dim + c * kLanes8);
      for (int64_t r = 0; r < rows; ++r) {
        if (t >= lens[r] || t < first_of(r)) continue;
        for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
          row_scores(r, h)[t] = score<chunks>(q + (r * heads + h) * Dim, k, scale, softcap);
        }
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) softmax_row(row_scores(r, h), first_of(r), lens[r]);
  }
  for (int64_t i = 0; i < rows * heads * chunks; ++i) acc[i] = vec8{};
  for_each_token(values, table, begin, len, block_size, token_stride, [&](int64_t t, const float* token) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* v = token + (h / group) * Dim;
      for (int64_t r = 0; r < rows; ++r) {
        if (t >= lens[r] || t < first_of(r)) continue;
        const vec8 weight = vec8{} + row_scores(r, h)[t];
        vec8* a = acc + (r * heads + h) * chunks;
        for (int64_t c = 0; c < chunks; ++c) a[c] += weight * load8(v + c * kLanes8);
      }
    }
  });
  for (int64_t i = 0; i < rows * heads; ++i) {
    for (int64_t c = 0; c < chunks; ++c) store8(out + i * Dim + c * kLanes8, acc[i * chunks + c]);
  }
}

using AttendFn = void (*)(const float*, const float*, const float*, const int32_t*, const int32_t*, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, float, float*, vec8*, float*);

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
  const int64_t chunks = dim / kLanes8;
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(most * heads * max_padded);
    std::vector<vec8> acc(most * heads * chunks);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = groups[g].first, count = groups[g].second - groups[g].first;
      attend_fn(q_ptr + first * heads * dim, k_ptr, v_ptr, tables + first * width, lens_ptr + first, count,
                block_size, kv_heads, group, window, fscale, fsoftcap, scores.data(), acc.data(),
                out_ptr + first * heads * dim);
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
