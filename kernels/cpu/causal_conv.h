// The short depthwise causal convolution the recurrent layers' C++ cores run first (kernels/causal_conv.py's
// contract): Gated DeltaNet's (gated_delta.cpp) and Mamba-2's (mamba2.cpp), then SiLU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace ladle_cpu {

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

}  // namespace ladle_cpu
