"""MXFP4 (gpt-oss's released experts): `loader.mxfp4` against transformers' own dequantization, its writer, and a
checkpoint's banks read as stored (`StoredMxfp4Bank`) for the CPU's expert kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine_server.loader.mxfp4 import (
    E2M1_VALUES,
    StoredMxfp4Bank,
    dequantize_mxfp4,
    mxfp4_bank_tensors,
    mxfp4_weight,
    quantize_mxfp4,
)


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


def test_a_matrix_kept_as_mxfp4_holds_its_values_bit_for_bit() -> None:
    """`mxfp4_weight`: the codes in element order with each group's exponent, the kernels' `mxfp4` kind; its values
    are `dequantize_mxfp4`'s (the sign of zero aside), every code and exponents from subnormal scales up to 254."""
    generator = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (12, 5, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(0, 255, (12, 5), generator=generator, dtype=torch.uint8)
    scales[0, :2] = torch.tensor([0, 254], dtype=torch.uint8)
    weight = mxfp4_weight(blocks, scales)
    assert weight.kind == "mxfp4" and weight.shape == (12, 160)
    assert torch.equal(weight.dequantize(), dequantize_mxfp4(blocks, scales))  # -0.0 (code 8) reads as +0.0
    with pytest.raises(ValueError, match="do not pair up"):
        mxfp4_weight(blocks, scales[:, :4])


def test_a_stored_bank_reads_each_ranks_gate_up_and_down_as_stored(tmp_path: Path) -> None:
    """A bank as gpt-oss's files store it (gate and up rows alternating; the four tensors split over two files):
    read whole, each expert's gate, up and down are the checkpoint's values (gate rows then up rows, as the kernel
    takes them); read for the rows 32..64 of a rank, those rows of gate and up and those columns of down."""
    generator = torch.Generator().manual_seed(3)
    experts, hidden, intermediate = 3, 64, 96
    gate_up = torch.randn(experts, 2 * intermediate, hidden, generator=generator)
    down = torch.randn(experts, hidden, intermediate, generator=generator)
    bank = "model.layers.0.mlp.experts"
    names = mxfp4_bank_tensors(bank)
    tensors = dict(zip(names, (*quantize_mxfp4(gate_up), *quantize_mxfp4(down)), strict=True))
    save_file({n: tensors[n] for n in names[:2]}, tmp_path / "a.safetensors")
    save_file({n: tensors[n] for n in names[2:]}, tmp_path / "b.safetensors")
    files = {n: tmp_path / ("a.safetensors" if i < 2 else "b.safetensors") for i, n in enumerate(names)}
    gate_up_values, down_values = dequantize_mxfp4(*quantize_mxfp4(gate_up)), dequantize_mxfp4(*quantize_mxfp4(down))
    for rows in (range(0, intermediate), range(32, 64)):
        read = StoredMxfp4Bank(bank, files, rows).read()
        for e in range(experts):
            gate, up = gate_up_values[e, 0::2][rows.start : rows.stop], gate_up_values[e, 1::2][rows.start : rows.stop]
            assert torch.equal(read.gate_up[e].dequantize(), torch.cat([gate, up]))
            assert torch.equal(read.down[e].dequantize(), down_values[e][:, rows.start : rows.stop])
