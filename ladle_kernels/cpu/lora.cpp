// LoRA's two products over a batch whose rows belong to many adapters (multi-LoRA serving), in float32.
// Contracts: `lora_shrink` and `lora_expand` in ladle_kernels/reference.py:
//   lora_shrink: x [T, K], a [S, R, K], slots [T] int32 or int64 (-1: the row has no adapter)
//                -> y [T, R], y[t] = a[slots[t]] @ x[t], 0 where slots[t] is -1
//   lora_expand: out [T, N] += y[t] @ b[slots[t]] for y [T, R], b [S, R, N]; rows whose slot is -1 untouched
// The rows are grouped by slot (a counting sort, rows of a slot in batch order) and the work is cut into items of
// (up to kRowChunk rows of one slot, a chunk of output columns whose weight stays in L1), shared out over the
// threads by their cost. Within an item, tiles of rows share each load of the weight:
//   - shrink: y[t, r] is a dot product over K in 16 lanes (lane i takes the terms k = i mod 16 by fused
//     multiply-adds in k order, the last partial vector's missing lanes zero), the lanes then summed by `hsum`'s
//     fixed tree; a tile is kShrinkRows rows x kShrinkRanks ranks.
//   - expand: out[t, n] starts from its own value and gets fma(y[t, r], b[s, r, n]) for r = 0, 1, ... in turn: an
//     AXPY over n per (row, r), vectorised over n with no horizontal sum; a tile is kExpandRows rows x
//     kExpandVectors vectors of columns, a row's last columns a masked vector taking the same steps.
// So each output element comes from the same float32 operations in the same order whatever tile, item or thread it
// falls in and whichever rows share its batch: a row's result does not depend on its batch, bit for bit. The fused
// multiply-adds are explicit (AVX-512; AVX2's FMA on each half; else std::fma per lane, a slow libm call on an x86
// without FMA, older than 2013), each rounding once, so every machine gives the same bits; the build's
// -ffp-contract=off keeps the compiler from fusing anything else.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "lanes.h"
#include "ops.h"
#include "vec.h"

namespace {

using namespace ladle_cpu;

#ifdef __AVX512F__
constexpr int64_t kShrinkRows = 4, kShrinkRanks = 4, kExpandRows = 4, kExpandVectors = 4;  // 16-21 of 32 zmm
#else
constexpr int64_t kShrinkRows = 2, kShrinkRanks = 2, kExpandRows = 2, kExpandVectors = 2;  // Lanes: 2 ymm
#endif
// Rows of one slot per work item, and about how many bytes of weight its columns span (kept in L1 across them).
constexpr int64_t kRowChunk = 16;
constexpr int64_t kChunkWeightBytes = 24 * 1024;
// Below this many multiply-adds one thread runs it all: waking the others costs more than they would save.
constexpr int64_t kMinParallelWork = 1 << 17;

// y[m][col + j] = x[m] . a[j] for M rows of x and J rows of a (`depth` floats each, a's contiguous). With
// kPrefetch, the J rows of a after these are fetched into L1 on the way, for the next tile's first rows: the
// hardware prefetchers alone leave it waiting on a from memory (a slot's a is read once per call in the engine).
template <int64_t M, int64_t J, bool kPrefetch>
inline void shrink_tile(const float* const* x, const float* a, int64_t depth, float* const* y, int64_t col) {
  Lanes acc[M][J];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < J; ++j) acc[m][j] = lanes_zero();
  }
  // Terms [i, i + kLanes), or where `partial` is true the last `count` (< kLanes).
  auto step = [&](int64_t i, int64_t count, auto partial) {
    auto get = [count](const float* p) {
      return decltype(partial)::value ? lanes_load_first(p, count) : lanes_load(p);
    };
    Lanes av[J];
    for (int64_t j = 0; j < J; ++j) av[j] = get(a + j * depth + i);
    if constexpr (kPrefetch) {  // past a's end for the last tile: a prefetch never faults
      for (int64_t j = 0; j < J; ++j) __builtin_prefetch(a + (J + j) * depth + i, 0, 3);
    }
    for (int64_t m = 0; m < M; ++m) {
      const Lanes xv = get(x[m] + i);
      for (int64_t j = 0; j < J; ++j) acc[m][j] = lanes_fma(xv, av[j], acc[m][j]);
    }
  };
  int64_t i = 0;
  for (; i + kLanes <= depth; i += kLanes) step(i, kLanes, std::false_type{});
  if (i < depth) step(i, depth - i, std::true_type{});
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < J; ++j) y[m][col + j] = lanes_sum(acc[m][j]);
  }
}

