// Weight-only quantized linear layers of the CPU path: y = x @ W^T with W stored in 32-element groups, as
// llama.cpp stores GGUF Q4_0 / Q4_1 / Q8_0, and x (float32) quantized on the fly to 8 bits per 32-element group
// so every group's dot product is an exact integer one (llama.cpp's Q8 activations). Contracts are those of
// `q4_linear` / `q8_linear` in ladle_kernels/reference.py:
//   x       [M, K] float32, contiguous rows; K % 32 == 0
//   q4: qs  [N, K / 2] uint8: per group 16 bytes, byte j holds element j (low nibble) and j + 16 (high nibble)
//       scales, mins [N, K / 32] float16 (as GGUF stores them): element = scale * q + min, q in 0..15
//       (Q4_0: min = -8 * scale)
//   q8: qs  [N, K] int8; scales [N, K / 32] float16: element = scale * q
//   x's group g of row m: dx = max|x| / 127, xq = round-half-even(x * (1 / dx)) (dx = 0 and xq = 0 for a zero
//   group)
//   y[m, n] = sum_g scale[n, g] * dx[m, g] * (q . xq) + min[n, g] * dx[m, g] * sum(xq)   -> [M, N] float32
//
// The weights are repacked once (`pack_q4` / `pack_q8`, at load) into blocks of 8 output features, so that one
// AVX2 register holds 4 consecutive K elements of 8 features and `vpmaddubsw` against 4 broadcast activation
// bytes yields 8 features' partial dots at once (32 multiply-adds per instruction, against 8 for a float32 FMA;
// measured on a Zen 3 core: 133 G 8-bit multiply-adds/s against 50 G float32 ones). A group's 8 products per
// lane are summed in int16 (|15 * 127 * 2 * 8| < 32768) and scaled into float32 once per group.
//   packed  [N / 8 (rounded up), K / 32, P, 128] uint8: for block b, group g, plane p, 32-byte chunk c (0..3),
//           byte 4 * j + i holds u[8b + j][32g + 4c + i] (low nibble) and u[8b + j][32g + 16 + 4c + i] (high)
//   q4: P = 1, u = q;  q8: P = 2, u = q + 128 split as u >> 4 (plane 0, weight 16) and u & 15 (plane 1), the
//       kernel subtracting 128 * sum(xq) from each group's integer dot (its mins are zero)
//   scales, mins [N / 8, K / 32, 8] float16; features past N are zero
// On AVX-512 machines the blocks go two at a time through 512-bit registers, and through AMX tiles for 12 rows or
// more where the CPU has them (avx512_tiles.h): the same integer sums and float steps. Every row of x runs through
// the same instructions in the same order whatever M is and wherever it falls in a tile, or through ones that give
// the same bits, so a row's result does not depend on its batch (bit for bit); it matches the reference to
// float32 rounding (the reference sums in float64).
// The 5- and 6-bit GGUF blocks (Q5_0, Q5_1), llama.cpp's K-quants (Q2_K .. Q6_K), its IQ types and MXFP4 go
// through the same entry point in their own layout (lowbit_tiles.h), told apart by their tables' types and their
// groups' bytes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>

#include "avx512_tiles.h"
#include "lowbit_tiles.h"
#include "ops.h"
#include "quant_tiles.h"

