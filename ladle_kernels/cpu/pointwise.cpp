// Fused row-wise ops of the CPU path: RMSNorm (with the residual add), rotary embedding and SiLU-and-mul, each
// one pass over its rows instead of the reference's 3-9 torch ops. Contracts are those of the same names in
// ladle_kernels/reference.py; inputs are float32 with a contiguous last dim (rows may be strided), outputs are new
// contiguous tensors. Built with -ffp-contract=off: every product and sum rounds as in the reference's separate
// ops, so rotary and the residual add are bit-identical to it; RMSNorm sums its squares in another order and
// SiLU uses a polynomial exp (vec.h), both within float32 rounding of the reference.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "ops.h"
#include "vec.h"

namespace {

using namespace ladle_cpu;

// Rows per at::parallel_for task: about 32k floats, so a decode batch stays on one thread.
int64_t grain_rows(int64_t row_floats) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_floats)); }

void check_rows(const at::Tensor& x, const char* name) {
  LADLE_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "%s must be a [rows, n] float32 tensor with a contiguous last dim", name);
}

void check_weight(const at::Tensor& weight, int64_t n) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous(),
              "weight must be [n] float32");
}

// out[i] = weight[i] * (x[i] * (1 / sqrt(mean(x^2) + eps))) for one row of n floats.
inline void norm_row(const float* x, const float* weight, float eps, int64_t n, float* out) {
  const float inv = 1.f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(out + i, load(weight + i) * (load(x + i) * inv));
  for (; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

// Rotates the heads of one token: x [heads, dim] at `src` (head stride `head_stride`) into `dst` (contiguous).
inline void rotate_token(const float* src, int64_t heads, int64_t head_stride, int64_t dim, const float* cos,
                         const float* sin, float* dst) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* x1 = src + h * head_stride;
    const float* x2 = x1 + half;
    float* o1 = dst + h * dim;
    float* o2 = o1 + half;
    int64_t i = 0;
    for (; i + kLanes <= half; i += kLanes) {
      const vec16 a = load(x1 + i), b = load(x2 + i), c = load(cos + i), s = load(sin + i);
      store(o1 + i, a * c - b * s);
      store(o2 + i, b * c + a * s);
    }
    for (; i < half; ++i) {
      o1[i] = x1[i] * cos[i] - x2[i] * sin[i];
      o2[i] = x2[i] * cos[i] + x1[i] * sin[i];
    }
  }
}

void check_heads(const at::Tensor& x, const char* name) {
  LADLE_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1,
              "%s must be a [T, heads, dim] float32 tensor with a contiguous last dim", name);
}

}  // namespace

namespace ladle_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  check_weight(weight, n);
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  const float* w_ptr = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t stride = x.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(x_ptr + r * stride, w_ptr, feps, n, out_ptr + r * n);
  });
  return out;
}

// (rms_norm(x + residual), x + residual).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(residual.size(0) == rows && residual.size(1) == n, "x and residual differ in shape");
  check_weight(weight, n);
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor sum = at::empty({rows, n}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  const float* r_ptr = residual.data_ptr<float>();
  const float* w_ptr = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  float* sum_ptr = sum.data_ptr<float>();
  const int64_t x_stride = x.stride(0), r_stride = residual.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x_ptr + r * x_stride;
      const float* rr = r_ptr + r * r_stride;
      float* s = sum_ptr + r * n;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) store(s + i, load(xr + i) + load(rr + i));
      for (; i < n; ++i) s[i] = xr[i] + rr[i];
      norm_row(s, w_ptr, feps, n, out_ptr + r * n);
    }
  });
  return {out, sum};
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& cos_sin_cache) {
  check_heads(q, "q");
  check_heads(k, "k");
  const int64_t tokens = q.size(0), dim = q.size(2);
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == dim && dim % 2 == 0, "q and k must share T and an even dim");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == tokens && positions.scalar_type() == at::kLong,
              "positions must be [T] int64");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == dim && cos_sin_cache.scalar_type() == at::kFloat &&
                  cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be [max_positions, dim] float32");
  const at::Tensor pos = positions.contiguous();
  const int64_t* pos_ptr = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    LADLE_CHECK(pos_ptr[t] >= 0 && pos_ptr[t] < max_pos, "position %lld outside the rope cache",
                static_cast<long long>(pos_ptr[t]));
  }
  const int64_t q_heads = q.size(1), k_heads = k.size(1);
  at::Tensor q_out = at::empty({tokens, q_heads, dim}, q.options());
  at::Tensor k_out = at::empty({tokens, k_heads, dim}, k.options());
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = k.data_ptr<float>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  float* qo = q_out.data_ptr<float>();
  float* ko = k_out.data_ptr<float>();
  at::parallel_for(0, tokens, grain_rows((q_heads + k_heads) * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cache + pos_ptr[t] * dim;
      const float* sin = cos + dim / 2;
      rotate_token(q_ptr + t * q.stride(0), q_heads, q.stride(1), dim, cos, sin, qo + t * q_heads * dim);
      rotate_token(k_ptr + t * k.stride(0), k_heads, k.stride(1), dim, cos, sin, ko + t * k_heads * dim);
    }
  });
  return {q_out, k_out};
}

