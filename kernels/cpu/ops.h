// The CPU kernels' tensor-level entry points, shared by their TORCH_LIBRARY registrations (torch.ops.ladle_cpu.*)
// and by the decode stack (decoder.cpp), which calls them directly. Contracts: kernels/reference.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace ladle_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& cos_sin_cache);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q4(const at::Tensor& qs, const at::Tensor& scales,
                                                       const at::Tensor& mins);
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q8(const at::Tensor& qs, const at::Tensor& scales);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t n_rows);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales);
at::Tensor seeded_log_uniforms(const at::Tensor& keys, const at::Tensor& tokens);

}  // namespace ladle_cpu