namespace {

using namespace ladle_quant;

void check_input(const at::Tensor& x, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be a [M, K] float32 tensor with a contiguous last dim");
  LADLE_CHECK(x.size(1) % kGroup == 0, "K must be a multiple of 32, got %lld", static_cast<long long>(x.size(1)));
  TORCH_CHECK(scales.dim() == 2 && scales.size(1) == x.size(1) / kGroup && scales.scalar_type() == at::kHalf &&
                  scales.is_contiguous(),
              "scales must be a contiguous [N, K / 32] float16 tensor");
}

// Packs a weight of `n_rows` rows and `k` columns whose element (n, i) is u(n, i) (0..15 for P = 1, 0..255 for
// P = 2) with per-group scale(n, g) and min(n, g), in the layout described at the top.
template <int64_t P, typename U, typename Scale, typename Min>
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack(int64_t n_rows, int64_t k, U&& u, Scale&& scale, Min&& min) {
  const int64_t blocks = (n_rows + kBlock - 1) / kBlock, groups = k / kGroup;
  at::Tensor packed = at::zeros({blocks, groups, P, kPlaneBytes}, at::TensorOptions().dtype(at::kByte));
  at::Tensor scale_table = at::zeros({blocks, groups, kBlock}, at::TensorOptions().dtype(at::kHalf));
  at::Tensor min_table = at::zeros({blocks, groups, kBlock}, at::TensorOptions().dtype(at::kHalf));
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::Half* scale_out = scale_table.data_ptr<at::Half>();
  at::Half* min_out = min_table.data_ptr<at::Half>();
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t j = 0; j < kBlock && b * kBlock + j < n_rows; ++j) {
          const int64_t n = b * kBlock + j;
          scale_out[(b * groups + g) * kBlock + j] = scale(n, g);
          min_out[(b * groups + g) * kBlock + j] = min(n, g);
          for (int64_t p = 0; p < P; ++p) {
            uint8_t* plane = out + ((b * groups + g) * P + p) * kPlaneBytes;
            for (int64_t c = 0; c < 4; ++c) {
              for (int64_t i = 0; i < 4; ++i) {
                uint32_t low = u(n, g * kGroup + 4 * c + i), high = u(n, g * kGroup + 16 + 4 * c + i);
                if (P == 2) {
                  low = p == 0 ? low >> 4 : low & 0x0F;
                  high = p == 0 ? high >> 4 : high & 0x0F;
                }
                plane[c * 32 + 4 * j + i] = static_cast<uint8_t>(low | (high << 4));
              }
            }
          }
        }
      }
    }
  });
  return {packed, scale_table, min_table};
}

// run_packed on AVX-512 (avx512_tiles.h): pairs of blocks shared out over the threads, each pair's rows a chunk
// at a time (AMX tiles where there are enough rows and AMX is on, pair_tile otherwise).
template <int64_t P>
void run_pairs(const QuantizedRows& xq, int64_t m_rows, const PackedBlocks& w, float* y, int64_t y_stride) {
  const bool amx = m_rows >= kAmxMinRows && amx_enabled();
  const int64_t pairs = (w.blocks + 1) / 2, tile = amx ? kAmxRows : kPairRows;
  const int64_t chunk = std::max<int64_t>(tile, kRowChunkBytes / xq.k / tile * tile);
  at::parallel_for(0, pairs, grain_blocks(pairs, 2 * xq.k, std::min(m_rows, chunk)), [&](int64_t begin, int64_t end) {
    std::optional<AmxScope> tiles;
    std::optional<UnpackedPair> scratch;
    if (amx) {
      tiles.emplace();
      scratch.emplace(w.groups);
    }
    for (int64_t m_chunk = 0; m_chunk < m_rows; m_chunk += chunk) {
      for (int64_t pair = begin; pair < end; ++pair) {
        pair_rows<P>(xq, m_chunk, std::min(m_rows, m_chunk + chunk), w, pair, scratch ? &*scratch : nullptr, y,
                     y_stride);
      }
    }
  });
}

template <int64_t P>
void run_packed(const QuantizedRows& xq, int64_t m_rows, const uint8_t* packed, const at::Half* scales,
                const at::Half* mins, int64_t blocks, int64_t n_rows, float* y, int64_t y_stride) {
  const int64_t k = xq.k, groups = k / kGroup;
  if constexpr (kPairTiles) {
    if (m_rows > 1 || !single_blocks_for_one_row()) {
      return run_pairs<P>(xq, m_rows, PackedBlocks{packed, scales, mins, blocks, groups, n_rows}, y, y_stride);
    }
  }
  const int64_t chunk = std::max<int64_t>(kRowTile, kRowChunkBytes / k / kRowTile * kRowTile);
  at::parallel_for(0, blocks, grain_blocks(blocks, k, std::min(m_rows, chunk)), [&](int64_t begin, int64_t end) {
    for (int64_t m_chunk = 0; m_chunk < m_rows; m_chunk += chunk) {
      const int64_t m_end = std::min(m_rows, m_chunk + chunk);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t cols = std::min(kBlock, n_rows - b * kBlock);
        const uint8_t* w = packed + b * groups * P * kPlaneBytes;
        const at::Half* s = scales + b * groups * kBlock;
        const at::Half* z = mins + b * groups * kBlock;
        for (int64_t m0 = m_chunk; m0 < m_end; m0 += kRowTile) {
          with_rows(std::min(kRowTile, m_end - m0), [&](auto tile_rows) {
            block_tile<P, decltype(tile_rows)::value>(xq, m0, w, s, z, y + m0 * y_stride + b * kBlock, y_stride,
                                                      cols);
          });
        }
      }
    }
  });
}

