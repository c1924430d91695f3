// The CPU kernels' tensor-level entry points, shared by their TORCH_LIBRARY registrations (torch.ops.ladle_cpu.*)
// and by the decode stack (decoder.cpp), which calls them directly. Contracts: ladle_kernels/reference.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdio>
#include <optional>
#include <tuple>

// TORCH_CHECK whose message holds numbers (printf-style), formatted here and raised as one C string, the way
// TORCH_CHECK raises a literal message. Where TORCH_CHECK formats numbers itself, the H200 hosts' torch 2.11
// wheels with g++ 13.3 crash (SIGSEGV) instead of raising (tests/unit/kernels/test_cpu_ops.py).
#define LADLE_CHECK(cond, ...)                                                       \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      char ladle_check_message[256];                                                 \
      std::snprintf(ladle_check_message, sizeof(ladle_check_message), __VA_ARGS__);  \
      TORCH_CHECK(false, static_cast<const char*>(ladle_check_message));             \
    }                                                                                \
  } while (0)

namespace ladle_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& cos_sin_cache);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);
at::Tensor clamped_swiglu(const at::Tensor& x, double alpha, double limit, double up_offset);
void write_kv_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                                  const std::optional<at::Tensor>& sinks = std::nullopt,
                                  const std::optional<at::Tensor>& alibi_slopes = std::nullopt);
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q4(const at::Tensor& qs, const at::Tensor& scales,
                                                       const at::Tensor& mins);
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q8(const at::Tensor& qs, const at::Tensor& scales);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t n_rows);
at::Tensor packed_linear_parts(const at::Tensor& x, at::TensorList packed, at::TensorList scales,
                               at::TensorList mins, at::IntArrayRef n_rows);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales);
at::Tensor seeded_log_uniforms(const at::Tensor& keys, const at::Tensor& tokens);
at::Tensor moe_packed(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                      const at::Tensor& w13, const at::Tensor& w13_scales, const at::Tensor& w13_mins,
                      const at::Tensor& w2, const at::Tensor& w2_scales, const at::Tensor& w2_mins,
                      int64_t intermediate, bool gelu = false, const std::optional<at::Tensor>& b13 = std::nullopt,
                      const std::optional<at::Tensor>& b2 = std::nullopt, double swiglu_alpha = 0.,
                      double swiglu_limit = 0., bool relu2 = false, double swiglu_up_offset = 1.);
at::Tensor rowwise_linear(const at::Tensor& x, const at::Tensor& w);
at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a, const at::Tensor& slots);
void lora_expand(const at::Tensor& out, const at::Tensor& y, const at::Tensor& b, const at::Tensor& slots);
at::Tensor gated_delta_net(const at::Tensor& mixed, const at::Tensor& z, const at::Tensor& a, const at::Tensor& b,
                           const at::Tensor& conv_weight, const at::Tensor& a_log, const at::Tensor& dt_bias,
                           const at::Tensor& norm_weight, double eps, int64_t key_heads, const at::Tensor& states,
                           const at::Tensor& slots, const at::Tensor& query_lens, const at::Tensor& fresh,
                           double beta_scale, bool sigmoid_gate, double decay_bound);
at::Tensor sigmoid_mul(const at::Tensor& x, const at::Tensor& gate);
at::Tensor mamba2_mixer(const at::Tensor& xbc, const at::Tensor& z, const at::Tensor& dt, const at::Tensor& conv_weight,
                        const std::optional<at::Tensor>& conv_bias, const at::Tensor& a_log, const at::Tensor& dt_bias,
                        const at::Tensor& d, const std::optional<at::Tensor>& norm_weight, double eps, int64_t groups,
                        const at::Tensor& states, const at::Tensor& slots, const at::Tensor& query_lens,
                        const at::Tensor& fresh);

}  // namespace ladle_cpu
