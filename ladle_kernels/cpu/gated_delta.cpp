// Gated DeltaNet's core (the linear attention of Qwen3-Next and Qwen3.5) over one step's sequences on the CPU: the
// contract of ladle_kernels/gated_delta.py's gated_delta_net, everything between the layer's input projection and its
// output projection, in three passes:
//   1. the short causal convolution and SiLU of each sequence's tokens after its state's last K - 1 inputs, the
//      channels in blocks (the state's inputs advance: causal_conv.h);
//   2. the gated delta rule, each (sequence, value head) a task whose Dk x Dv state matrix stays in cache while its
//      tokens pass in order: with q and k L2-normalised (eps 1e-6 inside the root), q scaled by Dk^-0.5, the decay
//      g = -exp(A_log) softplus(a + dt_bias) and the write strength beta = beta_scale sigmoid(b) (OLMo Hybrid's
//      allow_neg_eigval: 2, so beta in (0, 2); else 1),
//        S *= exp(g);  recalled = k S;  S += k^T (beta (v - recalled));  o = q S
//      where the reference takes a prefill chunk in the chunked (WY) form;
//   3. the gated RMSNorm of each head's output, times SiLU(z) (sigmoid(z) with sigmoid_gate: Kimi Linear's).
// Kimi Delta Attention (Kimi Linear's linear layers) decays each key channel at its own rate: a and dt_bias hold
// Dk values per head, and S's row i is scaled by its own exp(g[i]). With a decay_bound (Ling 3's safe gate, < 0)
// g = decay_bound sigmoid(exp(A_log) (a + dt_bias)) instead: within (decay_bound, 0) whatever a is.
// Every value of a token is computed by code that depends only on its index within its row (vector lanes, then a
// scalar tail, by channel or dim) and on its sequence's earlier tokens, in one fixed order (built with
// -ffp-contract=off): a sequence's output is the same alone, batched, or prefilled in chunks of any size, bit for
// bit. (torch's own elementwise exp, sigmoid and SiLU are not: which elements of a tensor take its scalar tail
// depends on the tensor's size.)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "causal_conv.h"
#include "ops.h"
#include "vec.h"

namespace {

using namespace ladle_cpu;

// 1 / sqrt(sum(x^2) + 1e-6) of n floats, summed in index order.
inline float inverse_norm(const float* x, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.f / std::sqrt(sum + 1e-6f);
}

// 8-lane vectors of sums one stripe of `rule_step` keeps in registers (more spill on AVX2).
constexpr int64_t kStripeVectors = 4;

// One stripe of `rule_step`: the columns [column, column + NV * 8) of the state.
template <int64_t NV>
void rule_stripe(float* s, const float* qn, const float* kn, const float* v, const float* decay, vec8 beta_v,
                 int64_t dk, int64_t dv, int64_t column, float* o) {
  vec8 acc[NV];
  for (int64_t n = 0; n < NV; ++n) acc[n] = vec8{};
  for (int64_t i = 0; i < dk; ++i) {  // decay the stripe and recall k's value, in one pass
    float* row = s + i * dv + column;
    const vec8 ki = vec8{} + kn[i], d = vec8{} + decay[i];
    for (int64_t n = 0; n < NV; ++n) {
      const vec8 x = load8(row + n * kLanes8) * d;
      store8(row + n * kLanes8, x);
      acc[n] = acc[n] + x * ki;
    }
  }
  vec8 delta[NV];
  for (int64_t n = 0; n < NV; ++n) {
    delta[n] = (load8(v + column + n * kLanes8) - acc[n]) * beta_v;
    acc[n] = vec8{};
  }
  for (int64_t i = 0; i < dk; ++i) {  // write the correction and read q's output, in one pass
    float* row = s + i * dv + column;
    const vec8 ki = vec8{} + kn[i], qi = vec8{} + qn[i];
    for (int64_t n = 0; n < NV; ++n) {
      const vec8 x = load8(row + n * kLanes8) + ki * delta[n];
      store8(row + n * kLanes8, x);
      acc[n] = acc[n] + x * qi;
    }
  }
  for (int64_t n = 0; n < NV; ++n) store8(o + column + n * kLanes8, acc[n]);
}

// One token of the rule against one head's state s [Dk, Dv] (Dv a multiple of 8): S *= decay (row i by decay[i]);
// recalled = k S; S += k^T (beta (v - recalled)); o = q S. A column's recalled value depends on that column alone,
// so the state goes a stripe of columns at a time (`rule_stripe`), its recalled values and output in registers
// across the rows of S. Each element's products and sums are those of `rule_step_scalar`, in the same order: the
// same bits.
void rule_step(float* s, const float* qn, const float* kn, const float* v, const float* decay, float beta, int64_t dk,
               int64_t dv, float* o) {
  const vec8 beta_v = vec8{} + beta;
  for (int64_t column = 0; column < dv; column += kStripeVectors * kLanes8) {
    with_count<kStripeVectors>(std::min(kStripeVectors, (dv - column) / kLanes8), [&](auto vectors) {
      rule_stripe<decltype(vectors)::value>(s, qn, kn, v, decay, beta_v, dk, dv, column, o);
    });
  }
}

// `rule_step` for any Dv, element by element (`recalled` and `delta`: Dv floats of scratch).
void rule_step_scalar(float* s, const float* qn, const float* kn, const float* v, const float* decay, float beta,
                      int64_t dk, int64_t dv, float* recalled, float* delta, float* o) {
  std::fill(recalled, recalled + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    const float ki = kn[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= decay[i];
      recalled[j] += row[j] * ki;
    }
  }
  for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - recalled[j]) * beta;
  std::fill(o, o + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    const float ki = kn[i], qi = qn[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * delta[j];
      o[j] += row[j] * qi;
    }
  }
}

}  // namespace