// out[m][col, col + count) += y[m] @ b[:, col, col + count) for M rows, b's `rank` rows `stride` floats apart:
// V whole vectors of columns, or with kPartial one vector's first `count` (< kLanes) columns.
template <int64_t M, int64_t V, bool kPartial>
inline void expand_tile(float* const* out, const float* const* y, const float* b, int64_t stride, int64_t rank,
                        int64_t col, int64_t count) {
  auto get = [count](const float* p) { return kPartial ? lanes_load_first(p, count) : lanes_load(p); };
  Lanes acc[M][V];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t v = 0; v < V; ++v) acc[m][v] = get(out[m] + col + v * kLanes);
  }
  for (int64_t r = 0; r < rank; ++r) {
    Lanes bv[V];
    for (int64_t v = 0; v < V; ++v) bv[v] = get(b + r * stride + col + v * kLanes);
    for (int64_t m = 0; m < M; ++m) {
      const Lanes ym = lanes_of(y[m][r]);
      for (int64_t v = 0; v < V; ++v) acc[m][v] = lanes_fma(ym, bv[v], acc[m][v]);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t v = 0; v < V; ++v) {
      if constexpr (kPartial) {
        lanes_store_first(out[m] + col, acc[m][v], count);
      } else {
        lanes_store(out[m] + col + v * kLanes, acc[m][v]);
      }
    }
  }
}

// One product over the batch: row t of `in` (in_stride floats apart) times the weight of its slot (weight_size
// floats apart) into row t of `out` (out_stride apart), `cols` output columns over `inner` terms each.
struct Product {
  const float* in;
  int64_t in_stride;
  const float* weight;
  int64_t weight_size;
  float* out;
  int64_t out_stride;
  int64_t cols, inner;
};

// order[row_begin, row_end) (rows of one slot) times columns [col_begin, col_end).
struct Item {
  int64_t slot, row_begin, row_end, col_begin, col_end;
};

// The item's rows of the input and of the output (`order` maps its row range to rows of the batch); returns how many.
int64_t row_pointers(const Product& p, const int64_t* order, const Item& item, const float** in, float** out) {
  const int64_t rows = item.row_end - item.row_begin;
  for (int64_t m = 0; m < rows; ++m) {
    in[m] = p.in + order[item.row_begin + m] * p.in_stride;
    out[m] = p.out + order[item.row_begin + m] * p.out_stride;
  }
  return rows;
}

// Shrink's item: kShrinkRanks rows of a (a few KB, kept in L1) against every kShrinkRows-row tile of x in turn.
void shrink_item(const Product& p, const int64_t* order, const Item& item) {
  const float* in[kRowChunk];
  float* out[kRowChunk];
  const int64_t rows = row_pointers(p, order, item, in, out);
  const float* a = p.weight + item.slot * p.weight_size;
  for (int64_t j = item.col_begin; j < item.col_end; j += kShrinkRanks) {
    with_count<kShrinkRanks>(std::min(kShrinkRanks, item.col_end - j), [&](auto ranks) {
      for (int64_t m = 0; m < rows; m += kShrinkRows) {
        with_count<kShrinkRows>(std::min(kShrinkRows, rows - m), [&](auto tile_rows) {
          constexpr int64_t M = decltype(tile_rows)::value, J = decltype(ranks)::value;
          if (m == 0) {
            shrink_tile<M, J, true>(in + m, a + j * p.inner, p.inner, out + m, j);
          } else {
            shrink_tile<M, J, false>(in + m, a + j * p.inner, p.inner, out + m, j);
          }
        });
      }
    });
  }
}

