// A quantized mixture of experts' feed-forward block on the CPU, in one call, and the float router product beside
// it. Contracts: `quantized_moe` and `rowwise_linear` in ladle_kernels/reference.py.
//
// moe_packed: x [T, H] float32; each token's chosen `experts` [T, k] int64 and routing `weights` [T, k] float32;
// every expert's gate/up rows as one packed weight (`pack_q4` / `pack_q8` of cat(gate_e, up_e), stacked:
// w13 [E, 2I / 8, H / 32, P, 128], scales and mins [E, 2I / 8, H / 32, 8]) and its down rows (w2 [E, H / 8,
// I / 32, P', 128], ...), or either bank in the 5-bit, K-quant, IQ4 and MXFP4 blocks of lowbit_tiles.h (`pack_lowbit`
// of each expert, stacked: w13 [E, 2I / 8, H / 32, 1, 128 + 32 * high bits], its tables with E first; Q5_0's,
// IQ4_NL's and MXFP4's mins [E, 0]), gate/up in one type and down in one type, told apart as packed_linear tells
// them. Returns [T, H]: sum_j weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)) for e = experts[t, j] (act:
// SiLU, or with `gelu` GELU's tanh form, Gemma 4's), each product as `packed_linear` computes it (x and the hidden
// activations quantized to 8 bits per group of 32), the k terms added in ascending expert order (as transformers
// sums them). gpt-oss's experts: with `b13` [E, 2I] and `b2` [E, H]
// (float32) each product adds its expert's bias, and with `swiglu_limit` > 0 the activation is its clamped SwiGLU
// (`clamped_swiglu`, pointwise.cpp) of gate_e(x_t) + b13[e] and up's. Nemotron-H's ungated experts (`relu2`): w13
// holds each expert's up rows alone ([E, I / 8, ...]) and the term is down_e(relu(up_e(x_t))²).
//   - The (token, choice) pairs are sorted by expert (stable), x is quantized once and its rows gathered in that
//     order, so each expert's rows are one run; every expert's gate/up then runs over its run, block by block of
//     8 output features (pairs of blocks on AVX-512: avx512_tiles.h's `pair_rows`, lowbit_tiles.h's
//     `lowbit_rows`; AMX tiles for runs of 12 rows or more, Q6_K's excepted), all experts' blocks split over the
//     threads by their rows' cost; the same for down. A long prefill goes through in chunks of kPairsPerChunk
//     pairs.
//   - Each pair's row goes through `block_tile` (or `lowbit_tile`) as a row of `packed_linear` does, or through
//     tiles that give its bits, and each token's sum is taken in a fixed order, so a token's result does not
//     depend on which tokens share its step (bit for bit).
//
// rowwise_linear: x [M, K] float32 times w [N, K] float32 -> [M, N], each dot product in float32 in one fixed
// order (8 lanes across K, then the lanes summed by hsum8, then the tail), whatever M is: a router's logits that
// do not depend on the batch, where a float GEMM's blocking may change with M.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#include "avx512_tiles.h"
#include "lowbit_tiles.h"
#include "ops.h"
#include "quant_tiles.h"
#include "vec.h"

namespace {

using namespace ladle_quant;

// One packed bank of experts: E weights of n_rows output features each, stacked. `high_bits` -1: `pack_q4` /
// `pack_q8`'s blocks of `planes` planes (quant_matmul.cpp); 0..2: lowbit_tiles.h's (`pack_lowbit`: Q5_0, Q5_1,
// Q2_K .. Q6_K, IQ4_NL, IQ4_XS, MXFP4) with that many high-bit planes (Q2_K: none, nor a nibble plane) and scales
// of kind `lowbit`. Each expert's tensors lie `*_stride` elements after the one before.
struct Bank {
  const uint8_t* packed;
  const at::Half* scales;  // nullptr for MXFP4 (its exponents are `small`)
  const at::Half* mins;    // q4 / q8 and Q5_1's float16 mins; nullptr for Q5_0 (-16 * scale), K-quants, MXFP4
  const uint8_t* small;    // the K-quants' group scales (uint8, int8 for Q6_K), MXFP4's exponents; else nullptr
  int64_t experts, blocks, groups, planes, n_rows;
  int64_t high_bits;
  LowBitScales lowbit;
  int64_t packed_stride, scales_stride, mins_stride;
  const float* group_scales = nullptr;  // kCodebookF32's group scales or the halves' kinds' d, scales_stride apart
  const int8_t* codebook = nullptr;     // kCodebookF32's 16 values, mins_stride apart