// run_packed for the 5- and 6-bit and K-quant blocks (lowbit_tiles.h): blocks shared out over the threads, each
// block's rows a chunk at a time through lowbit_rows (the experts' products take the same path, moe.cpp).
template <int64_t H, LowBitScales S>
void run_lowbit(const QuantizedRows& xq, const int32_t* half, int64_t m_rows, const uint8_t* packed,
                const LowBitTables& tables, int64_t blocks, int64_t n_rows, float* y, int64_t y_stride) {
  const int64_t k = xq.k, groups = k / kGroup;
  // AMX tiles for 12 rows or more, as the 4-bit products take them (`lowbit_amx`: not Q6_K / Q3_K, two scales a
  // group, nor the IQ4 codebooks' signed values).
  const bool amx = lowbit_amx(S) && kLowBitPairs && m_rows >= kAmxMinRows && amx_enabled();
  const bool pairs = kLowBitPairs && (m_rows > 1 || !single_blocks_for_one_row());
  const int64_t tile = amx ? kAmxRows : kRowTile;
  const int64_t chunk = std::max<int64_t>(tile, kRowChunkBytes / k / tile * tile);
  at::parallel_for(0, blocks, grain_blocks(blocks, k, std::min(m_rows, chunk)), [&](int64_t begin, int64_t end) {
    std::optional<AmxScope> tiles;
    std::optional<UnpackedPair> scratch;
    if (amx) {
      tiles.emplace();
      scratch.emplace(groups);
    }
    for (int64_t m_chunk = 0; m_chunk < m_rows; m_chunk += chunk) {
      const int64_t m_end = std::min(m_rows, m_chunk + chunk);
      for (int64_t b = begin; b < end; ++b) {
        // Two blocks of this thread's at a time where it has two left (a pair gives the bits of two single tiles).
        const bool paired = pairs && b + 1 < end;
        lowbit_rows<H, S>(xq, half, m_chunk, m_end, packed, tables, b, paired, amx ? &*scratch : nullptr, y, y_stride,
                          n_rows);
        if (paired) ++b;
      }
    }
  });
}