namespace ladle_cpu {

at::Tensor gated_delta_net(const at::Tensor& mixed, const at::Tensor& z, const at::Tensor& a, const at::Tensor& b,
                           const at::Tensor& conv_weight, const at::Tensor& a_log, const at::Tensor& dt_bias,
                           const at::Tensor& norm_weight, double eps, int64_t key_heads, const at::Tensor& states,
                           const at::Tensor& slots, const at::Tensor& query_lens, const at::Tensor& fresh,
                           double beta_scale, bool sigmoid_gate, double decay_bound) {
  const int64_t tokens = mixed.size(0), channels = mixed.size(1), value_heads = b.size(1);
  LADLE_CHECK(value_heads > 0 && key_heads > 0 && value_heads % key_heads == 0 && z.size(1) % value_heads == 0,
              "%lld value heads over %lld key heads", static_cast<long long>(value_heads),
              static_cast<long long>(key_heads));
  const int64_t dv = z.size(1) / value_heads;
  const int64_t dk = (channels - value_heads * dv) / (2 * key_heads);
  LADLE_CHECK(dk > 0 && 2 * key_heads * dk + value_heads * dv == channels,
              "%lld channels are not q, k (%lld heads) and v (%lld heads of %lld)", static_cast<long long>(channels),
              static_cast<long long>(key_heads), static_cast<long long>(value_heads), static_cast<long long>(dv));
  check_rows(mixed, tokens, channels, "mixed");
  check_rows(z, tokens, value_heads * dv, "z");
  // One decay per head, or (Kimi Delta Attention) one per key channel of each head.
  const int64_t decays = a.size(1) == value_heads ? 1 : dk;
  check_rows(a, tokens, value_heads * decays, "a");
  check_rows(b, tokens, value_heads, "b");
  const int64_t kernel = conv_weight.size(0) == channels ? conv_weight.numel() / channels : 0;
  LADLE_CHECK(kernel >= 2, "conv_weight must be [channels, 1, K] with K >= 2");
  check_vector(conv_weight, channels * kernel, "conv_weight");
  check_vector(a_log, value_heads, "A_log");
  check_vector(dt_bias, value_heads * decays, "dt_bias");
  check_vector(norm_weight, dv, "norm_weight");
  const int64_t history = kernel - 1, matrix = dk * dv;
  LADLE_CHECK(states.dim() == 2 && states.size(1) == history * channels + value_heads * matrix &&
                  states.scalar_type() == at::kFloat && states.stride(1) == 1,
              "states must be float32 [slots, %lld]", static_cast<long long>(history * channels + value_heads * matrix));
  const StepSequences step = step_sequences(slots, query_lens, fresh, states, tokens);
  const int64_t rows = step.rows();
  const int64_t* slot_ptr = step.slot;
  const bool* fresh_ptr = step.fresh;
  const std::vector<int64_t>& starts = step.starts;
  const at::Tensor convolved = convolve_step(mixed, conv_weight, nullptr, kernel, states, step);
  const float* conv_ptr = convolved.data_ptr<float>();
  at::Tensor core = at::empty({tokens, value_heads * dv}, mixed.options());
  at::Tensor out = at::empty({tokens, value_heads * dv}, mixed.options());
  float* core_ptr = core.data_ptr<float>();
  float* state_ptr = states.data_ptr<float>();
  const int64_t slot_stride = states.stride(0);

  const float* a_ptr = a.data_ptr<float>();
  const float* b_ptr = b.data_ptr<float>();
  const float* a_log_ptr = a_log.data_ptr<float>();
  const float* dt_ptr = dt_bias.data_ptr<float>();
  const int64_t group = value_heads / key_heads, k_offset = key_heads * dk, v_offset = 2 * key_heads * dk;
  const float scale = 1.f / std::sqrt(static_cast<float>(dk));
  const float fbeta_scale = static_cast<float>(beta_scale);
  const float bound = static_cast<float>(decay_bound);
  at::parallel_for(0, rows * value_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qn(dk), kn(dk), recalled(dv), delta(dv), decay(dk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / value_heads, head = task % value_heads, key_head = head / group;
      float* s = state_ptr + slot_ptr[row] * slot_stride + history * channels + head * matrix;
      if (fresh_ptr[row]) std::fill(s, s + matrix, 0.f);
      const float rate = std::exp(a_log_ptr[head]);
      for (int64_t t = starts[row]; t < starts[row + 1]; ++t) {
        const float* qt = conv_ptr + t * channels + key_head * dk;
        const float* kt = qt + k_offset;
        const float* vt = conv_ptr + t * channels + v_offset + head * dv;
        const float q_inv = inverse_norm(qt, dk), k_inv = inverse_norm(kt, dk);
        for (int64_t i = 0; i < dk; ++i) {
          qn[i] = qt[i] * q_inv * scale;
          kn[i] = kt[i] * k_inv;
        }
        const float* at = a_ptr + t * a.stride(0) + head * decays;
        const float* dt = dt_ptr + head * decays;
        if (bound != 0.f) {
          for (int64_t i = 0; i < decays; ++i) decay[i] = std::exp(bound / (1.f + std::exp(-(rate * (at[i] + dt[i])))));
        } else {
          for (int64_t i = 0; i < decays; ++i) decay[i] = std::exp(-rate * softplus(at[i] + dt[i]));
        }
        if (decays == 1) std::fill(decay.begin() + 1, decay.end(), decay[0]);
        const float beta = fbeta_scale / (1.f + std::exp(-b_ptr[t * b.stride(0) + head]));
        float* o = core_ptr + t * value_heads * dv + head * dv;
        if (dv % kLanes8 == 0) {
          rule_step(s, qn.data(), kn.data(), vt, decay.data(), beta, dk, dv, o);
        } else {
          rule_step_scalar(s, qn.data(), kn.data(), vt, decay.data(), beta, dk, dv, recalled.data(), delta.data(), o);
        }
      }
    }
  });

