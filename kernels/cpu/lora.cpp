// LoRA's two products over a batch whose rows belong to many adapters (multi-LoRA serving), in float32.
// Contracts: `lora_shrink` and `lora_expand` in kernels/reference.py:
//   lora_shrink: x [T, K], a [S, R, K], slots [T] int32 or int64 (-1: the row has no adapter)
//                -> y [T, R], y[t] = a[slots[t]] @ x[t], 0 where slots[t] is -1
//   lora_expand: out [T, N] += b[slots[t]] @ y[t] for y [T, R], b [S, N, R]; rows whose slot is -1 untouched
// Both are one product: each row of `in` dotted with the rows of its slot's weight [cols, inner]. The rows are
// grouped by slot here (a counting sort, rows of a slot in batch order), so each slot's rows run as one small GEMM
// against its weight: the work items are (up to kRowChunk rows of one slot, a chunk of columns), each walking its
// columns kDotCols at a time over its rows kDotRows at a time, so one load of a weight vector serves kDotRows rows
// and the weight tile stays in cache across the chunk's rows; the items are shared out over the threads.
// Every dot product is summed in float32 in one fixed order (8 lanes across the inner dim, the lanes summed by
// hsum8, then the tail: rowwise_linear's order, moe.cpp) whatever tile it falls in, so a row's result does not
// depend on which rows or slots share its batch, bit for bit. Built with -ffp-contract=off like the rest.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using namespace ladle_cpu;

constexpr int64_t kDotRows = 2, kDotCols = 4;
// Rows of one slot per work item, and about how many bytes of weight its columns span (kept in L2 across them).
constexpr int64_t kRowChunk = 32;
constexpr int64_t kChunkWeightBytes = 64 * 1024;
// Below this many multiply-adds one thread runs it all: waking the others costs more than they would save.
constexpr int64_t kMinParallelWork = 1 << 17;

// out[r][col + j] (= or +=) in[r] . w[j] for R rows of `in` and J rows of w (`inner` floats each, w's contiguous),
// each dot product in float32 in one fixed order: 8 lanes across the inner dim, hsum8, then the tail.
template <int64_t R, int64_t J, bool kAdd>
inline void dot_tile(const float* const* in, const float* w, int64_t inner, float* const* out, int64_t col) {
  vec8 acc[R][J] = {};
  int64_t i = 0;
  for (; i + kLanes8 <= inner; i += kLanes8) {
    vec8 wv[J];
    for (int64_t j = 0; j < J; ++j) wv[j] = load8(w + j * inner + i);
    for (int64_t r = 0; r < R; ++r) {
      const vec8 xv = load8(in[r] + i);
      for (int64_t j = 0; j < J; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < J; ++j) {
      float sum = hsum8(acc[r][j]);
      for (int64_t t = i; t < inner; ++t) sum += in[r][t] * w[j * inner + t];
      if constexpr (kAdd) {
        out[r][col + j] += sum;
      } else {
        out[r][col + j] = sum;
      }
    }
  }
}

// Columns [col_begin, col_end) of R rows: kDotCols at a time, then the last ones one by one (the same sums).
template <int64_t R, bool kAdd>
void row_tile(const float* const* in, const float* w, int64_t inner, float* const* out, int64_t col_begin,
              int64_t col_end) {
  int64_t j = col_begin;
  for (; j + kDotCols <= col_end; j += kDotCols) dot_tile<R, kDotCols, kAdd>(in, w + j * inner, inner, out, j);
  for (; j < col_end; ++j) dot_tile<R, 1, kAdd>(in, w + j * inner, inner, out, j);
}

// One product over the batch: row t of `in` (in_stride apart) times the weight of its slot ([cols, inner] at
// weight + slot * cols * inner) into row t of `out` (out_stride apart).
struct Product {
  const float* in;
  int64_t in_stride;
  const float* weight;
  float* out;
  int64_t out_stride;
  int64_t cols, inner;
};

// Up to kRowChunk rows of one slot: order[begin, end).
struct RowChunk {
  int64_t slot, begin, end;
};

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

// Columns [col_begin, col_end) of the rows order[chunk.begin, chunk.end), all of slot chunk.slot.
template <bool kAdd>
void run_chunk(const Product& p, const int64_t* order, const RowChunk& chunk, int64_t col_begin, int64_t col_end) {
  const float* w = p.weight + chunk.slot * p.cols * p.inner;
  const float* in[kDotRows];
  float* out[kDotRows];
  int64_t m = chunk.begin;
  for (; m + kDotRows <= chunk.end; m += kDotRows) {
    for (int64_t r = 0; r < kDotRows; ++r) {
      in[r] = p.in + order[m + r] * p.in_stride;
      out[r] = p.out + order[m + r] * p.out_stride;
    }
    row_tile<kDotRows, kAdd>(in, w, p.inner, out, col_begin, col_end);
  }
  for (; m < chunk.end; ++m) {
    in[0] = p.in + order[m] * p.in_stride;
    out[0] = p.out + order[m] * p.out_stride;
    row_tile<1, kAdd>(in, w, p.inner, out, col_begin, col_end);
  }
}

// The product for the rows grouped by slot: every (row chunk, column chunk) item, shared out over the threads in
// even runs when there is enough work.
template <bool kAdd>
void run_product(const Product& p, const SlotGroups& groups) {
  const std::vector<int64_t>& order = groups.order;
  const std::vector<int64_t>& start = groups.start;
  std::vector<RowChunk> chunks;
  for (int64_t s = 0; s + 1 < static_cast<int64_t>(start.size()); ++s) {
    for (int64_t m = start[s]; m < start[s + 1]; m += kRowChunk) {
      chunks.push_back({s, m, std::min(m + kRowChunk, start[s + 1])});
    }
  }
  const int64_t fitting = kChunkWeightBytes / static_cast<int64_t>(sizeof(float)) / std::max<int64_t>(1, p.inner);
  const int64_t col_chunk = std::max(kDotCols, fitting / kDotCols * kDotCols);
  const int64_t col_chunks = (p.cols + col_chunk - 1) / col_chunk;
  const int64_t items = static_cast<int64_t>(chunks.size()) * col_chunks;
  const int64_t work = static_cast<int64_t>(order.size()) * p.cols * p.inner;
  at::parallel_for(0, items, work < kMinParallelWork ? items : 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t col_begin = item % col_chunks * col_chunk;
      run_chunk<kAdd>(p, order.data(), chunks[item / col_chunks], col_begin, std::min(p.cols, col_begin + col_chunk));
    }
  });
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