// packed_linear of a weight in lowbit_tiles.h's layout: which tile runs is read off the tables' types and the
// groups' bytes (checked here).
void lowbit_linear(const QuantizedRows& xq, int64_t m_rows, const at::Tensor& packed, const at::Tensor& scales,
                   const at::Tensor& mins, int64_t n_rows, float* y, int64_t y_stride) {
  const int64_t blocks = packed.size(0), groups = packed.size(1), high_bits = (packed.size(3) - kLowBitPlane) / 32;
  const bool two_bit = packed.size(3) == kTwoBitPlane;  // Q2_K
  LADLE_CHECK(packed.size(2) == 1 && (two_bit || (packed.size(3) == lowbit_group_bytes(high_bits) && high_bits >= 0 &&
                                                  high_bits <= 2)),
              "packed must be [N / 8, K / 32, 1, 64 (Q2_K) or 128 + 32 * (0..2)] uint8, got a last dim of %lld",
              static_cast<long long>(packed.size(3)));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (two_bit) {  // kSuper2: Q2_K's d and dmin a super-block, its halves' bytes (sc | m << 4) a group
    LADLE_CHECK(groups % kSuperGroups == 0, "Q2_K super-blocks are 256 wide: K = %lld is not a multiple",
                static_cast<long long>(groups * kGroup));
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks && scales.size(1) == groups / kSuperGroups &&
                    scales.size(2) == 2 * kBlock && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                    mins.dim() == 3 && mins.size(0) == blocks && mins.size(1) == groups &&
                    mins.size(2) == 2 * kBlock && mins.scalar_type() == at::kByte && mins.is_contiguous(),
                "Q2_K tables must be a contiguous [N / 8, K / 256, 16] float16 tensor (d, then dmin) and a contiguous "
                "[N / 8, K / 32, 16] uint8 one (the halves' sc | m << 4)");
    const LowBitTables tables{scales.data_ptr<at::Half>(), nullptr, mins.data_ptr<uint8_t>()};
    const at::Tensor half = half_totals(xq, m_rows);
    return run_lowbit<0, LowBitScales::kSuper2>(xq, half.data_ptr<int32_t>(), m_rows, w, tables, blocks, n_rows, y,
                                                y_stride);
  }
  if (scales.scalar_type() == at::kFloat && mins.dim() == 3) {
    // kCodebookHalves (IQ2_XS, IQ2_S: int8 2s + 1 a half) or kCodebookHalvesIQ1 (IQ1_M: uint8), float32 d a super-block
    LADLE_CHECK(high_bits == 0 && groups % kSuperGroups == 0,
                "IQ2_XS / IQ2_S / IQ1_M groups take no high-bit plane and super-blocks 256 wide: K = %lld",
                static_cast<long long>(groups * kGroup));
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks && scales.size(1) == groups / kSuperGroups &&
                    scales.size(2) == kBlock && scales.is_contiguous() && mins.size(0) == blocks &&
                    mins.size(1) == groups && mins.size(2) == 2 * kBlock && mins.is_contiguous() &&
                    (mins.scalar_type() == at::kChar || mins.scalar_type() == at::kByte),
                "IQ2_XS / IQ2_S / IQ1_M tables must be a contiguous [N / 8, K / 256, 8] float32 tensor (d) and a "
                "contiguous [N / 8, K / 32, 16] int8 (IQ1_M: uint8) one (each half's 2s + 1)");
    const LowBitTables tables{nullptr, nullptr, static_cast<const uint8_t*>(mins.data_ptr()), scales.data_ptr<float>()};
    const at::Tensor half = half_totals(xq, m_rows);
    if (mins.scalar_type() == at::kByte) {
      return run_lowbit<0, LowBitScales::kCodebookHalvesIQ1>(xq, half.data_ptr<int32_t>(), m_rows, w, tables,
                                                             blocks, n_rows, y, y_stride);
    }
    return run_lowbit<0, LowBitScales::kCodebookHalves>(xq, half.data_ptr<int32_t>(), m_rows, w, tables, blocks,
                                                        n_rows, y, y_stride);
  }
  if (scales.scalar_type() == at::kFloat) {  // kCodebookF32: IQ2 / IQ3 codes with a float32 scale a group
    LADLE_CHECK(high_bits == 0, "codebook groups (float32 scales) take no high-bit plane, not %lld",
                static_cast<long long>(high_bits));
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks && scales.size(1) == groups &&
                    scales.size(2) == kBlock && scales.is_contiguous() && mins.scalar_type() == at::kChar &&
                    mins.dim() == 1 && mins.numel() == 16 && mins.is_contiguous(),
                "codebook tables must be a contiguous [N / 8, K / 32, 8] float32 tensor (each group's scale) and the "
                "16 int8 values of the codebook");
    const LowBitTables tables{nullptr, nullptr, nullptr, scales.data_ptr<float>(), mins.data_ptr<int8_t>()};
    return run_lowbit<0, LowBitScales::kCodebookF32>(xq, nullptr, m_rows, w, tables, blocks, n_rows, y, y_stride);
  }
  if (scales.scalar_type() == at::kByte) {  // kE8M0: MXFP4's e2m1 codes with an exponent a group
    LADLE_CHECK(high_bits == 0, "MXFP4 groups (uint8 exponents) take no high-bit plane, not %lld",
                static_cast<long long>(high_bits));
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks && scales.size(1) == groups &&
                    scales.size(2) == kBlock && scales.is_contiguous() && mins.numel() == 0,
                "MXFP4 exponents must be a contiguous [N / 8, K / 32, 8] uint8 tensor (mins empty)");
    const LowBitTables tables{nullptr, nullptr, scales.data_ptr<uint8_t>()};
    return run_lowbit<0, LowBitScales::kE8M0>(xq, nullptr, m_rows, w, tables, blocks, n_rows, y, y_stride);
  }
  if (mins.scalar_type() == at::kChar && high_bits == 0 && (mins.numel() == 0 || mins.size(-1) == kBlock)) {
    // the IQ4 codebook: int8 group scales (8 a group: not Q3_K's 16), or none
    const bool super = mins.numel() != 0;
    LADLE_CHECK(!super || groups % kSuperGroups == 0, "IQ4_XS super-blocks are 256 wide: K = %lld is not a multiple",
                static_cast<long long>(groups * kGroup));
    const int64_t scale_groups = super ? groups / kSuperGroups : groups;
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks && scales.size(1) == scale_groups &&
                    scales.size(2) == kBlock && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                    (!super || (mins.dim() == 3 && mins.size(0) == blocks && mins.size(1) == groups &&
                                mins.size(2) == kBlock && mins.is_contiguous())),
                "IQ4 tables must be contiguous [N / 8, K / 32 (IQ4_NL) or K / 256 (IQ4_XS), 8] float16 scales and, for "
                "IQ4_XS, [N / 8, K / 32, 8] int8 group scales (IQ4_NL: empty)");
    const LowBitTables tables{scales.data_ptr<at::Half>(), nullptr,
                              super ? static_cast<const uint8_t*>(mins.data_ptr()) : nullptr};
    if (super) {
      return run_lowbit<0, LowBitScales::kCodebookSuper>(xq, nullptr, m_rows, w, tables, blocks, n_rows, y,
                                                         y_stride);
    }
    return run_lowbit<0, LowBitScales::kCodebook>(xq, nullptr, m_rows, w, tables, blocks, n_rows, y, y_stride);
  }
  if (mins.scalar_type() == at::kHalf) {  // kTable: 5-bit values with a scale and a min a group
    LADLE_CHECK(high_bits == 1, "5-bit groups (float16 scales and mins) take one high-bit plane, not %lld",
                static_cast<long long>(high_bits));
    const bool offset = mins.numel() == 0;  // Q5_0: min = -16 * scale
    TORCH_CHECK((offset || scales.sizes() == mins.sizes()) && scales.scalar_type() == at::kHalf &&
                    scales.is_contiguous() && mins.is_contiguous() && scales.dim() == 3 && scales.size(0) == blocks &&
                    scales.size(1) == groups && scales.size(2) == kBlock,
                "scales and mins must be contiguous [N / 8, K / 32, 8] float16 tensors (mins empty for Q5_0)");
    const LowBitTables tables{scales.data_ptr<at::Half>(), offset ? nullptr : mins.data_ptr<at::Half>(), nullptr};
    return run_lowbit<1, LowBitScales::kTable>(xq, nullptr, m_rows, w, tables, blocks, n_rows, y, y_stride);
  }
  LADLE_CHECK(groups % kSuperGroups == 0, "K-quant super-blocks are 256 wide: K = %lld is not a multiple",
              static_cast<long long>(groups * kGroup));
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks && scales.size(1) == groups / kSuperGroups &&
                  scales.size(2) == 2 * kBlock && scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "K-quant scales must be a contiguous [N / 8, K / 256, 16] float16 tensor (d, then dmin)");
  TORCH_CHECK(mins.dim() == 3 && mins.size(0) == blocks && mins.size(1) == groups && mins.size(2) == 2 * kBlock &&
                  mins.is_contiguous() && (mins.scalar_type() == at::kByte || mins.scalar_type() == at::kChar),
              "K-quant group scales must be a contiguous [N / 8, K / 32, 16] uint8 (sc, m) or int8 (Q6_K, Q3_K) "
              "tensor");
  const LowBitTables tables{scales.data_ptr<at::Half>(), nullptr, static_cast<const uint8_t*>(mins.data_ptr())};
  if (mins.scalar_type() == at::kChar) {
    LADLE_CHECK(high_bits == 2 || high_bits == 0, "Q6_K groups take two high-bit planes (Q3_K none), not %lld",
                static_cast<long long>(high_bits));
    const at::Tensor half = half_totals(xq, m_rows);
    const int32_t* halves = half.data_ptr<int32_t>();
    if (high_bits == 0) {  // Q3_K
      return run_lowbit<0, LowBitScales::kSuper6>(xq, halves, m_rows, w, tables, blocks, n_rows, y, y_stride);
    }
    return run_lowbit<2, LowBitScales::kSuper6>(xq, halves, m_rows, w, tables, blocks, n_rows, y, y_stride);
  }
  if (high_bits == 0) return run_lowbit<0, LowBitScales::kSuper>(xq, nullptr, m_rows, w, tables, blocks, n_rows, y, y_stride);
  LADLE_CHECK(high_bits == 1, "Q4_K / Q5_K groups take at most one high-bit plane, not %lld",
              static_cast<long long>(high_bits));
  run_lowbit<1, LowBitScales::kSuper>(xq, nullptr, m_rows, w, tables, blocks, n_rows, y, y_stride);
}

}  // namespace