// Expand's item: every kExpandRows-row tile over the item's columns, whose rows of b stay in L1 across the tiles.
void expand_item(const Product& p, const int64_t* order, const Item& item) {
  const float* in[kRowChunk];
  float* out[kRowChunk];
  const int64_t rows = row_pointers(p, order, item, in, out);
  const float* b = p.weight + item.slot * p.weight_size;
  for (int64_t m = 0; m < rows; m += kExpandRows) {
    with_count<kExpandRows>(std::min(kExpandRows, rows - m), [&](auto tile_rows) {
      constexpr int64_t M = decltype(tile_rows)::value;
      int64_t col = item.col_begin;
      for (; col + kExpandVectors * kLanes <= item.col_end; col += kExpandVectors * kLanes) {
        expand_tile<M, kExpandVectors, false>(out + m, in + m, b, p.cols, p.inner, col, kLanes);
      }
      for (; col + kLanes <= item.col_end; col += kLanes) {
        expand_tile<M, 1, false>(out + m, in + m, b, p.cols, p.inner, col, kLanes);
      }
      if (col < item.col_end) expand_tile<M, 1, true>(out + m, in + m, b, p.cols, p.inner, col, item.col_end - col);
    });
  }
}

// The batch's rows grouped by slot, batch order within each: order[start[s], start[s + 1]) are slot s's rows;
// rows whose slot is -1 are left out.
struct SlotGroups {
  std::vector<int64_t> order, start;
};

// Raises on a slot outside [-1, num_slots).
template <typename I>
SlotGroups group_rows(const I* slots, int64_t tokens, int64_t num_slots) {
  std::vector<int64_t> start(num_slots + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slots[t];
    LADLE_CHECK(s >= -1 && s < num_slots, "slot %lld of row %lld is not in -1..%lld", static_cast<long long>(s),
                static_cast<long long>(t), static_cast<long long>(num_slots - 1));
    if (s >= 0) ++start[s + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) start[s + 1] += start[s];
  std::vector<int64_t> order(start[num_slots]), next(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] >= 0) order[next[slots[t]]++] = t;
  }
  return {std::move(order), std::move(start)};
}

// Every (up to kRowChunk rows of a slot, up to col_chunk columns) item, each run by `run_item` on one thread; the
// threads take even shares of the items' cost (rows x columns), in order, when there is enough work to share.
template <typename F>
void run_items(const Product& p, const SlotGroups& groups, int64_t col_chunk, F run_item) {
  std::vector<Item> items;
  std::vector<int64_t> cost_before{0};
  for (int64_t s = 0; s + 1 < static_cast<int64_t>(groups.start.size()); ++s) {
    for (int64_t m = groups.start[s]; m < groups.start[s + 1]; m += kRowChunk) {
      const int64_t m_end = std::min(m + kRowChunk, groups.start[s + 1]);
      for (int64_t c = 0; c < p.cols; c += col_chunk) {
        items.push_back({s, m, m_end, c, std::min(p.cols, c + col_chunk)});
        cost_before.push_back(cost_before.back() + (m_end - m) * (items.back().col_end - c));
      }
    }
  }
  const int64_t count = static_cast<int64_t>(items.size()), total = cost_before.back();
  if (total == 0) return;
  const int64_t threads = total * p.inner < kMinParallelWork ? 1 : std::min<int64_t>(count, at::get_num_threads());
  const int64_t* order = groups.order.data();
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t thread = first; thread < last; ++thread) {
      // This thread's share: the items whose cost starts in [total * t / n, total * (t + 1) / n).
      const int64_t from = total * thread / threads, to = total * (thread + 1) / threads;
      auto item = std::lower_bound(cost_before.begin(), cost_before.end() - 1, from) - cost_before.begin();
      for (; item < count && cost_before[item] < to; ++item) run_item(p, order, items[item]);
    }
  });
}

