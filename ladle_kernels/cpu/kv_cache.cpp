// The KV cache write of the CPU kernels: each token's K and V rows into its slot, copied into a float32 cache or
// packed into an FP8 one (fp8_kv.h). Contract: ladle_kernels/reference.py `write_kv_cache`; used by the decode stack
// (decoder.cpp) and, for FP8 caches, by ladle_kernels/cpu_ops.py.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "fp8_kv.h"
#include "ops.h"

namespace ladle_cpu {

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "k and v must be [T, Hkv, D] float32");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "k and v must have contiguous heads");
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2);
  const bool fp8 = kv_cache.scalar_type() == at::kByte;
  const int64_t row = fp8 ? dim + kFp8ScaleBytes : dim;
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  (fp8 || kv_cache.scalar_type() == at::kFloat) && kv_cache.size(3) == heads &&
                  kv_cache.size(4) == row,
              "kv_cache must be a contiguous [2, blocks, block_size, Hkv, D] float32 tensor, or uint8 [..., D + 4]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous [T] int64 tensor");
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    LADLE_CHECK(slot[t] >= 0 && slot[t] < slots, "slot %lld outside the cache", static_cast<long long>(slot[t]));
  }
  const float* k_ptr = k.data_ptr<float>();
  const float* v_ptr = v.data_ptr<float>();
  const int64_t slot_elements = heads * row;
  if (!fp8) {
    float* keys = kv_cache.data_ptr<float>();
    float* values = keys + slots * slot_elements;
    for (int64_t t = 0; t < tokens; ++t) {
      std::memcpy(keys + slot[t] * slot_elements, k_ptr + t * k.stride(0), slot_elements * sizeof(float));
      std::memcpy(values + slot[t] * slot_elements, v_ptr + t * v.stride(0), slot_elements * sizeof(float));
    }
    return;
  }
  uint8_t* keys = kv_cache.data_ptr<uint8_t>();
  uint8_t* values = keys + slots * slot_elements;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      pack_fp8_row(k_ptr + t * k.stride(0) + h * dim, dim, keys + slot[t] * slot_elements + h * row);
      pack_fp8_row(v_ptr + t * v.stride(0) + h * dim, dim, values + slot[t] * slot_elements + h * row);
    }
  }
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.impl("write_kv_cache", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::write_kv_cache));
}
