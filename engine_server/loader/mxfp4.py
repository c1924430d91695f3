"""MXFP4 weights (the OCP Microscaling format gpt-oss's experts are released in), dequantized at load.

A tensor stored as MXFP4 is two checkpoint tensors: `<name>_blocks`, uint8 `[..., G, 16]` (G groups of 32 e2m1
values per row, two to a byte, the low nibble first), and `<name>_scales`, uint8 `[..., G]`, each group's shared
power of two as an e8m0 exponent biased by 127. Value i of group g is `E2M1[nibble] * 2 ** (scales[g] - 127)`,
exact in bfloat16 and float32 (e2m1 has two mantissa bits).
"""

from __future__ import annotations

import torch

# The 16 e2m1 codes' values: sign bit 3, exponent bits 2-1, mantissa bit 0 (1 bit, bias 1).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
GROUP = 32  # values per scale
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 `[..., G, 16]` and scales uint8 `[..., G]` -> `[..., G * 32]` in `dtype` (module doc).
    ValueError when the shapes do not pair up."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up "
            f"(blocks [..., G, {GROUP // 2}], scales [..., G])"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1).flatten(-2)
    exponents = scales.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).to(dtype).flatten(-2)


def quantize_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values `[..., K]` (K a multiple of 32) -> (blocks, scales) that `dequantize_mxfp4` reads back: each group's
    scale the power of two that brings its largest magnitude to at most 6, each value rounded to the nearest e2m1
    (ties to the smaller magnitude). For tests and tools that write MXFP4 checkpoints."""
    if values.shape[-1] % GROUP:
        raise ValueError(f"the last dim ({values.shape[-1]}) must be a multiple of {GROUP}")
    groups = values.float().unflatten(-1, (-1, GROUP))
    largest = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponents = (torch.ceil(torch.log2(largest / 6.0))).clamp(-E8M0_BIAS, 127).to(torch.int32)
    scaled = torch.ldexp(groups, -exponents.unsqueeze(-1))
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # the first (smaller) on a tie
    codes = codes | ((scaled < 0).long() << 3)
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponents + E8M0_BIAS).to(torch.uint8)