  PackedBlocks expert(int64_t e) const {
    return PackedBlocks{packed + e * packed_stride, scales + e * scales_stride, mins + e * mins_stride, blocks,
                        groups, n_rows};
  }
  const uint8_t* lowbit_blocks(int64_t e) const { return packed + e * packed_stride; }
  LowBitTables tables(int64_t e) const {
    return LowBitTables{scales == nullptr ? nullptr : scales + e * scales_stride,
                        mins == nullptr ? nullptr : mins + e * mins_stride,
                        small == nullptr ? nullptr : small + e * mins_stride,
                        group_scales == nullptr ? nullptr : group_scales + e * scales_stride,
                        codebook == nullptr ? nullptr : codebook + e * mins_stride};
  }
};

// The checks of quant_matmul.cpp's lowbit_linear on a bank's tables ([E, ...] each): which tiles run is read off
// the tables' types and the groups' bytes.
void check_lowbit_bank(Bank& bank, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins,
                       const char* what) {
  const int64_t experts = bank.experts, blocks = bank.blocks, groups = bank.groups;
  const int64_t high_bits = (packed.size(4) - kLowBitPlane) / 32;
  const bool two_bit = packed.size(4) == kTwoBitPlane;  // Q2_K
  LADLE_CHECK(packed.size(3) == 1 && (two_bit || (packed.size(4) == lowbit_group_bytes(high_bits) && high_bits >= 0 &&
                                                  high_bits <= 2)),
              "%s must be [E, N / 8, K / 32, 1, 64 (Q2_K) or 128 + 32 * (0..2)] uint8 (stacked pack_lowbit), got a "
              "last dim of %lld",
              what, static_cast<long long>(packed.size(4)));
  bank.high_bits = two_bit ? 0 : high_bits;
  if (two_bit) {  // kSuper2: Q2_K's d and dmin a super-block, its halves' bytes (sc | m << 4) a group
    LADLE_CHECK(groups % kSuperGroups == 0, "%s: Q2_K super-blocks are 256 wide: K = %lld is not a multiple", what,
                static_cast<long long>(groups * kGroup));
    LADLE_CHECK(scales.dim() == 4 && scales.size(0) == experts && scales.size(1) == blocks &&
                    scales.size(2) == groups / kSuperGroups && scales.size(3) == 2 * kBlock &&
                    scales.scalar_type() == at::kHalf && scales.is_contiguous() && mins.dim() == 4 &&
                    mins.size(0) == experts && mins.size(1) == blocks && mins.size(2) == groups &&
                    mins.size(3) == 2 * kBlock && mins.scalar_type() == at::kByte && mins.is_contiguous(),
                "%s's Q2_K tables must be a contiguous [E, N / 8, K / 256, 16] float16 tensor (d, then dmin) and a "
                "contiguous [E, N / 8, K / 32, 16] uint8 one (the halves' sc | m << 4)",
                what);
    bank.lowbit = LowBitScales::kSuper2;
    bank.small = mins.data_ptr<uint8_t>();
    bank.mins_stride = mins.numel() / experts;
    return;
  }
  if (scales.scalar_type() == at::kFloat && mins.dim() == 4) {
    // kCodebookHalves (IQ2_XS, IQ2_S: int8 2s + 1 a half) or kCodebookHalvesIQ1 (IQ1_M: uint8), float32 d a super-block
    LADLE_CHECK(high_bits == 0 && groups % kSuperGroups == 0,
                "%s: IQ2_XS / IQ2_S / IQ1_M groups take no high-bit plane and super-blocks 256 wide: K = %lld", what,
                static_cast<long long>(groups * kGroup));
    LADLE_CHECK(scales.dim() == 4 && scales.size(0) == experts && scales.size(1) == blocks &&
                    scales.size(2) == groups / kSuperGroups && scales.size(3) == kBlock && scales.is_contiguous() &&
                    mins.size(0) == experts && mins.size(1) == blocks && mins.size(2) == groups &&
                    mins.size(3) == 2 * kBlock && mins.is_contiguous() &&
                    (mins.scalar_type() == at::kChar || mins.scalar_type() == at::kByte),
                "%s's IQ2_XS / IQ2_S / IQ1_M tables must be a contiguous [E, N / 8, K / 256, 8] float32 tensor (d) "
                "and a contiguous [E, N / 8, K / 32, 16] int8 (IQ1_M: uint8) one (each half's 2s + 1)",
                what);
    bank.lowbit =
        mins.scalar_type() == at::kByte ? LowBitScales::kCodebookHalvesIQ1 : LowBitScales::kCodebookHalves;
    bank.group_scales = scales.data_ptr<float>();
    bank.small = static_cast<const uint8_t*>(mins.data_ptr());
    bank.mins_stride = mins.numel() / experts;
    return;
  }
  if (scales.scalar_type() == at::kFloat) {  // kCodebookF32: IQ2 / IQ3 codes with a float32 scale a group
    LADLE_CHECK(high_bits == 0, "%s: codebook groups (float32 scales) take no high-bit plane, not %lld", what,
                static_cast<long long>(high_bits));
    LADLE_CHECK(scales.dim() == 4 && scales.size(0) == experts && scales.size(1) == blocks &&
                    scales.size(2) == groups && scales.size(3) == kBlock && scales.is_contiguous() &&
                    mins.scalar_type() == at::kChar && mins.dim() == 2 && mins.size(0) == experts &&
                    mins.size(1) == 16 && mins.is_contiguous(),
                "%s's codebook tables must be a contiguous [E, N / 8, K / 32, 8] float32 tensor (each group's scale) "
                "and [E, 16] int8 codebooks",
                what);
    bank.lowbit = LowBitScales::kCodebookF32;
    bank.group_scales = scales.data_ptr<float>();
    bank.codebook = mins.data_ptr<int8_t>();
    bank.mins_stride = 16;
    return;
  }
  if (scales.scalar_type() == at::kByte) {  // kE8M0: MXFP4's e2m1 codes with an exponent a group
    LADLE_CHECK(high_bits == 0, "%s: MXFP4 groups (uint8 exponents) take no high-bit plane, not %lld", what,
                static_cast<long long>(high_bits));
    LADLE_CHECK(scales.dim() == 4 && scales.size(0) == experts && scales.size(1) == blocks &&
                    scales.size(2) == groups && scales.size(3) == kBlock && scales.is_contiguous() &&
                    mins.numel() == 0,
                "%s's MXFP4 exponents must be a contiguous [E, N / 8, K / 32, 8] uint8 tensor (mins empty)", what);
    bank.lowbit = LowBitScales::kE8M0;
    bank.scales = nullptr;
    bank.small = scales.data_ptr<uint8_t>();
    bank.mins_stride = scales.numel() / experts;
    return;
  }
  if (mins.scalar_type() == at::kChar && high_bits == 0 && (mins.numel() == 0 || mins.size(-1) == kBlock)) {
    // the IQ4 codebook: int8 group scales (8 a group: not Q3_K's 16), or none
    const bool super = mins.numel() != 0;
    LADLE_CHECK(!super || groups % kSuperGroups == 0,
                "%s: IQ4_XS super-blocks are 256 wide: K = %lld is not a multiple", what,
                static_cast<long long>(groups * kGroup));
    const int64_t scale_groups = super ? groups / kSuperGroups : groups;
    LADLE_CHECK(scales.dim() == 4 && scales.size(0) == experts && scales.size(1) == blocks &&
                    scales.size(2) == scale_groups && scales.size(3) == kBlock && scales.scalar_type() == at::kHalf &&
                    scales.is_contiguous() &&
                    (!super || (mins.dim() == 4 && mins.size(1) == blocks && mins.size(2) == groups &&
                                mins.size(3) == kBlock && mins.is_contiguous())),
                "%s's IQ4 tables must be contiguous [E, N / 8, K / 32 (IQ4_NL) or K / 256 (IQ4_XS), 8] float16 scales "
                "and, for IQ4_XS, [E, N / 8, K / 32, 8] int8 group scales (IQ4_NL: empty)",
                what);
    bank.lowbit = super ? LowBitScales::kCodebookSuper : LowBitScales::kCodebook;
    bank.small = super ? static_cast<const uint8_t*>(mins.data_ptr()) : nullptr;
    bank.mins_stride = mins.numel() / experts;
    return;
  }
  if (mins.scalar_type() == at::kHalf) {  // kTable: 5-bit values with a scale and a min a group
    LADLE_CHECK(high_bits == 1, "%s: 5-bit groups (float16 scales and mins) take one high-bit plane, not %lld", what,
                static_cast<long long>(high_bits));
    const bool offset = mins.numel() == 0;  // Q5_0: min = -16 * scale
    LADLE_CHECK((offset || scales.sizes() == mins.sizes()) && scales.scalar_type() == at::kHalf &&
                    scales.is_contiguous() && mins.is_contiguous() && scales.dim() == 4 &&
                    scales.size(0) == experts && scales.size(1) == blocks && scales.size(2) == groups &&
                    scales.size(3) == kBlock,
                "%s's scales and mins must be contiguous [E, N / 8, K / 32, 8] float16 tensors (mins empty for "
                "Q5_0)",
                what);
    bank.lowbit = LowBitScales::kTable;
    bank.mins = offset ? nullptr : mins.data_ptr<at::Half>();
    bank.mins_stride = offset ? 0 : mins.numel() / experts;
    return;
  }
  LADLE_CHECK(groups % kSuperGroups == 0, "%s: K-quant super-blocks are 256 wide: K = %lld is not a multiple", what,
              static_cast<long long>(groups * kGroup));
  LADLE_CHECK(scales.dim() == 4 && scales.size(0) == experts && scales.size(1) == blocks &&
                  scales.size(2) == groups / kSuperGroups && scales.size(3) == 2 * kBlock &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "%s's K-quant scales must be a contiguous [E, N / 8, K / 256, 16] float16 tensor (d, then dmin)", what);
  LADLE_CHECK(mins.dim() == 4 && mins.size(0) == experts && mins.size(1) == blocks && mins.size(2) == groups &&
                  mins.size(3) == 2 * kBlock && mins.is_contiguous() &&
                  (mins.scalar_type() == at::kByte || mins.scalar_type() == at::kChar),
              "%s's K-quant group scales must be a contiguous [E, N / 8, K / 32, 16] uint8 (sc, m) or int8 (Q6_K, "
              "Q3_K) tensor",
              what);
  if (mins.scalar_type() == at::kChar) {
    LADLE_CHECK(high_bits == 2 || high_bits == 0, "%s: Q6_K groups take two high-bit planes (Q3_K none), not %lld",
                what, static_cast<long long>(high_bits));
    bank.lowbit = LowBitScales::kSuper6;
  } else {
    LADLE_CHECK(high_bits <= 1, "%s: Q4_K / Q5_K groups take at most one high-bit plane, not %lld", what,
                static_cast<long long>(high_bits));
    bank.lowbit = LowBitScales::kSuper;
  }
  bank.small = static_cast<const uint8_t*>(mins.data_ptr());
  bank.mins_stride = mins.numel() / experts;
}

Bank check_bank(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins, int64_t experts,
                int64_t k, int64_t n_rows, const char* what) {
  LADLE_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(0) == experts && packed.size(2) * kGroup == k,
              "%s must be a contiguous [%lld, N / 8, %lld, planes, bytes] uint8 tensor (stacked pack_q4 / pack_q8 / "
              "pack_lowbit)",
              what, static_cast<long long>(experts), static_cast<long long>(k / kGroup));
  const int64_t blocks = packed.size(1);
  LADLE_CHECK(n_rows > (blocks - 1) * kBlock && n_rows <= blocks * kBlock, "%s: n = %lld does not fit %lld blocks",
              what, static_cast<long long>(n_rows), static_cast<long long>(blocks));
  LADLE_CHECK(scales.dim() >= 1 && scales.size(0) == experts && mins.dim() >= 1 && mins.size(0) == experts,
              "%s's scales and mins must be stacked over the %lld experts", what, static_cast<long long>(experts));
  const at::Half* halves = scales.scalar_type() == at::kHalf ? scales.data_ptr<at::Half>() : nullptr;
  Bank bank{packed.data_ptr<uint8_t>(), halves, nullptr, nullptr, experts, blocks,
            packed.size(2), packed.size(3), n_rows, -1, LowBitScales::kTable, packed.numel() / experts,
            scales.numel() / experts, 0};
  if (mins.scalar_type() != at::kHalf || packed.size(4) != kPlaneBytes) {  // as quant_matmul.cpp's check_packed
    check_lowbit_bank(bank, packed, scales, mins, what);
    return bank;
  }
  LADLE_CHECK(packed.size(3) == 1 || packed.size(3) == 2, "%s: pack_q4 / pack_q8 blocks take 1 or 2 planes", what);
  for (const at::Tensor& table : {scales, mins}) {
    LADLE_CHECK(table.dim() == 4 && table.size(1) == blocks && table.size(2) == packed.size(2) &&
                    table.size(3) == kBlock && table.scalar_type() == at::kHalf && table.is_contiguous(),
                "%s's scales and mins must be contiguous [E, N / 8, K / 32, 8] float16 tensors", what);
  }
  bank.mins = mins.data_ptr<at::Half>();
  bank.mins_stride = mins.numel() / experts;
  return bank;
}