namespace {

// act(x[:, :d], x[:, d:]) for x [rows, 2d] with strided rows: `vector_act(gate, up)` on each full vector of lanes,
// `scalar_act` on the row's tail. A row's result depends on its values alone (each column in the same lane or tail,
// whatever the number of rows).
template <typename VectorAct, typename ScalarAct>
at::Tensor gated_and_mul(const at::Tensor& x, VectorAct vector_act, ScalarAct scalar_act) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0, "x's last dim must be even");
  at::Tensor out = at::empty({rows, d}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, grain_rows(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = x_ptr + r * stride;
      const float* up = gate + d;
      float* o = out_ptr + r * d;
      int64_t i = 0;
      for (; i + kLanes <= d; i += kLanes) store(o + i, vector_act(load(gate + i), load(up + i)));
      for (; i < d; ++i) o[i] = scalar_act(gate[i], up[i]);
    }
  });
  return out;
}

constexpr float kGeluScale = 0.7978845608028654f, kGeluCube = 0.044715f;  // sqrt(2 / pi), GELU's cube term

}  // namespace

// silu(x[:, :d]) * x[:, d:] with silu(g) = g / (1 + exp(-g)).
at::Tensor silu_and_mul(const at::Tensor& x) {
  return gated_and_mul(
      x, [](vec16 g, vec16 u) { return g / (1.f + exp_lanes(-g)) * u; },
      [](float g, float u) { return g / (1.f + std::exp(-g)) * u; });
}

// gelu_tanh(x[:, :d]) * x[:, d:] with gelu_tanh(g) = g / 2 * (1 + tanh(u)), u = sqrt(2 / pi) * (g + 0.044715 g^3),
// written g / (1 + exp(-2u)) (1 + tanh(u) = 2 sigmoid(2u): no cancellation in either tail; Gemma 4's experts;
// torch's gelu(approximate="tanh") to float32 rounding).
at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  return gated_and_mul(
      x,
      [](vec16 g, vec16 u) { return g / (1.f + exp_lanes(-2.f * (kGeluScale * (g + kGeluCube * g * g * g)))) * u; },
      [](float g, float u) { return g / (1.f + std::exp(-2.f * (kGeluScale * (g + kGeluCube * g * g * g)))) * u; });
}

// gpt-oss's experts' activation: the gate clamped to at most `limit`, the up to [-limit, limit], then
// gate * sigmoid(alpha * gate) * (up + up_offset), the sigmoid written 1 / (1 + exp(-alpha * gate)) (torch's sigmoid
// to float32 rounding); gpt-oss's offset is 1, HY-V4's 0 (its plain SwiGLU, clamped).
at::Tensor clamped_swiglu(const at::Tensor& x, double alpha, double limit, double up_offset) {
  TORCH_CHECK(limit > 0, "limit must be positive");
  const float a = static_cast<float>(alpha), l = static_cast<float>(limit), o = static_cast<float>(up_offset);
  return gated_and_mul(
      x,
      [a, l, o](vec16 g, vec16 u) {
        g = g > l ? splat(l) : g;
        u = u > l ? splat(l) : (u < -l ? splat(-l) : u);
        return g / (1.f + exp_lanes(-a * g)) * (u + o);
      },
      [a, l, o](float g, float u) {
        g = std::min(g, l);
        u = std::clamp(u, -l, l);
        return g / (1.f + std::exp(-a * g)) * (u + o);
      });
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("clamped_swiglu(Tensor x, float alpha, float limit, float up_offset=1.) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::add_rms_norm));
  m.impl("rotary_embedding", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::rotary_embedding));
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::silu_and_mul));
  m.impl("gelu_tanh_and_mul", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::gelu_tanh_and_mul));
  m.impl("clamped_swiglu", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::clamped_swiglu));
}
