// Mamba-2's core (the selective state space mixer of Granite 4.0's hybrids) over one step's sequences on the CPU: the
// contract of ladle_kernels/mamba2.py's mamba2_mixer, everything between the layer's input projection and its output
// projection, in three passes:
//   1. the short causal convolution (with its bias) and SiLU of each sequence's x, B and C after its state's last
//      K - 1 inputs, the channels in blocks (causal_conv.h);
//   2. the scan, each (sequence, head) a task whose P x N state matrix stays in cache while its tokens pass in order:
//      with dt = softplus(dt_raw + dt_bias), A = -exp(A_log) and the head's group's B and C,
//        S = exp(dt A) S + (dt x) B^T;  y = S C + D x
//      where the reference takes a prefill chunk in the chunked (state space dual) form;
//   3. the gated RMSNorm: rms_norm(y * silu(z)) over each group's heads, times the norm's weight (without a weight:
//      y * silu(z) alone, for a caller whose groups span tensor-parallel ranks).
// Every value of a token is computed by code that depends only on its index within its row (vector lanes, then a
// scalar tail) and on its sequence's earlier tokens, in one fixed order (built with -ffp-contract=off): a sequence's
// output is the same alone, batched, or prefilled in chunks of any size, bit for bit.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "causal_conv.h"
#include "ops.h"
#include "vec.h"

namespace {

using namespace ladle_cpu;

// One token of one head: S [P, N] = S * decay + (dt x[p]) B; y[p] = S[p] . C + d x[p]. Each row of S is N floats:
// 16 lanes of products, their tree (hsum), then the tail in order, for any N.
void scan_step(float* s, const float* x, const float* b, const float* c, float dt, float decay, float d, int64_t p,
               int64_t n, float* y) {
  const int64_t vector_end = n - n % kLanes8;
  const vec8 dv = vec8{} + decay;
  for (int64_t i = 0; i < p; ++i) {
    float* row = s + i * n;
    const float w = dt * x[i];
    const vec8 wv = vec8{} + w;
    vec8 acc = {};
    int64_t j = 0;
    for (; j < vector_end; j += kLanes8) {
      const vec8 next = load8(row + j) * dv + wv * load8(b + j);
      store8(row + j, next);
      acc = acc + next * load8(c + j);
    }
    float sum = hsum8(acc);
    for (; j < n; ++j) {
      row[j] = row[j] * decay + w * b[j];
      sum += row[j] * c[j];
    }
    y[i] = sum + d * x[i];
  }
}

}  // namespace