// Runs item(e, b, scratch) for every expert e that has rows (expert e's rows are [start[e], start[e + 1])) and
// every `span`-th block b of its `blocks`: the items shared out over the threads by their cost (the expert's row
// count), so a step whose tokens crowd one expert still splits evenly. `scratch` is a thread's AMX scratch (with an
// AmxScope) where `amx`, else nullptr. `groups` is K / 32 (the work's size, with the rows, for one thread or all).
template <typename Item>
void share_items(const std::vector<int64_t>& start, int64_t blocks, int64_t groups, int64_t span, bool amx,
                 Item&& item) {
  std::vector<int64_t> item_expert, item_block, item_cost;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(start.size()); ++e) {
    if (start[e + 1] == start[e]) continue;
    for (int64_t b = 0; b < blocks; b += span) {
      item_expert.push_back(e);
      item_block.push_back(b);
      item_cost.push_back(start[e + 1] - start[e]);
    }
  }
  const int64_t items = static_cast<int64_t>(item_expert.size());
  if (items == 0) return;
  std::vector<int64_t> cost_before(items + 1, 0);
  std::partial_sum(item_cost.begin(), item_cost.end(), cost_before.begin() + 1);
  const int64_t total = cost_before.back();
  const int64_t threads = total * span * groups < kMinParallelWork ? 1 : at::get_num_threads();
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    std::optional<AmxScope> tiles;
    std::optional<UnpackedPair> scratch;
    if (amx) {
      tiles.emplace();
      scratch.emplace(groups);
    }
    for (int64_t thread = first; thread < last; ++thread) {
      // This thread's share of the cost: the items whose cost starts in [total * t / n, total * (t + 1) / n).
      const int64_t from = total * thread / threads, to = total * (thread + 1) / threads;
      auto index = std::lower_bound(cost_before.begin(), cost_before.end() - 1, from) - cost_before.begin();
      for (; index < items && cost_before[index] < to; ++index) {
        item(item_expert[index], item_block[index], scratch ? &*scratch : nullptr);
      }
    }
  });
}

