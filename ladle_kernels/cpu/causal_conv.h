// What the recurrent layers' C++ cores (Gated DeltaNet's gated_delta.cpp, Mamba-2's mamba2.cpp) share: their
// arguments' checks, a step's sequences (each one's state row, token span and freshness), and the short depthwise
// causal convolution they run first (ladle_kernels/causal_conv.py's contract), then SiLU.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace ladle_cpu {

inline void check_rows(const at::Tensor& t, int64_t rows, int64_t width, const char* name) {
  LADLE_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == width && t.scalar_type() == at::kFloat &&
                  t.stride(1) == 1,
              "%s must be float32 [%lld, %lld] with a contiguous last dim", name, static_cast<long long>(rows),
              static_cast<long long>(width));
}

inline void check_vector(const at::Tensor& t, int64_t n, const char* name) {
  LADLE_CHECK(t.numel() == n && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "%s must be %lld contiguous float32 values", name, static_cast<long long>(n));
}

// A step's sequences: sequence r's state is row slot[r] of the states, its tokens [starts[r], starts[r + 1]), and it
// starts from zeros where fresh[r]. The lists own the data the pointers read.
struct StepSequences {
  at::Tensor slot_list, fresh_list;
  const int64_t* slot;
  const bool* fresh;
  std::vector<int64_t> starts;
  int64_t rows() const { return static_cast<int64_t>(starts.size()) - 1; }
};

// `slots` and `query_lens` (int64) and `fresh` (bool), one entry each per sequence, checked against `states`' rows
// and the step's `tokens`.
inline StepSequences step_sequences(const at::Tensor& slots, const at::Tensor& query_lens, const at::Tensor& fresh,
                                    const at::Tensor& states, int64_t tokens) {
  const int64_t rows = slots.numel();
  LADLE_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && query_lens.dim() == 1 &&
                  query_lens.scalar_type() == at::kLong && query_lens.numel() == rows && fresh.dim() == 1 &&
                  fresh.scalar_type() == at::kBool && fresh.numel() == rows,
              "slots and query_lens (int64) and fresh (bool) must have one entry per sequence");
  StepSequences step;
  step.slot_list = slots.contiguous();
  step.fresh_list = fresh.contiguous();
  step.slot = step.slot_list.data_ptr<int64_t>();
  step.fresh = step.fresh_list.data_ptr<bool>();
  const at::Tensor len_list = query_lens.contiguous();
  const int64_t* len_ptr = len_list.data_ptr<int64_t>();
  step.starts.assign(rows + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    LADLE_CHECK(step.slot[r] >= 0 && step.slot[r] < states.size(0), "sequence %lld's slot %lld is not a state row",
                static_cast<long long>(r), static_cast<long long>(step.slot[r]));
    step.starts[r + 1] = step.starts[r] + len_ptr[r];
  }
  LADLE_CHECK(step.starts[rows] == tokens, "the query lengths add up to %lld tokens, not %lld",
              static_cast<long long>(step.starts[rows]), static_cast<long long>(tokens));
  return step;
}

// A convolution's weight [channels, 1, K] by tap: [K, channels], so a tap's weights over a block of channels are
// contiguous.
inline std::vector<float> taps_by_tap(const at::Tensor& conv_weight, int64_t channels, int64_t kernel) {
  std::vector<float> taps(kernel * channels);
  const float* w = conv_weight.data_ptr<float>();
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t j = 0; j < kernel; ++j) taps[j * channels + c] = w[c * kernel + j];
  return taps;
}

// torch's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x)).
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

inline vec16 silu_lanes(vec16 x) { return x / (1.f + exp_lanes(-x)); }

// One sequence's tokens [first, end) and channels [c0, c1): out[t][c] = silu(sum_j w[j][c] x[t-K+1+j][c] (+ bias[c]))
// over its state's inputs then its tokens (zeros for a fresh one), the taps in order, the bias (where not null)
// after them; then the state keeps the last K - 1 inputs. `taps` is [K, channels] (a tap's weights contiguous).
// Each output depends on its channel's inputs alone, in one fixed order: the same bits alone, batched or chunked.
inline void convolve_silu(const float* mixed, int64_t mixed_stride, const float* taps, const float* bias,
                          int64_t kernel, int64_t channels, float* state, bool fresh, int64_t first, int64_t end,
                          int64_t c0, int64_t c1, float* out) {
  const int64_t history = kernel - 1, count = end - first;
  if (fresh)
    for (int64_t i = 0; i < history; ++i) std::fill(state + i * channels + c0, state + i * channels + c1, 0.f);
  // Input row `index` of the window: the state's rows first, then the tokens'.
  auto input = [&](int64_t index) -> const float* {
    return index < history ? state + index * channels : mixed + (first + index - history) * mixed_stride;
  };
  const int64_t vector_end = c0 + (std::min(c1, channels - channels % kLanes) - c0) / kLanes * kLanes;
  for (int64_t t = 0; t < count; ++t) {
    float* o = out + (first + t) * channels;
    int64_t c = c0;
    for (; c < vector_end; c += kLanes) {
      vec16 acc = load(taps + c) * load(input(t) + c);
      for (int64_t j = 1; j < kernel; ++j) acc = acc + load(taps + j * channels + c) * load(input(t + j) + c);
      if (bias != nullptr) acc = acc + load(bias + c);
      store(o + c, silu_lanes(acc));
    }
    for (; c < c1; ++c) {
      float acc = taps[c] * input(t)[c];
      for (int64_t j = 1; j < kernel; ++j) acc = acc + taps[j * channels + c] * input(t + j)[c];
      if (bias != nullptr) acc = acc + bias[c];
      o[c] = silu(acc);
    }
  }
  // The window's last K - 1 rows become the state: shifted within it first where the chunk is shorter than that.
  for (int64_t i = 0; i < history; ++i) {
    const float* src = input(count + i);
    if (src != state + i * channels) std::copy(src + c0, src + c1, state + i * channels + c0);
  }
}

constexpr int64_t kChannelBlock = 256;  // channels of one convolution task (a multiple of kLanes)

// `convolve_silu` of a step's sequences (`step`), each over `input`'s rows [T, channels] after its state row in
// `states` (its first (K - 1) * channels values, advanced), the tasks (sequence, block of channels) in parallel.
inline at::Tensor convolve_step(const at::Tensor& input, const at::Tensor& conv_weight, const float* bias,
                                int64_t kernel, const at::Tensor& states, const StepSequences& step) {
  const int64_t tokens = input.size(0), channels = input.size(1);
  const std::vector<float> taps = taps_by_tap(conv_weight, channels, kernel);
  at::Tensor convolved = at::empty({tokens, channels}, input.options());
  const float* input_ptr = input.data_ptr<float>();
  float* conv_ptr = convolved.data_ptr<float>();
  float* state_ptr = states.data_ptr<float>();
  const int64_t slot_stride = states.stride(0), blocks = (channels + kChannelBlock - 1) / kChannelBlock;
  at::parallel_for(0, step.rows() * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / blocks, c0 = task % blocks * kChannelBlock;
      convolve_silu(input_ptr, input.stride(0), taps.data(), bias, kernel, channels,
                    state_ptr + step.slot[row] * slot_stride, step.fresh[row], step.starts[row],
                    step.starts[row + 1], c0, std::min(c0 + kChannelBlock, channels), conv_ptr);
    }
  });
  return convolved;
}

}  // namespace ladle_cpu
