// Decode attention over the paged KV cache for the CPU path: one pass over each row's blocks, no gather.
//
// Contract (see kernels/reference.py `paged_attention` and engine_server/attention.py):
//   q            [B, H, D] float32, contiguous: the one new token of each decode row
//   kv_cache     [2, num_blocks, block_size, Hkv, D] float32, contiguous (this step's K/V already written)
//   block_tables [B, W] int32: row b's token p lives in block block_tables[b][p / block_size]
//   seq_lens     [B] int32: row b attends to positions [0, seq_lens[b])
//   returns      [B, H, D]: out[b, h] = softmax(scale * q[b, h] . K[j]) @ V[j] over j < seq_lens[b],
//                K/V from KV head h / (H / Hkv).
// Work is split over rows with at::parallel_for; a row reads its keys once for all its query heads, then its
// values once, straight from the blocks, each block front to back with the next slots prefetched. Softmax is exact (max subtracted,
// float32 sums); exp is a polynomial with ~1e-7 relative error, so results match the reference SDPA to float32
// rounding, not bit for bit. Built with -fopenmp, so at::parallel_for uses torch's own OpenMP thread pool (the
// extension resolves libgomp.so.1 to the copy torch already loaded).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
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

// Calls visit(t, h, x) for every position t < len (in order) and query head h, x being the Dim / 16 vectors of
// h's KV head in t's slot of `cache`: each slot is loaded once for the GQA group that shares it.
template <int64_t Dim, typename Slot, typename Visit>
inline void for_each_slot(const float* cache, const Slot& slot, int64_t len, int64_t kv_heads, int64_t group,
                          Visit&& visit) {
  constexpr int64_t chunks = Dim / kLanes;
  for (int64_t t = 0; t < len; ++t) {
    const float* tokens = cache + slot(t);
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      vec16 x[chunks];
      for (int64_t c = 0; c < chunks; ++c) x[c] = load(tokens + kvh * Dim + c * kLanes);
      for (int64_t g = 0; g < group; ++g) visit(t, kvh * group + g, x);
    }
  }
}

// One decode row: all `heads` query heads at `q` (contiguous, Dim floats each) against positions [0, len) of the
// paged K/V, written to `out` (contiguous). Each token's slot holds every KV head (token_stride floats), so
// reading it for all heads at once walks each block front to back. `scores` has room for heads * padded(len)
// floats and `acc` for heads * Dim.
template <int64_t Dim>
void attend(const float* q, const float* keys, const float* values, const int32_t* table, int64_t len,
            int64_t block_size, int64_t kv_heads, int64_t group, float scale, float* scores, float* acc,
            float* out) {
  constexpr int64_t chunks = Dim / kLanes;
  const int64_t heads = kv_heads * group;
  const int64_t token_stride = kv_heads * Dim;
  const int64_t slot_bytes = token_stride * static_cast<int64_t>(sizeof(float));
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
  auto slot = [&](int64_t t) { return (table[t / block_size] * block_size + t % block_size) * token_stride; };

  for (int64_t t = 0; t < len && t < kPrefetchAhead; ++t) {
    prefetch_slot(keys + slot(t), slot_bytes);
    prefetch_slot(values + slot(t), slot_bytes);
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t c = 0; c < chunks; ++c) store(acc + h * Dim + c * kLanes, load(q + h * Dim + c * kLanes) * scale);
  for_each_slot<Dim>(keys, slot, len, kv_heads, group, [&](int64_t t, int64_t h, const vec16* k) {
    if (h == 0 && t + kPrefetchAhead < len) {  // the values too: the second pass then reads them from L2
      prefetch_slot(keys + slot(t + kPrefetchAhead), slot_bytes);
      prefetch_slot(values + slot(t + kPrefetchAhead), slot_bytes);
    }
    const float* qh = acc + h * Dim;  // the scaled queries, until the values pass reuses acc
    vec16 dot = load(qh) * k[0];
    for (int64_t c = 1; c < chunks; ++c) dot += load(qh + c * kLanes) * k[c];
    scores[h * padded + t] = hsum(dot);
  });
  for (int64_t h = 0; h < heads; ++h) {
    // Softmax over the row, padded to whole vectors with -inf (which exp turns into 0).
    float* s = scores + h * padded;
    for (int64_t t = len; t < padded; ++t) s[t] = -__builtin_inff();
    vec16 mx = splat(-__builtin_inff());
    for (int64_t t = 0; t < padded; t += kLanes) {
      const vec16 v = load(s + t);
      mx = v > mx ? v : mx;
    }
    float m = mx[0];
    for (int64_t l = 1; l < kLanes; ++l) m = mx[l] > m ? mx[l] : m;
    vec16 total = {};
    for (int64_t t = 0; t < padded; t += kLanes) {
      const vec16 e = exp_lanes(load(s + t) - m);
      store(s + t, e);
      total += e;
    }
    const float inv = 1.f / hsum(total);
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  }
  for (int64_t i = 0; i < heads * Dim; i += kLanes) store(acc + i, vec16{});
  for_each_slot<Dim>(values, slot, len, kv_heads, group, [&](int64_t t, int64_t h, const vec16* v) {
    const vec16 w = splat(scores[h * padded + t]);
    float* a = acc + h * Dim;
    for (int64_t c = 0; c < chunks; ++c) store(a + c * kLanes, load(a + c * kLanes) + w * v[c]);
  });
  for (int64_t i = 0; i < heads * Dim; i += kLanes) store(out + i, load(acc + i));
}

using AttendFn = void (*)(const float*, const float*, const float*, const int32_t*, int64_t, int64_t, int64_t,
                          int64_t, float, float*, float*, float*);

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
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be [B, H, D] float32");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.scalar_type() == at::kFloat &&
                  kv_cache.is_contiguous(),
              "kv_cache must be [2, num_blocks, block_size, Hkv, D] float32, contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be [B, W] int32");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt, "seq_lens must be [B] int32");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  const int64_t width = block_tables.size(1);
  TORCH_CHECK(kv_cache.size(4) == dim, "head dim of q and kv_cache differ");
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  const AttendFn attend_fn = attend_for(dim);
  TORCH_CHECK(attend_fn != nullptr, "head dim ", dim, " is not one of 16, 32, 64, 128, 256");
  TORCH_CHECK(block_tables.size(0) == rows && seq_lens.size(0) == rows, "one block table and length per row");
  const at::Tensor lens = seq_lens.contiguous();
  const int32_t* lens_ptr = lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lens_ptr[r] >= 1 && lens_ptr[r] <= width * block_size, "seq_lens out of the block table's range");
  }
  const int64_t group = heads / kv_heads;
  at::Tensor out = at::empty({rows, heads, dim}, q.options());
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = kv_cache.data_ptr<float>();
  const float* v_ptr = k_ptr + num_blocks * block_size * kv_heads * dim;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  float* out_ptr = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < (lens_ptr[r] + block_size - 1) / block_size; ++i) {
      const int32_t block = tables[r * width + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " outside the cache");
    }
  }
  const int64_t max_padded = (width * block_size + kLanes - 1) / kLanes * kLanes;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(heads * max_padded);
    std::vector<float> acc(heads * dim);
    for (int64_t r = begin; r < end; ++r) {
      attend_fn(q_ptr + r * heads * dim, k_ptr, v_ptr, tables + r * width, lens_ptr[r], block_size, kv_heads, group,
                fscale, scores.data(), acc.data(), out_ptr + r * heads * dim);
    }
  });
  return out;
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::paged_decode_attention));
}