namespace ladle_cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q4(const at::Tensor& qs, const at::Tensor& scales,
                                                       const at::Tensor& mins) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "qs must be a contiguous [N, K / 2] uint8 tensor");
  const int64_t n_rows = qs.size(0), k = qs.size(1) * 2;
  LADLE_CHECK(k % kGroup == 0, "K must be a multiple of 32, got %lld", static_cast<long long>(k));
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n_rows && scales.size(1) == k / kGroup &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "scales must be a contiguous [N, K / 32] float16 tensor");
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == at::kHalf && mins.is_contiguous(),
              "mins must be a contiguous [N, K / 32] float16 tensor");
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  const at::Half* z = mins.data_ptr<at::Half>();
  const int64_t groups = k / kGroup;
  return pack<1>(
      n_rows, k,
      [&](int64_t n, int64_t i) -> uint32_t {
        const int64_t g = i / kGroup, j = i % kGroup;
        const uint8_t byte = q[n * (k / 2) + g * (kGroup / 2) + j % (kGroup / 2)];
        return j < kGroup / 2 ? byte & 0x0F : byte >> 4;
      },
      [&](int64_t n, int64_t g) { return s[n * groups + g]; }, [&](int64_t n, int64_t g) { return z[n * groups + g]; });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q8(const at::Tensor& qs, const at::Tensor& scales) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kChar && qs.is_contiguous(),
              "qs must be a contiguous [N, K] int8 tensor");
  const int64_t n_rows = qs.size(0), k = qs.size(1);
  LADLE_CHECK(k % kGroup == 0, "K must be a multiple of 32, got %lld", static_cast<long long>(k));
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n_rows && scales.size(1) == k / kGroup &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "scales must be a contiguous [N, K / 32] float16 tensor");
  const int8_t* q = qs.data_ptr<int8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  const int64_t groups = k / kGroup;
  // u = q + 128; the kernel takes the 128 * sum(xq) back off each group's integer dot (mins stay zero).
  return pack<2>(
      n_rows, k, [&](int64_t n, int64_t i) -> uint32_t { return static_cast<uint32_t>(q[n * k + i] + 128); },
      [&](int64_t n, int64_t g) { return s[n * groups + g]; }, [](int64_t, int64_t) { return at::Half(0.f); });
}

