"""Weight-only quantized linear layers: 4- and 8-bit weights in groups of 32, kept packed (8-bit also on CUDA).

A decode step on the CPU streams every weight once per token, so its time is the weights' bytes over the memory
bandwidth: float32 SmolLM2-135M streams ~540 MB per token, its GGUF Q4_1 form ~96 MB (scales kept in float16, as
GGUF stores them: float32 ones would add 16 MB). `QuantizedLinear`
keeps a weight in one of two packed forms and multiplies with the C++ kernels of `kernels/cpu/quant_matmul.cpp`
(contracts: `kernels.reference.q4_linear` / `q8_linear`), which quantize the activations to 8 bits per group of
32 on the fly, as llama.cpp does, so each group's dot product is an exact integer one, for any number of rows:
a row's result does not depend on the rows beside it. On the CPU the weight is repacked once, at construction,
into the kernels' blocks of 8 output features (`torch.ops.ladle_cpu.pack_q4` / `pack_q8`).

- `Q4Weight`: element = scale * q + min, q in 0..15 (GGUF Q4_1; Q4_0 is min = -8 * scale).
- `Q8Weight`: element = scale * q, q in -127..127 (GGUF Q8_0, and `quantize_q8` of any float weight).
Both are row-major over the output features, so a fused projection (q/k/v, gate/up) is its shards' rows
concatenated (`concat_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kernels.reference import QUANT_GROUP, unpack_q4


@dataclass(frozen=True)
class Q4Weight:
    """A 4-bit weight `[N, K]`: `qs` `[N, K/2]` uint8 (`kernels.reference.unpack_q4` order), `scales` and `mins`
    `[N, K/32]` float16."""

    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 2

    def dequantize(self) -> torch.Tensor:
        q = unpack_q4(self.qs).reshape(self.qs.shape[0], -1, QUANT_GROUP).float()
        return (q * self.scales.float().unsqueeze(-1) + self.mins.float().unsqueeze(-1)).reshape(self.shape)


@dataclass(frozen=True)
class Q8Weight:
    """An 8-bit weight `[N, K]`: `qs` `[N, K]` int8, `scales` `[N, K/32]` float16."""

    qs: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1]

    def dequantize(self) -> torch.Tensor:
        q = self.qs.reshape(self.qs.shape[0], -1, QUANT_GROUP).float()
        return (q * self.scales.float().unsqueeze(-1)).reshape(self.shape)


QuantizedWeight = Q4Weight | Q8Weight


def weight_format(weight: QuantizedWeight) -> str:
    """`q4` or `q8`: how a layer of this weight reports its format."""
    return "q4" if isinstance(weight, Q4Weight) else "q8"


def quantize_q8(weight: torch.Tensor) -> Q8Weight:
    """Symmetric 8-bit groups of 32 along K, GGUF Q8_0's scheme: scale = max|w| / 127, q = round(w / scale) in
    float32, the scale then stored in float16.

    Raises ValueError when K is not a multiple of 32.
    """
    rows, cols = weight.shape
    if cols % QUANT_GROUP:
        raise ValueError(f"cannot quantize a weight with {cols} input features: not a multiple of {QUANT_GROUP}")
    groups = weight.detach().float().reshape(rows, -1, QUANT_GROUP)
    scales = groups.abs().amax(-1) / 127.0
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    qs = torch.round(groups * inverse.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return Q8Weight(qs.reshape(rows, cols).contiguous(), scales.half().contiguous())


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """The shards of a fused projection as one weight (rows in order). Raises ValueError on mixed formats."""
    first = weights[0]
    if all(isinstance(w, Q4Weight) for w in weights):
        q4 = [w for w in weights if isinstance(w, Q4Weight)]
        return Q4Weight(
            torch.cat([w.qs for w in q4]).contiguous(),
            torch.cat([w.scales for w in q4]).contiguous(),
            torch.cat([w.mins for w in q4]).contiguous(),
        )
    if all(isinstance(w, Q8Weight) for w in weights):
        q8 = [w for w in weights if isinstance(w, Q8Weight)]
        return Q8Weight(torch.cat([w.qs for w in q8]).contiguous(), torch.cat([w.scales for w in q8]).contiguous())
    raise ValueError(f"cannot fuse shards of different formats ({type(first).__name__} and another)")


def pad_rows(weight: QuantizedWeight, rows: int) -> QuantizedWeight:
    """`weight` with `rows` zero rows after its own (every element 0: a vocab-parallel LM head's padding)."""
    if rows == 0:
        return weight

    def padded(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor, tensor.new_zeros(rows, tensor.shape[1])])

    if isinstance(weight, Q4Weight):
        return Q4Weight(padded(weight.qs), padded(weight.scales), padded(weight.mins))
    return Q8Weight(padded(weight.qs), padded(weight.scales))