// `rows` (quantized, grouped by expert: expert e's rows are [start[e], start[e + 1])) times each one's expert's
// weight in `bank` (pack_q4 / pack_q8) -> y [rows, bank.n_rows]. On AVX-512 an item is a pair of blocks
// (`pair_rows`: AMX tiles where the expert has kAmxMinRows rows or more and AMX is on, pair_tile otherwise);
// elsewhere one block through `block_tile`. All give the same bits.
template <int64_t P>
void run_bank(const QuantizedRows& rows, const std::vector<int64_t>& start, const Bank& bank, float* y) {
  const bool amx = kPairTiles && amx_enabled();
  const int64_t span = kPairTiles ? 2 : 1;
  share_items(start, bank.blocks, bank.groups, span, amx, [&](int64_t e, int64_t b, UnpackedPair* scratch) {
    const PackedBlocks weight = bank.expert(e);
    if constexpr (kPairTiles) {
      return pair_rows<P>(rows, start[e], start[e + 1], weight, b / 2, scratch, y, bank.n_rows);
    }
    const int64_t cols = std::min(kBlock, bank.n_rows - b * kBlock);
    for (int64_t m0 = start[e]; m0 < start[e + 1]; m0 += kRowTile) {
      with_rows(std::min(kRowTile, start[e + 1] - m0), [&](auto tile_rows) {
        block_tile<P, decltype(tile_rows)::value>(rows, m0, weight.block(b, P), weight.scale(b), weight.min(b),
                                                  y + m0 * bank.n_rows + b * kBlock, bank.n_rows, cols);
      });
    }
  });
}