void check_weight(const at::Tensor& w, const char* name, int64_t inner) {
  LADLE_CHECK(w.dim() == 3 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(2) == inner,
              "%s must be a contiguous [S, n, %lld] float32 tensor", name, static_cast<long long>(inner));
}

}  // namespace

namespace ladle_cpu {

at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a, const at::Tensor& slots) {
  check_rows(x, "x");
  const int64_t tokens = x.size(0), k = x.size(1);
  check_weight(a, "a", k);
  const int64_t rank = a.size(1);
  const SlotGroups groups = group_slots(slots, tokens, a.size(0));
  at::Tensor y = at::zeros({tokens, rank}, x.options());
  const Product product{x.data_ptr<float>(), x.stride(0), a.data_ptr<float>(), y.data_ptr<float>(), rank, rank, k};
  run_product<false>(product, groups);
  return y;
}

void lora_expand(const at::Tensor& out, const at::Tensor& y, const at::Tensor& b, const at::Tensor& slots) {
  check_rows(out, "out");
  check_rows(y, "y");
  const int64_t tokens = out.size(0), rank = y.size(1);
  LADLE_CHECK(y.size(0) == tokens, "y has %lld rows, out %lld", static_cast<long long>(y.size(0)),
              static_cast<long long>(tokens));
  check_weight(b, "b", rank);
  LADLE_CHECK(b.size(1) == out.size(1), "b has %lld output features, out %lld", static_cast<long long>(b.size(1)),
              static_cast<long long>(out.size(1)));
  const SlotGroups groups = group_slots(slots, tokens, b.size(0));
  const Product product{y.data_ptr<float>(), y.stride(0), b.data_ptr<float>(), out.data_ptr<float>(), out.stride(0),
                        b.size(1), rank};
  run_product<true>(product, groups);
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def("lora_shrink(Tensor x, Tensor a, Tensor slots) -> Tensor");
  m.def("lora_expand(Tensor(a!) out, Tensor y, Tensor b, Tensor slots) -> ()");
  m.impl("lora_shrink", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::lora_shrink));
  m.impl("lora_expand", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::lora_expand));
}