// The packed blocks of a 5-bit or K-quant weight's values u [N, K] uint8 with `high_bits` bits over each nibble
// (lowbit_tiles.h's layout; the Python reference: `layers.lowbit_weight.pack_lowbit`): [N / 8 (rounded up), K / 32, 1,
// 128 + 32 * high_bits] uint8, rows past N zero. One pass over u, blocks shared out over the threads.
at::Tensor lowbit_planes(const at::Tensor& values, int64_t high_bits) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kByte && values.is_contiguous(),
              "values must be a contiguous [N, K] uint8 tensor");
  const int64_t n_rows = values.size(0), k = values.size(1), groups = k / kGroup;
  LADLE_CHECK(k % kGroup == 0, "K must be a multiple of 32, got %lld", static_cast<long long>(k));
  LADLE_CHECK(high_bits >= 0 && high_bits <= 2, "high_bits must be 0, 1 or 2, got %lld",
              static_cast<long long>(high_bits));
  const int64_t blocks = (n_rows + kBlock - 1) / kBlock, bytes = kPlaneBytes + 32 * high_bits;
  at::Tensor packed = at::zeros({blocks, groups, 1, bytes}, values.options());
  const uint8_t* u = values.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t j = 0; j < kBlock && b * kBlock + j < n_rows; ++j) {
        const uint8_t* row = u + (b * kBlock + j) * k;
        for (int64_t g = 0; g < groups; ++g) {
          uint8_t* group = out + (b * groups + g) * bytes;
          const uint8_t* x = row + g * kGroup;
          for (int64_t c = 0; c < 4; ++c) {
            for (int64_t i = 0; i < 4; ++i) {
              const uint8_t lo = x[4 * c + i], hi = x[kGroup / 2 + 4 * c + i];
              group[32 * c + 4 * j + i] = static_cast<uint8_t>((lo & 0x0F) | ((hi & 0x0F) << 4));
              if (high_bits == 1) {  // byte 4j + i: bit 2c that of element 4c + i, bit 2c + 1 that of 16 + 4c + i
                group[kPlaneBytes + 4 * j + i] |=
                    static_cast<uint8_t>(((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
              } else if (high_bits == 2) {  // chunk c in the 32 bytes at 32 (c / 2): bits 4 (c % 2) .. of 4c + i, +2 ..
                const int shift = 4 * static_cast<int>(c % 2);
                group[kPlaneBytes + 32 * (c / 2) + 4 * j + i] |=
                    static_cast<uint8_t>(((lo >> 4) << shift) | ((hi >> 4) << (shift + 2)));
              }
            }
          }
        }
      }
    }
  });
  return packed;
}