// run_bank of a bank in lowbit_tiles.h's layout: an item is a pair of blocks on AVX-512 (the last one alone where
// the count is odd), one block elsewhere, each expert's rows through `lowbit_rows`, as `packed_linear` runs them
// (AMX tiles for kAmxMinRows rows or more, but not Q6_K's). `half` is `half_totals` of the rows (Q6_K only).
template <int64_t H, LowBitScales S>
void run_lowbit_bank(const QuantizedRows& rows, const int32_t* half, const std::vector<int64_t>& start,
                     const Bank& bank, float* y) {
  const bool amx = lowbit_amx(S) && kLowBitPairs && amx_enabled();
  const int64_t span = kLowBitPairs ? 2 : 1;
  share_items(start, bank.blocks, bank.groups, span, amx, [&](int64_t e, int64_t b, UnpackedPair* scratch) {
    const bool paired = kLowBitPairs && b + 1 < bank.blocks;
    lowbit_rows<H, S>(rows, half, start[e], start[e + 1], bank.lowbit_blocks(e), bank.tables(e), b, paired, scratch,
                      y, bank.n_rows, bank.n_rows);
  });
}

void run_bank(const QuantizedRows& rows, const std::vector<int64_t>& start, const Bank& bank, float* y) {
  if (bank.high_bits < 0) {
    return bank.planes == 1 ? run_bank<1>(rows, start, bank, y) : run_bank<2>(rows, start, bank, y);
  }
  switch (bank.lowbit) {
    case LowBitScales::kTable:
      return run_lowbit_bank<1, LowBitScales::kTable>(rows, nullptr, start, bank, y);
    case LowBitScales::kSuper:
      if (bank.high_bits == 0) return run_lowbit_bank<0, LowBitScales::kSuper>(rows, nullptr, start, bank, y);
      return run_lowbit_bank<1, LowBitScales::kSuper>(rows, nullptr, start, bank, y);
    case LowBitScales::kE8M0:
      return run_lowbit_bank<0, LowBitScales::kE8M0>(rows, nullptr, start, bank, y);
    case LowBitScales::kCodebook:
      return run_lowbit_bank<0, LowBitScales::kCodebook>(rows, nullptr, start, bank, y);
    case LowBitScales::kCodebookSuper:
      return run_lowbit_bank<0, LowBitScales::kCodebookSuper>(rows, nullptr, start, bank, y);
    case LowBitScales::kCodebookF32:
      return run_lowbit_bank<0, LowBitScales::kCodebookF32>(rows, nullptr, start, bank, y);
    case LowBitScales::kCodebookHalves: {
      const at::Tensor half = half_totals(rows, start.back());
      return run_lowbit_bank<0, LowBitScales::kCodebookHalves>(rows, half.data_ptr<int32_t>(), start, bank, y);
    }
    case LowBitScales::kCodebookHalvesIQ1: {
      const at::Tensor half = half_totals(rows, start.back());
      return run_lowbit_bank<0, LowBitScales::kCodebookHalvesIQ1>(rows, half.data_ptr<int32_t>(), start, bank, y);
    }
    case LowBitScales::kSuper2: {
      const at::Tensor half = half_totals(rows, start.back());
      return run_lowbit_bank<0, LowBitScales::kSuper2>(rows, half.data_ptr<int32_t>(), start, bank, y);
    }
    case LowBitScales::kSuper6: {
      const at::Tensor half = half_totals(rows, start.back());
      if (bank.high_bits == 0) {  // Q3_K
        return run_lowbit_bank<0, LowBitScales::kSuper6>(rows, half.data_ptr<int32_t>(), start, bank, y);
      }
      return run_lowbit_bank<2, LowBitScales::kSuper6>(rows, half.data_ptr<int32_t>(), start, bank, y);
    }
  }
}

