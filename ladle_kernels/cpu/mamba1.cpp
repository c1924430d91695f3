// Mamba-1's selective scan (the mixer of Jamba's, Mamba's and Falcon Mamba's layers) over one step's sequences on the
// CPU: the contract of ladle_kernels/mamba1.py's mamba1_scan, between the layer's convolution and projections and its
// output projection; and its convolution before them (mamba1_conv: causal_conv.h's, with its bias, then SiLU, the
// contract of ladle_kernels/causal_conv.py's biased_convolution). Each (sequence, block of channels) is a scan task
// whose N-wide rows stay in cache while its tokens pass in order; per channel e of a token, with its time step dt[e] (after softplus) and A[e] = -exp(A_log[e]) [N]:
//   h[e] = exp(dt[e] A[e]) h[e] + (dt[e] x[e]) B;  y[e] = (h[e] . C + D[e] x[e]) * silu(z[e])
// as the reference runs a prefill chunk token by token too (its decays are per channel and entry: no chunked form).
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

#include "causal_conv.h"
#include "ops.h"
#include "vec.h"

namespace {

using namespace ladle_cpu;

// Channels a scan task takes: enough rows to keep a core busy between tokens, few enough that a decode step's rows
// spread over every core (their rows, 64 x N floats, stay in L1).
constexpr int64_t kScanBlock = 64;

// One token over channels [begin, end): their rows of h [E, N] advance by it, y[e] gets its gated output.
// Its rows in 8-lane vectors (one AVX2 register each: 16-lane ones spill there), then the tail in order.
void scan_token(float* h, const float* a, const float* x, const float* dt, const float* z, const float* b,
                const float* c, const float* d, int64_t begin, int64_t end, int64_t n, float* y) {
  const int64_t vector_end = n - n % kLanes8;
  for (int64_t e = begin; e < end; ++e) {
    float* row = h + e * n;
    const float* decay_rate = a + e * n;
    const float step = dt[e], pushed = step * x[e];
    const vec8 step_v = vec8{} + step, pushed_v = vec8{} + pushed;
    vec8 acc = {};
    int64_t j = 0;
    for (; j < vector_end; j += kLanes8) {
      const vec8 next = load8(row + j) * exp_lanes8(step_v * load8(decay_rate + j)) + pushed_v * load8(b + j);
      store8(row + j, next);
      acc = acc + next * load8(c + j);
    }
    float sum = hsum8(acc);
    for (; j < n; ++j) {
      row[j] = row[j] * std::exp(step * decay_rate[j]) + pushed * b[j];
      sum += row[j] * c[j];
    }
    y[e] = (sum + d[e] * x[e]) * silu(z[e]);
  }
}

}  // namespace

namespace ladle_cpu {

at::Tensor mamba1_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& c, const at::Tensor& d, const at::Tensor& z, const at::Tensor& states,
                       const at::Tensor& slots, const at::Tensor& query_lens, const at::Tensor& fresh) {
  const int64_t tokens = x.size(0), channels = x.size(1), n = a.dim() == 2 ? a.size(1) : 0;
  LADLE_CHECK(n > 0 && a.size(0) == channels, "A must be [%lld, N]", static_cast<long long>(channels));
  check_vector(a, channels * n, "A");
  check_vector(d, channels, "D");
  check_rows(x, tokens, channels, "x");
  check_rows(dt, tokens, channels, "dt");
  check_rows(z, tokens, channels, "z");
  check_rows(b, tokens, n, "B");
  check_rows(c, tokens, n, "C");
  LADLE_CHECK(states.dim() == 2 && states.size(1) == channels * n && states.scalar_type() == at::kFloat &&
                  states.stride(1) == 1,
              "states must be float32 [slots, %lld] with a contiguous last dim", static_cast<long long>(channels * n));
  const StepSequences step = step_sequences(slots, query_lens, fresh, states, tokens);
  const int64_t rows = step.rows(), blocks = (channels + kScanBlock - 1) / kScanBlock;
  at::Tensor out = at::empty({tokens, channels}, x.options());
  float* out_ptr = out.data_ptr<float>();
  float* state_ptr = states.data_ptr<float>();
  const int64_t slot_stride = states.stride(0);
  const float *x_ptr = x.data_ptr<float>(), *dt_ptr = dt.data_ptr<float>(), *z_ptr = z.data_ptr<float>();
  const float *a_ptr = a.data_ptr<float>(), *b_ptr = b.data_ptr<float>(), *c_ptr = c.data_ptr<float>();
  const float* d_ptr = d.data_ptr<float>();
  at::parallel_for(0, rows * blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t row = task / blocks, begin = task % blocks * kScanBlock;
      const int64_t end = std::min(channels, begin + kScanBlock);
      float* h = state_ptr + step.slot[row] * slot_stride;
      if (step.fresh[row]) std::fill(h + begin * n, h + end * n, 0.f);
      for (int64_t t = step.starts[row]; t < step.starts[row + 1]; ++t) {
        scan_token(h, a_ptr, x_ptr + t * x.stride(0), dt_ptr + t * dt.stride(0), z_ptr + t * z.stride(0),
                   b_ptr + t * b.stride(0), c_ptr + t * c.stride(0), d_ptr, begin, end, n, out_ptr + t * channels);
      }
    }
  });
  return out;
}

at::Tensor mamba1_conv(const at::Tensor& x, const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
                       const at::Tensor& states, const at::Tensor& slots, const at::Tensor& query_lens,
                       const at::Tensor& fresh) {
  const int64_t tokens = x.size(0), channels = x.size(1);
  check_rows(x, tokens, channels, "x");
  const int64_t kernel = conv_weight.size(0) == channels ? conv_weight.numel() / channels : 0;
  LADLE_CHECK(kernel >= 2, "conv_weight must be [channels, 1, K] with K >= 2");
  check_vector(conv_weight, channels * kernel, "conv_weight");
  if (conv_bias.has_value()) check_vector(*conv_bias, channels, "conv_bias");
  LADLE_CHECK(states.dim() == 2 && states.size(1) >= (kernel - 1) * channels && states.scalar_type() == at::kFloat &&
                  states.stride(1) == 1,
              "states must be float32 [slots, %lld+]", static_cast<long long>((kernel - 1) * channels));
  const StepSequences step = step_sequences(slots, query_lens, fresh, states, tokens);
  return convolve_step(x, conv_weight, conv_bias.has_value() ? conv_bias->data_ptr<float>() : nullptr, kernel, states,
                       step);
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def(
      "mamba1_scan(Tensor x, Tensor dt, Tensor a, Tensor b, Tensor c, Tensor d, Tensor z, Tensor(a!) states, "
      "Tensor slots, Tensor query_lens, Tensor fresh) -> Tensor");
  m.impl("mamba1_scan", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::mamba1_scan));
  m.def(
      "mamba1_conv(Tensor x, Tensor conv_weight, Tensor? conv_bias, Tensor(a!) states, Tensor slots, "
      "Tensor query_lens, Tensor fresh) -> Tensor");
  m.impl("mamba1_conv", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::mamba1_conv));
}