// Rows `index` of a weight pack_q8 packed, dequantized: float32 [R, K], q * scale as `Q8Weight.dequantize` gives
// them (the same bits), read from the packed blocks (a tied embedding's lookups from its LM head's blocks).
at::Tensor q8_packed_rows(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& index) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 2 && packed.size(3) == 128 && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous(),
              "packed must be pack_q8's contiguous [N / 8, K / 32, 2, 128] uint8 blocks");
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks && scales.size(1) == groups && scales.size(2) == 8 &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "scales must be pack_q8's contiguous [N / 8, K / 32, 8] float16 scales");
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "index must be a [R] int64 tensor");
  const at::Tensor rows = index.contiguous();
  const int64_t count = rows.size(0), k = groups * kGroup;
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) {
    LADLE_CHECK(row[r] >= 0 && row[r] < blocks * 8, "row %lld outside the weight", static_cast<long long>(row[r]));
  }
  at::Tensor out = at::empty({count, k}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* bytes = packed.data_ptr<uint8_t>();
  const at::Half* scale = scales.data_ptr<at::Half>();
  float* values = out.data_ptr<float>();
  for (int64_t r = 0; r < count; ++r) {
    const int64_t b = row[r] / 8, j = row[r] % 8;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* high = bytes + ((b * groups + g) * 2) * 128;  // plane 0: u >> 4; plane 1: u & 15
      const uint8_t* low = high + 128;
      const float s = static_cast<float>(scale[(b * groups + g) * 8 + j]);
      float* v = values + r * k + g * kGroup;
      for (int64_t c = 0; c < 4; ++c) {
        for (int64_t i = 0; i < 4; ++i) {
          const int64_t at = c * 32 + 4 * j + i;
          const int first = ((high[at] & 0x0F) << 4 | (low[at] & 0x0F)) - 128;
          const int second = ((high[at] >> 4) << 4 | (low[at] >> 4)) - 128;
          v[4 * c + i] = static_cast<float>(first) * s;
          v[16 + 4 * c + i] = static_cast<float>(second) * s;
        }
      }
    }
  }
  return out;
}

}  // namespace ladle_cpu

namespace {

// Checks one packed weight (any of packed_linear's layouts) against K.
void check_packed(int64_t k, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins,
                  int64_t n_rows) {
  const bool lowbit = mins.scalar_type() != at::kHalf || packed.size(-1) != kPlaneBytes;
  LADLE_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) * kGroup == k && (lowbit || packed.size(2) == 1 || packed.size(2) == 2),
              "packed must be a contiguous [N / 8, K / 32, planes, bytes] uint8 tensor (pack_q4 / pack_q8 / "
              "pack_lowbit) for K = %lld",
              static_cast<long long>(k));
  const int64_t blocks = packed.size(0);
  LADLE_CHECK(n_rows > (blocks - 1) * kBlock && n_rows <= blocks * kBlock, "n = %lld does not fit %lld blocks of 8",
              static_cast<long long>(n_rows), static_cast<long long>(blocks));
  if (lowbit) return;  // lowbit_linear checks its tables
  for (const at::Tensor& table : {scales, mins}) {
    TORCH_CHECK(table.dim() == 3 && table.size(0) == blocks && table.size(1) == packed.size(1) &&
                    table.size(2) == kBlock && table.scalar_type() == at::kHalf && table.is_contiguous(),
                "scales and mins must be contiguous [N / 8, K / 32, 8] float16 tensors");
  }
}

// y[:, 0 .. n_rows) (rows y_stride apart) = x W^T for x quantized as `xq`, W checked by check_packed.
void run_product(const QuantizedRows& xq, int64_t m_rows, const at::Tensor& packed, const at::Tensor& scales,
                 const at::Tensor& mins, int64_t n_rows, float* y, int64_t y_stride) {
  if (mins.scalar_type() != at::kHalf || packed.size(-1) != kPlaneBytes) {
    return lowbit_linear(xq, m_rows, packed, scales, mins, n_rows, y, y_stride);
  }
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  const at::Half* z = mins.data_ptr<at::Half>();
  if (packed.size(2) == 1) {
    run_packed<1>(xq, m_rows, w, s, z, packed.size(0), n_rows, y, y_stride);
  } else {
    run_packed<2>(xq, m_rows, w, s, z, packed.size(0), n_rows, y, y_stride);
  }
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be a [M, K] float32 tensor with a contiguous last dim");
}

}  // namespace

