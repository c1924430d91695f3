// The counter-based noise of seeded sampling rows (ladle_kernels/reference.py: seeded_log_uniforms; the Triton kernel
// in ladle_kernels/seeded_noise.py) on the CPU: the SplitMix64 hash and u in one pass over [S, V], then ATen's own
// log_, where the reference takes 13 int64 tensor ops. u is exact in float32 (an odd multiple of 2**-24 in
// (0, 1); built with -ffp-contract=off, so no fused multiply-add changes it) and the log is the reference's
// op, so the result is bit-identical to the reference.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "ops.h"

namespace {

// ladle_kernels/reference.py's SPLITMIX_GOLDEN, SPLITMIX_MIX_1, SPLITMIX_MIX_2 (the tests compare against it).
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;

}  // namespace

namespace ladle_cpu {

at::Tensor seeded_log_uniforms(const at::Tensor& keys, const at::Tensor& tokens) {
  TORCH_CHECK(keys.dim() == 1 && tokens.dim() == 1 && keys.scalar_type() == at::kLong &&
                  tokens.scalar_type() == at::kLong,
              "expected int64 keys [S] and tokens [V]");
  TORCH_CHECK(keys.device().is_cpu() && tokens.device().is_cpu(), "keys and tokens must be on the CPU");
  const at::Tensor k = keys.contiguous(), t = tokens.contiguous();
  const int64_t rows = k.size(0), vocab = t.size(0);
  at::Tensor out = at::empty({rows, vocab}, k.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  const int64_t* key_ptr = k.data_ptr<int64_t>();
  const int64_t* token_ptr = t.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const float half_plus = 0.5f + 0x1p-24f;  // exact in float32
  const int64_t grain = std::max<int64_t>(1, 32768 / vocab);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint64_t key = static_cast<uint64_t>(key_ptr[r]);
      float* o = out_ptr + r * vocab;
      for (int64_t j = 0; j < vocab; ++j) {
        uint64_t z = key + static_cast<uint64_t>(token_ptr[j]) * kGolden;
        z = (z ^ (z >> 30)) * kMix1;
        z = (z ^ (z >> 27)) * kMix2;
        const int64_t s = static_cast<int64_t>(z) >> 41;  // the top 23 bits, signed
        o[j] = static_cast<float>(s) * 0x1p-23f + half_plus;
      }
    }
  });
  out.log_();
  return out;
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def("seeded_log_uniforms(Tensor keys, Tensor tokens) -> Tensor");
  m.impl("seeded_log_uniforms", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::seeded_log_uniforms));
}