  const float* z_ptr = z.data_ptr<float>();
  const float* nw = norm_weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  const int64_t dv_vector = dv - dv % kLanes;
  at::parallel_for(0, tokens * value_heads, std::max<int64_t>(1, 4096 / dv), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / value_heads, head = task % value_heads;
      const float* x = core_ptr + task * dv;
      const float* gate = z_ptr + t * z.stride(0) + head * dv;
      float* o = out_ptr + task * dv;
      const float inv = 1.f / std::sqrt(sum_of_squares(x, dv) / static_cast<float>(dv) + feps);
      int64_t j = 0;
      if (sigmoid_gate) {
        for (; j < dv_vector; j += kLanes)
          store(o + j, load(nw + j) * (load(x + j) * inv) * (1.f / (1.f + exp_lanes(-load(gate + j)))));
        for (; j < dv; ++j) o[j] = nw[j] * (x[j] * inv) * (1.f / (1.f + std::exp(-gate[j])));
        continue;
      }
      for (; j < dv_vector; j += kLanes)
        store(o + j, load(nw + j) * (load(x + j) * inv) * silu_lanes(load(gate + j)));
      for (; j < dv; ++j) o[j] = nw[j] * (x[j] * inv) * silu(gate[j]);
    }
  });
  return out;
}

at::Tensor sigmoid_mul(const at::Tensor& x, const at::Tensor& gate) {
  LADLE_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be float32 rows");
  check_rows(gate, x.size(0), x.size(1), "gate");
  const int64_t rows = x.size(0), n = x.size(1), vector_end = n - n % kLanes;
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  const float* g_ptr = gate.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, n)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x_ptr + r * x.stride(0);
      const float* gr = g_ptr + r * gate.stride(0);
      float* o = out_ptr + r * n;
      int64_t i = 0;
      for (; i < vector_end; i += kLanes) store(o + i, load(xr + i) * (1.f / (1.f + exp_lanes(-load(gr + i)))));
      for (; i < n; ++i) o[i] = xr[i] * (1.f / (1.f + std::exp(-gr[i])));
    }
  });
  return out;
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def(
      "gated_delta_net(Tensor mixed, Tensor z, Tensor a, Tensor b, Tensor conv_weight, Tensor a_log, "
      "Tensor dt_bias, Tensor norm_weight, float eps, int key_heads, Tensor(a!) states, Tensor slots, "
      "Tensor query_lens, Tensor fresh, float beta_scale=1.0, bool sigmoid_gate=False, float decay_bound=0.0) -> "
      "Tensor");
  m.def("sigmoid_mul(Tensor x, Tensor gate) -> Tensor");
  m.impl("gated_delta_net", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::gated_delta_net));
  m.impl("sigmoid_mul", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::sigmoid_mul));
}