namespace ladle_cpu {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t n_rows) {
  check_x(x);
  const int64_t m_rows = x.size(0);
  check_packed(x.size(1), packed, scales, mins, n_rows);
  at::Tensor y = at::empty({m_rows, n_rows}, x.options());
  if (m_rows == 0 || n_rows == 0) return y;
  run_product(quantize_rows(x), m_rows, packed, scales, mins, n_rows, y.data_ptr<float>(), n_rows);
  return y;
}

at::Tensor packed_linear_parts(const at::Tensor& x, at::TensorList packed, at::TensorList scales,
                               at::TensorList mins, at::IntArrayRef n_rows) {
  check_x(x);
  const size_t parts = packed.size();
  TORCH_CHECK(parts >= 1 && scales.size() == parts && mins.size() == parts && n_rows.size() == parts,
              "packed_linear_parts takes one or more parts, each its packed, scales, mins and n");
  int64_t total = 0;
  for (size_t i = 0; i < parts; ++i) {
    check_packed(x.size(1), packed[i], scales[i], mins[i], n_rows[i]);
    total += n_rows[i];
  }
  const int64_t m_rows = x.size(0);
  at::Tensor y = at::empty({m_rows, total}, x.options());
  if (m_rows == 0 || total == 0) return y;
  const QuantizedRows xq = quantize_rows(x);
  float* out = y.data_ptr<float>();
  for (size_t i = 0; i < parts; ++i) {
    run_product(xq, m_rows, packed[i], scales[i], mins[i], n_rows[i], out, total);
    out += n_rows[i];
  }
  return y;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins) {
  check_input(x, scales);
  TORCH_CHECK(qs.dim() == 2 && qs.size(0) == scales.size(0) && qs.size(1) == x.size(1) / 2, "qs must be [N, K / 2]");
  const auto [packed, packed_scales, packed_mins] = pack_q4(qs, scales, mins);
  return packed_linear(x, packed, packed_scales, packed_mins, qs.size(0));
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales) {
  check_input(x, scales);
  TORCH_CHECK(qs.dim() == 2 && qs.size(0) == scales.size(0) && qs.size(1) == x.size(1), "qs must be [N, K]");
  const auto [packed, packed_scales, packed_mins] = pack_q8(qs, scales);
  return packed_linear(x, packed, packed_scales, packed_mins, qs.size(0));
}

bool set_quant_amx(bool on) {
  amx_switch().store(on);
  return amx_enabled();
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  // Switches the AMX tiles of the quantized products on or off for this process (they are on where the CPU and
  // the kernel allow); returns whether they now run. For tests that hold both paths to the same bits.
  m.def("set_quant_amx(bool on) -> bool", &ladle_cpu::set_quant_amx);
  m.def("pack_q4(Tensor qs, Tensor scales, Tensor mins) -> (Tensor, Tensor, Tensor)");
  m.def("pack_q8(Tensor qs, Tensor scales) -> (Tensor, Tensor, Tensor)");
  m.def("lowbit_planes(Tensor values, int high_bits) -> Tensor");
  m.def("q8_packed_rows(Tensor packed, Tensor scales, Tensor index) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, int n) -> Tensor");
  // The shards of a fused projection stored in different formats: x quantized once, each part's product written
  // into its columns of one [M, sum(n)] result.
  m.def("packed_linear_parts(Tensor x, Tensor[] packed, Tensor[] scales, Tensor[] mins, int[] n) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor qs, Tensor scales, Tensor mins) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor qs, Tensor scales) -> Tensor");
  m.impl("pack_q4", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::pack_q4));
  m.impl("pack_q8", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::pack_q8));
  m.impl("lowbit_planes", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::lowbit_planes));
  m.impl("q8_packed_rows", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::q8_packed_rows));
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::packed_linear));
  m.impl("packed_linear_parts", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::packed_linear_parts));
  m.impl("q4_linear", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::q4_linear));
  m.impl("q8_linear", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::q8_linear));
}
