"""FP8 linear layers (`--quantization fp8`): weights in float8 e4m3 with float32 scales, activations per token.

`Fp8Weight` is a weight `[N, K]` as e4m3 values and their scales, one per output channel (`quantize_fp8` of a
float weight, or a `compressed-tensors` checkpoint's) or one per block (a block-wise checkpoint's 128 x 128).
`Fp8Linear` multiplies by it as `ladle_kernels.reference.fp8_linear` says: x rounded to e4m3 per token (each row's
largest magnitude to 448), times the weight's e4m3 values, float32 sums, both scales applied to the sum.

- On CUDA the weight stays e4m3 (one byte per weight) and `ladle_kernels.fp8_linear` runs the GEMM (`torch._scaled_mm`
  or the Triton kernel).
- On the CPU, which has no e4m3 arithmetic, the weight is dequantized once, at construction, to a float `nn.Linear`
  of the model's dtype holding exactly the e4m3 values times their scales (MKL-packed afterwards like every float
  layer), and each call rounds x per token to e4m3 in torch before it: the reference's arithmetic, so what the CPU
  serves and `ladle bench quality` measures is the GPU's rounding of both operands, up to the order of the float32
  sums. It saves no memory and runs no faster than float: it is there so that FP8 models load and their quality is
  measured (CI) on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine_server.layers.quantized_linear import swap_linears
from ladle_kernels.reference import (
    FP8_GPU_BLOCK_COLUMNS,
    fp8_dequantize,
    fp8_quantize_per_channel,
    fp8_quantize_per_token,
)


@dataclass(frozen=True)
class Fp8Weight:
    """A weight `[N, K]`: `qs` e4m3 and `scales` float32, `[N, 1]` (per channel, `block` None) or `[ceil(N/bn),
    ceil(K/bk)]` (per block of `block` = (bn, bk)); element = float(qs) * its scale."""

    qs: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1]

    @property
    def format(self) -> str:
        return "fp8" if self.block is None else "fp8_block"

    def dequantize(self) -> torch.Tensor:
        """The weight's float32 values."""
        return fp8_dequantize(self.qs, self.scales, self.block)

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.qs.to(device), self.scales.to(device), self.block)


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """A float weight `[N, K]` in e4m3 with one scale per output channel (its largest magnitude maps to 448)."""
    qs, scales = fp8_quantize_per_channel(weight.detach())
    return Fp8Weight(qs, scales)


def gpu_takes(block: tuple[int, int] | None) -> bool:
    """Whether the GPU kernels take FP8 weights scaled per `block` (None: per channel): blocks a multiple of
    `FP8_GPU_BLOCK_COLUMNS` (32) columns wide, as their e4m3 K tiles are that wide at least and never straddle two
    blocks. The published checkpoints' blocks are 128 wide."""
    return block is None or block[1] % FP8_GPU_BLOCK_COLUMNS == 0


def gpu_layout(weight: Fp8Weight) -> Fp8Weight:
    """`weight` as the GPU kernels take it: as it is where `gpu_takes` its blocks, else quantized again per channel
    (its values rounded once more: format `fp8`)."""
    return weight if gpu_takes(weight.block) else quantize_fp8(weight.dequantize())


def concat_fp8_rows(weights: list[Fp8Weight]) -> Fp8Weight:
    """The shards of a fused projection (q/k/v, gate/up) as one weight, rows in order. Per-channel shards keep
    their scales; block-wise ones do too when they share a block and every shard but the last spans whole blocks
    of rows. Otherwise (a block straddling two shards, or a mix of layouts) the shards' values are quantized
    again per channel: each row's e4m3 values times its scales, rounded once more to e4m3 (logged by the caller
    as format `fp8`)."""
    if len(weights) == 1:
        return weights[0]
    blocks = {w.block for w in weights}
    if blocks == {None}:
        return Fp8Weight(torch.cat([w.qs for w in weights]), torch.cat([w.scales for w in weights]))
    block = next(iter(blocks))
    if len(blocks) == 1 and block is not None and all(w.shape[0] % block[0] == 0 for w in weights[:-1]):
        return Fp8Weight(torch.cat([w.qs for w in weights]), torch.cat([w.scales for w in weights]), block)
    return quantize_fp8(torch.cat([w.dequantize() for w in weights]))


def fp8_rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` rounded to e4m3 per row (`ladle_kernels.reference.fp8_quantize_per_token`) and back, in x's dtype:
    what the CPU multiplies where the GPU multiplies e4m3 rows and applies their scales after the sums."""
    xq, x_scale = fp8_quantize_per_token(x)
    return (xq.float() * x_scale).to(x.dtype)


class Fp8Linear(nn.Module):
    """`F.linear(x, W, bias)` with W an `Fp8Weight` and x rounded to e4m3 per token (any leading dims of x), as
    `ladle_kernels.reference.fp8_linear`. On CUDA `qs` and `scales` are the weight's (module doc); on the CPU `dense`
    holds its dequantized values in `dtype` and `qs` / `scales` are None."""

    qs: torch.Tensor | None
    scales: torch.Tensor | None

    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        if weight.qs.is_cuda:
            weight = gpu_layout(weight)
        self.out_features, self.in_features = weight.shape
        self.format = weight.format
        self.block = weight.block
        self.dense: nn.Linear | None = None
        if weight.qs.is_cuda:
            from ladle_kernels.fp8_linear import scaled_mm_available  # triton: imported only where it runs

            scaled_mm_available(weight.qs.device)  # probed now, at load: never inside a graph capture
            qs: torch.Tensor | None = weight.qs.contiguous()
            scales: torch.Tensor | None = weight.scales.contiguous()
        else:
            qs = scales = None
            self.dense = nn.Linear(self.in_features, self.out_features, bias=False, dtype=dtype)
            with torch.no_grad():
                self.dense.weight.copy_(weight.dequantize())
            self.dense.requires_grad_(False)
        self.register_buffer("qs", qs, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.dense is None:
            assert self.qs is not None and self.scales is not None
            from ladle_kernels.fp8_linear import fp8_linear

            out = fp8_linear(rows, self.qs, self.scales, self.bias, self.block)
        else:
            out = self.dense(fp8_rounded_rows(rows))
            if self.bias is not None:
                out = out + self.bias
        result: torch.Tensor = out.reshape(*x.shape[:-1], self.out_features)
        return result

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def replace_fp8_linears(model: nn.Module, weight_for: Callable[[str, nn.Linear], Fp8Weight | None]) -> int:
    """`swap_linears` to an `Fp8Linear` of each weight `weight_for` returns (None keeps the linear), moved to the
    linear's device."""

    def layer_for(name: str, linear: nn.Linear) -> nn.Module | None:
        weight = weight_for(name, linear)
        return None if weight is None else Fp8Linear(weight.to(linear.weight.device), linear.bias, linear.weight.dtype)

    return swap_linears(model, layer_for)