namespace ladle_cpu {

at::Tensor mamba2_mixer(const at::Tensor& xbc, const at::Tensor& z, const at::Tensor& dt, const at::Tensor& conv_weight,
                        const std::optional<at::Tensor>& conv_bias, const at::Tensor& a_log, const at::Tensor& dt_bias,
                        const at::Tensor& d, const std::optional<at::Tensor>& norm_weight, double eps, int64_t groups,
                        const at::Tensor& states, const at::Tensor& slots, const at::Tensor& query_lens,
                        const at::Tensor& fresh) {
  const int64_t tokens = xbc.size(0), channels = xbc.size(1), heads = dt.size(1), inner = z.size(1);
  LADLE_CHECK(heads > 0 && groups > 0 && heads % groups == 0 && inner % heads == 0 && channels > inner &&
                  (channels - inner) % (2 * groups) == 0,
              "%lld channels are not x (%lld heads, %lld wide), B and C (%lld groups)",
              static_cast<long long>(channels), static_cast<long long>(heads), static_cast<long long>(inner),
              static_cast<long long>(groups));
  const int64_t p = inner / heads, n = (channels - inner) / (2 * groups), per_group = heads / groups;
  check_rows(xbc, tokens, channels, "xbc");
  check_rows(z, tokens, inner, "z");
  check_rows(dt, tokens, heads, "dt");
  const int64_t kernel = conv_weight.size(0) == channels ? conv_weight.numel() / channels : 0;
  LADLE_CHECK(kernel >= 2, "conv_weight must be [channels, 1, K] with K >= 2");
  check_vector(conv_weight, channels * kernel, "conv_weight");
  if (conv_bias.has_value()) check_vector(*conv_bias, channels, "conv_bias");
  check_vector(a_log, heads, "A_log");
  check_vector(dt_bias, heads, "dt_bias");
  check_vector(d, heads, "D");
  if (norm_weight.has_value()) check_vector(*norm_weight, inner, "norm_weight");
  const int64_t history = kernel - 1, matrix = p * n;
  LADLE_CHECK(states.dim() == 2 && states.size(1) == history * channels + heads * matrix &&
                  states.scalar_type() == at::kFloat && states.stride(1) == 1,
              "states must be float32 [slots, %lld]", static_cast<long long>(history * channels + heads * matrix));
  const StepSequences step = step_sequences(slots, query_lens, fresh, states, tokens);
  const int64_t rows = step.rows();
  const int64_t* slot_ptr = step.slot;
  const bool* fresh_ptr = step.fresh;
  const std::vector<int64_t>& starts = step.starts;
  const float* bias = conv_bias.has_value() ? conv_bias->data_ptr<float>() : nullptr;
  const at::Tensor convolved = convolve_step(xbc, conv_weight, bias, kernel, states, step);
  const float* conv_ptr = convolved.data_ptr<float>();
  at::Tensor scanned = at::empty({tokens, inner}, xbc.options());
  at::Tensor out = at::empty({tokens, inner}, xbc.options());
  float* scan_ptr = scanned.data_ptr<float>();
  float* state_ptr = states.data_ptr<float>();
  const int64_t slot_stride = states.stride(0);

  const float* dt_ptr = dt.data_ptr<float>();
  const float* a_log_ptr = a_log.data_ptr<float>();
  const float* dt_bias_ptr = dt_bias.data_ptr<float>();
  const float* d_ptr = d.data_ptr<float>();
  const int64_t b_offset = inner, c_offset = inner + groups * n;
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / heads, head = task % heads, group = head / per_group;
      float* s = state_ptr + slot_ptr[row] * slot_stride + history * channels + head * matrix;
      if (fresh_ptr[row]) std::fill(s, s + matrix, 0.f);
      const float a = -std::exp(a_log_ptr[head]);
      for (int64_t t = starts[row]; t < starts[row + 1]; ++t) {
        const float* conv_t = conv_ptr + t * channels;
        const float step = softplus(dt_ptr[t * dt.stride(0) + head] + dt_bias_ptr[head]);
        scan_step(s, conv_t + head * p, conv_t + b_offset + group * n, conv_t + c_offset + group * n, step,
                  std::exp(step * a), d_ptr[head], p, n, scan_ptr + t * inner + head * p);
      }
    }
  });

  const float* z_ptr = z.data_ptr<float>();
  const float* nw = norm_weight.has_value() ? norm_weight->data_ptr<float>() : nullptr;
  float* out_ptr = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  const int64_t width = inner / groups, width_vector = width - width % kLanes;
  at::parallel_for(0, tokens * groups, std::max<int64_t>(1, 4096 / width), [&](int64_t begin, int64_t end) {
    std::vector<float> gated(width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / groups, offset = task % groups * width;
      const float* y = scan_ptr + t * inner + offset;
      const float* gate = z_ptr + t * z.stride(0) + offset;
      float* o = out_ptr + t * inner + offset;
      const float* weight = nw + offset;
      int64_t j = 0;
      for (; j < width_vector; j += kLanes) store(gated.data() + j, load(y + j) * silu_lanes(load(gate + j)));
      for (; j < width; ++j) gated[j] = y[j] * silu(gate[j]);
      if (nw == nullptr) {  // the gate alone
        std::copy(gated.begin(), gated.end(), o);
        continue;
      }
      const float inv = 1.f / std::sqrt(sum_of_squares(gated.data(), width) / static_cast<float>(width) + feps);
      j = 0;
      for (; j < width_vector; j += kLanes) store(o + j, load(weight + j) * (load(gated.data() + j) * inv));
      for (; j < width; ++j) o[j] = weight[j] * (gated[j] * inv);
    }
  });
  return out;
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def(
      "mamba2_mixer(Tensor xbc, Tensor z, Tensor dt, Tensor conv_weight, Tensor? conv_bias, Tensor a_log, "
      "Tensor dt_bias, Tensor d, Tensor? norm_weight, float eps, int groups, Tensor(a!) states, Tensor slots, "
      "Tensor query_lens, Tensor fresh) -> Tensor");
  m.impl("mamba2_mixer", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::mamba2_mixer));
}