def pack_for_cpu(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` in the CPU kernels' blocks (`kernels/cpu/quant_matmul.cpp`): (packed, scales, mins) for
    `torch.ops.ladle_cpu.packed_linear`. Raises RuntimeError where the CPU kernels cannot be built."""
    from kernels.cpu_ops import cpu_ops  # builds (or loads) the extension that registers the ops

    if cpu_ops() is None:
        raise RuntimeError("quantized weights on the CPU need the C++ CPU kernels, which could not be built here")
    if isinstance(weight, Q4Weight):
        packed = torch.ops.ladle_cpu.pack_q4(weight.qs, weight.scales, weight.mins)
    else:
        packed = torch.ops.ladle_cpu.pack_q8(weight.qs, weight.scales)
    return packed[0], packed[1], packed[2]


class QuantizedLinear(nn.Module):
    """`F.linear(x, W, bias)` with W a `QuantizedWeight` (any leading dims of x).

    On the CPU (float32 x, the C++ kernels) the result differs from `F.linear(x, weight.dequantize())` by x's
    8-bit rounding (about 0.4% of each group's largest value per element, averaging out over K), not by the
    weight's: that is stored exactly. There `qs`, `scales` and `mins` hold the kernels' packed blocks (built
    once here; needs the CPU kernels). On CUDA (a `Q8Weight` only, x in the model's dtype) they hold the
    weight as given and the Triton kernel `kernels.int8_linear` dequantizes W to x's dtype, keeping x as it is.
    """

    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.format = weight_format(weight)
        qs, scales, mins = weight.qs, weight.scales, weight.mins if isinstance(weight, Q4Weight) else None
        if not qs.is_cuda:
            qs, scales, mins = pack_for_cpu(weight)
        self.register_buffer("qs", qs, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("mins", mins, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if self.qs.is_cuda:
            from kernels.int8_linear import int8_linear  # triton: imported only where it runs

            out = int8_linear(rows, self.qs, self.scales)
        else:
            out = torch.ops.ladle_cpu.packed_linear(rows, self.qs, self.scales, self.mins, self.out_features)
        if self.bias is not None:
            out = out + self.bias
        result: torch.Tensor = out.reshape(*x.shape[:-1], self.out_features)
        return result

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def replace_linears(model: nn.Module, weight_for: Callable[[str, nn.Linear], QuantizedWeight | None]) -> int:
    """Swap each `nn.Linear` of `model` (named as in `named_modules`) for a `QuantizedLinear` of the weight
    `weight_for(name, linear)` returns; None keeps that layer as it is. Returns how many were swapped.

    A swapped layer lets its float weight go unless another module still holds it (a tied embedding)."""
    targets = [
        (parent, f"{prefix}.{name}" if prefix else name, name, child)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    swapped = 0
    for parent, full_name, name, child in targets:
        weight = weight_for(full_name, child)
        if weight is None:
            continue
        if weight.shape != tuple(child.weight.shape):
            raise ValueError(f"{full_name}: quantized weight {weight.shape} for a {tuple(child.weight.shape)} layer")
        setattr(parent, name, QuantizedLinear(weight, child.bias))
        swapped += 1
    return swapped