// Columns per item: about kChunkWeightBytes of weight (`bytes_per_col` each), a multiple of `step`.
int64_t col_chunk(int64_t bytes_per_col, int64_t step) {
  return std::max<int64_t>(1, kChunkWeightBytes / std::max<int64_t>(1, bytes_per_col) / step) * step;
}

SlotGroups group_slots(const at::Tensor& slots, int64_t tokens, int64_t num_slots) {
  TORCH_CHECK(slots.dim() == 1 && (slots.scalar_type() == at::kInt || slots.scalar_type() == at::kLong),
              "slots must be a [T] int32 or int64 tensor");
  LADLE_CHECK(slots.size(0) == tokens, "slots has %lld rows, the batch %lld", static_cast<long long>(slots.size(0)),
              static_cast<long long>(tokens));
  const at::Tensor ids = slots.contiguous();
  if (ids.scalar_type() == at::kInt) return group_rows(ids.data_ptr<int32_t>(), tokens, num_slots);
  return group_rows(ids.data_ptr<int64_t>(), tokens, num_slots);
}

void check_rows(const at::Tensor& x, const char* name) {
  LADLE_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "%s must be a [T, n] float32 tensor with a contiguous last dim", name);
}

void check_weight(const at::Tensor& w, const char* name, int64_t rows, int64_t cols) {
  LADLE_CHECK(w.dim() == 3 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) == rows &&
                  w.size(2) == cols,
              "%s must be a contiguous [S, %lld, %lld] float32 tensor", name, static_cast<long long>(rows),
              static_cast<long long>(cols));
}

}  // namespace

namespace ladle_cpu {

at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a, const at::Tensor& slots) {
  check_rows(x, "x");
  LADLE_CHECK(a.dim() == 3, "a must be [S, R, K]");
  const int64_t tokens = x.size(0), k = x.size(1), rank = a.size(1);
  check_weight(a, "a", rank, k);
  const SlotGroups groups = group_slots(slots, tokens, a.size(0));
  at::Tensor y = at::zeros({tokens, rank}, x.options());
  const Product product{x.data_ptr<float>(), x.stride(0), a.data_ptr<float>(), rank * k,
                        y.data_ptr<float>(), rank,        rank,                k};
  run_items(product, groups, col_chunk(k * sizeof(float), kShrinkRanks), shrink_item);
  return y;
}

void lora_expand(const at::Tensor& out, const at::Tensor& y, const at::Tensor& b, const at::Tensor& slots) {
  check_rows(out, "out");
  check_rows(y, "y");
  const int64_t tokens = out.size(0), rank = y.size(1), n = out.size(1);
  LADLE_CHECK(y.size(0) == tokens, "y has %lld rows, out %lld", static_cast<long long>(y.size(0)),
              static_cast<long long>(tokens));
  LADLE_CHECK(b.dim() == 3, "b must be [S, R, N]");
  check_weight(b, "b", rank, n);
  const SlotGroups groups = group_slots(slots, tokens, b.size(0));
  const Product product{y.data_ptr<float>(),   y.stride(0),   b.data_ptr<float>(), rank * n,
                        out.data_ptr<float>(), out.stride(0), n,                   rank};
  run_items(product, groups, col_chunk(rank * sizeof(float), kExpandVectors * kLanes), expand_item);
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def("lora_shrink(Tensor x, Tensor a, Tensor slots) -> Tensor");
  m.def("lora_expand(Tensor(a!) out, Tensor y, Tensor b, Tensor slots) -> ()");
  m.impl("lora_shrink", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::lora_shrink));
  m.impl("lora_expand", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::lora_expand));
}
