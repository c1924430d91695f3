"""MXFP4 (gpt-oss's released experts): `loader.mxfp4` against transformers' own dequantization, and its writer."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine_server.loader.mxfp4 import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4


def test_dequantized_blocks_equal_transformers() -> None:
    """Random bytes as blocks (every nibble, both orders) and exponents around the bias: the same values as
    transformers' `convert_moe_packed_tensors`, which also turns `[E, out, in]` into its `[E, in, out]`."""
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(117, 137, (3, 10, 4), generator=generator, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 10, 128)
    assert torch.equal(ours.transpose(1, 2), theirs)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), ours)  # exact in bfloat16


def test_a_byte_holds_two_values_low_nibble_first() -> None:
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x7A  # low nibble 0xA (-1.0), high nibble 0x7 (6.0)
    values = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8))  # scale 2
    assert values[:3].tolist() == [-2.0, 12.0, 0.0]


def test_written_values_read_back_to_their_nearest_e2m1() -> None:
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(5, 96, generator=generator) * 3
    blocks, scales = quantize_mxfp4(values)
    back = dequantize_mxfp4(blocks, scales)
    groups, back_groups = values.view(5, 3, 32), back.view(5, 3, 32)
    step = 2.0 ** (scales.float() - 127)  # each group's unit: its codes are E2M1 values times it
    assert (groups.abs().amax(-1) <= 6 * step).all() and (groups.abs().amax(-1) > 3 * step).all()
    grid = torch.tensor(E2M1_VALUES[:8])
    nearest = (groups.abs() / step.unsqueeze(-1)).unsqueeze(-1).sub(grid).abs().min(-1).values
    assert torch.allclose((back_groups.abs() / step.unsqueeze(-1) - groups.abs() / step.unsqueeze(-1)).abs(), nearest)
    assert torch.equal(back_groups.sign() * (back_groups != 0), groups.sign() * (back_groups != 0))


def test_mismatched_blocks_and_scales_are_refused() -> None:
    with pytest.raises(ValueError, match="do not pair up"):
        dequantize_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, dtype=torch.uint8))