// The rows of `xq` in the order `source` lists them (row r of the result is row source[r] of xq).
QuantizedRows gather_rows(const QuantizedRows& xq, const std::vector<int64_t>& source, const at::Tensor& like) {
  const int64_t rows = static_cast<int64_t>(source.size()), k = xq.k, groups = k / kGroup;
  at::Tensor value_tensor = quantized_values(rows, k, like);
  at::Tensor scale_tensor = at::empty({rows, groups}, like.options());
  at::Tensor sum_tensor = at::empty({rows, groups}, like.options());
  at::Tensor total_tensor = at::empty({rows, groups}, like.options().dtype(at::kInt));
  int8_t* values = value_tensor.data_ptr<int8_t>();
  float* scales = scale_tensor.data_ptr<float>();
  float* sums = sum_tensor.data_ptr<float>();
  int32_t* totals = total_tensor.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = source[r];
    std::memcpy(values + r * k, xq.values + s * k, k);
    std::memcpy(scales + r * groups, xq.scales + s * groups, groups * sizeof(float));
    std::memcpy(sums + r * groups, xq.sums + s * groups, groups * sizeof(float));
    std::memcpy(totals + r * groups, xq.totals + s * groups, groups * sizeof(int32_t));
  }
  return QuantizedRows{value_tensor, scale_tensor, sum_tensor, total_tensor, values, scales, sums, totals, k};
}

using ladle_cpu::hsum8;
using ladle_cpu::kLanes8;
using ladle_cpu::load8;
using ladle_cpu::vec8;

constexpr int64_t kDotRows = 2, kDotCols = 4;

