"""RMSNorm layer with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from kernels.kernel_set import KernelOps


class RMSNorm(nn.Module):
    """`weight * x / rms(x)` over the last dim (statistic in float32, as in `kernels.reference.rms_norm`)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        result: torch.Tensor = ops.rms_norm(x, self.weight, self.eps)
        return result

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`: the normalised value and the new residual stream."""
        out, new_residual = ops.rms_norm(x, self.weight, self.eps, residual)
        return out, new_residual
