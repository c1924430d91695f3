"""MXFP4 weights (the OCP Microscaling format gpt-oss's experts are released in): dequantized at load, or kept as
they are for the CPU's expert kernel (`StoredMxfp4Bank`, `mxfp4_weight`).

A tensor stored as MXFP4 is two checkpoint tensors: `<name>_blocks`, uint8 `[..., G, 16]` (G groups of 32 e2m1
values per row, two to a byte, the low nibble first), and `<name>_scales`, uint8 `[..., G]`, each group's shared
power of two as an e8m0 exponent biased by 127. Value i of group g is `E2M1[nibble] * 2 ** (scales[g] - 127)`,
exact in bfloat16 and float32 (e2m1 has two mantissa bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine_server.layers.lowbit_weight import LowBitWeight
from engine_server.layers.quantized_experts import ExpertWeights, expert_weights
from engine_server.layers.quantized_linear import QuantizedWeight

# The 16 e2m1 codes' values: sign bit 3, exponent bits 2-1, mantissa bit 0 (1 bit, bias 1).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
GROUP = 32  # values per scale
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 `[..., G, 16]` and scales uint8 `[..., G]` -> `[..., G * 32]` in `dtype` (module doc).
    ValueError when the shapes do not pair up."""
    _check_pair(blocks, scales)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1).flatten(-2)
    exponents = scales.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).to(dtype).flatten(-2)


def _check_pair(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless blocks `[..., G, 16]` and scales `[..., G]` are uint8 and pair up."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up "
            f"(blocks [..., G, {GROUP // 2}], scales [..., G])"
        )


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor) -> LowBitWeight:
    """A matrix's blocks `[N, G, 16]` and scales `[N, G]` as the `mxfp4` `LowBitWeight` of the same values (its codes
    in element order, each group's exponent kept): its `dequantize()` equals `dequantize_mxfp4`'s for exponents
    below 255 (where that one gives inf), -0.0 read as +0.0. ValueError when they do not pair up."""
    _check_pair(blocks, scales)
    if blocks.dim() != 3:
        raise ValueError(f"an MXFP4 matrix's blocks are [N, G, 16], not {tuple(blocks.shape)}")
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(blocks.shape[0], -1)
    return LowBitWeight("mxfp4", codes, scales.unsqueeze(-1).contiguous())


def is_mxfp4_checkpoint(config: dict[str, Any]) -> bool:
    """Whether a config.json declares MXFP4 weights (gpt-oss's released files: `quant_method` mxfp4)."""
    quantization = config.get("quantization_config")
    return isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"


@dataclass(frozen=True)
class StoredMxfp4Bank:
    """gpt-oss's bank of experts as its MXFP4 checkpoint stores it, not read yet: `<bank>.gate_up_proj` and
    `<bank>.down_proj` as blocks and scales (`[E, 2I, H / 32, 16]` whose rows alternate gate and up, and
    `[E, H, I / 32, 16]`), `files` naming the safetensors file that holds each (`mxfp4_bank_tensors`). `read` gives
    this rank's `rows` of the intermediate size (gate and up rows, down's columns: groups of 32, which the caller
    checks) as `ExpertWeights` in MXFP4, so that a model's banks are read and packed one at a time."""

    bank: str
    files: dict[str, Path]
    rows: range

    def read(self) -> ExpertWeights:
        def pair(proj: str) -> tuple[torch.Tensor, torch.Tensor]:
            name = f"{self.bank}.{proj}"
            return _tensor(self.files, name + BLOCKS_SUFFIX), _tensor(self.files, name + SCALES_SUFFIX)

        gate_up, down = pair("gate_up_proj"), pair("down_proj")
        rows = torch.arange(self.rows.start, self.rows.stop)
        groups = slice(self.rows.start // GROUP, self.rows.stop // GROUP)
        gate: list[QuantizedWeight] = []
        up: list[QuantizedWeight] = []
        downs: list[QuantizedWeight] = []
        for expert in range(gate_up[0].shape[0]):
            both = mxfp4_weight(gate_up[0][expert], gate_up[1][expert])
            gate.append(both.rows(2 * rows))
            up.append(both.rows(2 * rows + 1))
            downs.append(mxfp4_weight(down[0][expert, :, groups], down[1][expert, :, groups]))
        return expert_weights(gate, up, downs)


def mxfp4_bank_tensors(bank: str) -> tuple[str, ...]:
    """The checkpoint names of bank `bank`'s MXFP4 tensors, as `StoredMxfp4Bank` reads them."""
    projections = ("gate_up_proj", "down_proj")
    return tuple(f"{bank}.{proj}{suffix}" for proj in projections for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX))


def _tensor(files: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(files[name], framework="pt") as handle:
        return handle.get_tensor(name)


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