// y[r * y_stride + j] = x_r . w_j for R rows of x (x_stride apart) and J rows of w (k apart), each dot product in
// float32 in one fixed order: 8 lanes across K, the lanes summed by hsum8, then the tail.
template <int64_t R, int64_t J>
inline void dot_tile(const float* x, int64_t x_stride, const float* w, int64_t k, float* y, int64_t y_stride) {
  vec8 acc[R][J] = {};
  int64_t i = 0;
  for (; i + kLanes8 <= k; i += kLanes8) {
    vec8 wv[J];
    for (int64_t j = 0; j < J; ++j) wv[j] = load8(w + j * k + i);
    for (int64_t r = 0; r < R; ++r) {
      const vec8 xv = load8(x + r * x_stride + i);
      for (int64_t j = 0; j < J; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < J; ++j) {
      float sum = hsum8(acc[r][j]);
      for (int64_t t = i; t < k; ++t) sum += x[r * x_stride + t] * w[j * k + t];
      y[r * y_stride + j] = sum;
    }
  }
}

// (Token, choice) pairs per run of `run_tokens`: a prefill chunk's tokens go through the experts this many pairs
// at a time, so its per-pair buffers (up to 16 MB at H = 1024) stay under glibc's mmap threshold and are reused
// from the heap, where one buffer for all 2048 x 8 pairs of a chunk was mapped afresh, and paid for in page faults,
// on every call (`engine_server/host_memory.py`); each pass reads the experts' weights again, 1/8 of the work here.
constexpr int64_t kPairsPerChunk = 4096;

// What lies between and after an expert's two products: the activation (SiLU, GELU's tanh form, gpt-oss's clamped
// SwiGLU where `swiglu_limit` > 0, or with `relu2` relu(up)² of an ungated expert's up rows alone) and the biases, if
// any (`b13` [E, 2I], `b2` [E, H]).
struct ExpertActivation {
  bool gelu;
  double swiglu_alpha, swiglu_limit, swiglu_up_offset;
  const float* b13;
  const float* b2;
  bool relu2;
};

// rows [pairs, width], sorted by expert (`start[e]`: where expert e's run begins), each plus its expert's row of
// `bias` [E, width].
void add_expert_bias(float* rows, const std::vector<int64_t>& start, const float* bias, int64_t width) {
  const int64_t experts = static_cast<int64_t>(start.size()) - 1;
  at::parallel_for(0, experts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const float* b = bias + e * width;
      for (int64_t r = start[e]; r < start[e + 1]; ++r) {
        float* row = rows + r * width;
        for (int64_t i = 0; i < width; ++i) row[i] += b[i];
      }
    }
  });
}

// moe_packed for x's rows (tokens), each with its top_k `chosen` experts (ids checked) and routing `weights`, added
// into `out` (zeros, [tokens, H]).
void run_tokens(const at::Tensor& x, const int64_t* chosen, const float* weights, int64_t top_k, const Bank& gate_up,
                const Bank& down, const ExpertActivation& act, float* out) {
  const int64_t tokens = x.size(0), hidden = x.size(1), pairs = tokens * top_k;
  const int64_t num_experts = gate_up.experts, intermediate = act.relu2 ? gate_up.n_rows : gate_up.n_rows / 2;
  // The pairs sorted by expert, stably: sorted[p] is pair t * k + j; start[e] is where expert e's run begins.
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) ++start[chosen[p] + 1];
  std::partial_sum(start.begin(), start.end(), start.begin());
  std::vector<int64_t> next(start.begin(), start.end() - 1), token_of(pairs), position(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t at = next[chosen[p]]++;
    token_of[at] = p / top_k;
    position[p] = at;
  }

  const QuantizedRows rows = gather_rows(quantize_rows(x), token_of, x);
  at::Tensor hidden_rows = at::empty({pairs, gate_up.n_rows}, x.options());
  run_bank(rows, start, gate_up, hidden_rows.data_ptr<float>());
  if (act.b13 != nullptr) add_expert_bias(hidden_rows.data_ptr<float>(), start, act.b13, 2 * intermediate);
  const QuantizedRows activated = quantize_rows(
      act.relu2              ? hidden_rows.relu_().square_()
      : act.swiglu_limit > 0 ? ladle_cpu::clamped_swiglu(hidden_rows, act.swiglu_alpha, act.swiglu_limit,
                                                         act.swiglu_up_offset)
      : act.gelu             ? ladle_cpu::gelu_tanh_and_mul(hidden_rows)
                             : ladle_cpu::silu_and_mul(hidden_rows));
  at::Tensor expert_out = at::empty({pairs, hidden}, x.options());
  const float* y = expert_out.data_ptr<float>();
  run_bank(activated, start, down, expert_out.data_ptr<float>());
  if (act.b2 != nullptr) add_expert_bias(expert_out.data_ptr<float>(), start, act.b2, hidden);

  // Each token's k outputs, weighted and added in ascending expert order.
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / (top_k * hidden)), [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order(top_k);
    for (int64_t t = begin; t < end; ++t) {
      std::iota(order.begin(), order.end(), t * top_k);
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return chosen[a] < chosen[b]; });
      float* row = out + t * hidden;
      for (const int64_t p : order) {
        const float* term = y + position[p] * hidden;
        const float weight = weights[p];
        for (int64_t i = 0; i < hidden; ++i) row[i] += weight * term[i];
      }
    }
  });
}

}  // namespace

