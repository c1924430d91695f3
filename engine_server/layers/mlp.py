"""SwiGLU feed-forward block with the gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
from torch import nn

from kernels.kernel_set import KernelOps


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`; `gate_up_proj.weight` is `cat(gate.weight, up.weight)` along rows."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