namespace ladle_cpu {

at::Tensor moe_packed(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                      const at::Tensor& w13, const at::Tensor& w13_scales, const at::Tensor& w13_mins,
                      const at::Tensor& w2, const at::Tensor& w2_scales, const at::Tensor& w2_mins,
                      int64_t intermediate, bool gelu, const std::optional<at::Tensor>& b13,
                      const std::optional<at::Tensor>& b2, double swiglu_alpha, double swiglu_limit, bool relu2,
                      double swiglu_up_offset) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous [T, H] float32 tensor");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == tokens && experts.scalar_type() == at::kLong &&
                  experts.is_contiguous(),
              "experts must be a contiguous [T, k] int64 tensor");
  TORCH_CHECK(weights.sizes() == experts.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "weights must be a contiguous [T, k] float32 tensor");
  LADLE_CHECK(hidden % kGroup == 0 && intermediate % kGroup == 0 && intermediate > 0,
              "H (%lld) and I (%lld) must be multiples of 32", static_cast<long long>(hidden),
              static_cast<long long>(intermediate));
  const int64_t num_experts = w13.size(0), top_k = experts.size(1), pairs = tokens * top_k;
  LADLE_CHECK(!relu2 || (!b13.has_value() && swiglu_limit <= 0 && !gelu),
              "relu2 experts take no bias and no other activation");
  const Bank gate_up =
      check_bank(w13, w13_scales, w13_mins, num_experts, hidden, (relu2 ? 1 : 2) * intermediate, "w13");
  const Bank down = check_bank(w2, w2_scales, w2_mins, num_experts, intermediate, hidden, "w2");
  for (const auto& [bias, width, what] : {std::tuple{&b13, 2 * intermediate, "b13"}, std::tuple{&b2, hidden, "b2"}}) {
    LADLE_CHECK(!bias->has_value() || ((*bias)->dim() == 2 && (*bias)->size(0) == num_experts &&
                                       (*bias)->size(1) == width && (*bias)->scalar_type() == at::kFloat &&
                                       (*bias)->is_contiguous()),
                "%s must be a contiguous [E, %lld] float32 tensor", what, static_cast<long long>(width));
  }
  const ExpertActivation act{gelu, swiglu_alpha, swiglu_limit, swiglu_up_offset, b13 ? b13->data_ptr<float>() : nullptr,
                             b2 ? b2->data_ptr<float>() : nullptr, relu2};
  const int64_t* chosen = experts.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) {
    LADLE_CHECK(chosen[p] >= 0 && chosen[p] < num_experts, "expert id %lld is not in 0..%lld",
                static_cast<long long>(chosen[p]), static_cast<long long>(num_experts - 1));
  }
  at::Tensor out = at::zeros({tokens, hidden}, x.options());
  const int64_t chunk = std::max<int64_t>(1, kPairsPerChunk / top_k);
  for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    const int64_t n = std::min(chunk, tokens - t0);
    run_tokens(x.narrow(0, t0, n), chosen + t0 * top_k, weights.data_ptr<float>() + t0 * top_k, top_k, gate_up,
               down, act, out.data_ptr<float>() + t0 * hidden);
  }
  return out;
}

at::Tensor rowwise_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be a [M, K] float32 tensor with a contiguous last dim");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1) && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "w must be a contiguous [N, K] float32 tensor with x's K");
  const int64_t rows = x.size(0), n = w.size(0), k = x.size(1);
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  // Tiles of up to kDotRows rows x kDotCols outputs: their dot products run side by side (each one's additions a
  // chain of their own, in its one order), where one at a time waited on each addition's latency.
  const int64_t row_tiles = (rows + kDotRows - 1) / kDotRows, col_tiles = (n + kDotCols - 1) / kDotCols;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kDotRows * kDotCols * k));
  at::parallel_for(0, row_tiles * col_tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t m0 = tile / col_tiles * kDotRows, j0 = tile % col_tiles * kDotCols;
      if (m0 + kDotRows <= rows && j0 + kDotCols <= n) {
        dot_tile<kDotRows, kDotCols>(xp + m0 * x_stride, x_stride, wp + j0 * k, k, yp + m0 * n + j0, n);
      } else {
        for (int64_t m = m0; m < std::min(rows, m0 + kDotRows); ++m) {
          for (int64_t j = j0; j < std::min(n, j0 + kDotCols); ++j) {
            dot_tile<1, 1>(xp + m * x_stride, x_stride, wp + j * k, k, yp + m * n + j, n);
          }
        }
      }
    }
  });
  return y;
}

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.def(
      "moe_packed(Tensor x, Tensor experts, Tensor weights, Tensor w13, Tensor w13_scales, Tensor w13_mins, "
      "Tensor w2, Tensor w2_scales, Tensor w2_mins, int intermediate, bool gelu=False, Tensor? b13=None, "
      "Tensor? b2=None, float swiglu_alpha=0., float swiglu_limit=0., bool relu2=False, "
      "float swiglu_up_offset=1.) -> Tensor");
  m.def("rowwise_linear(Tensor x, Tensor w) -> Tensor");
  m.impl("moe_packed", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::moe_packed));
  m.impl("rowwise_linear", c10::DispatchKey::CPU, TORCH_FN(ladle_cpu::rowwise_linear));
}
