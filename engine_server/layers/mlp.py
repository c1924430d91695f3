"""SwiGLU feed-forward block with the gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
from torch import nn

from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine_server.parallel.sharding import gate_up_slices
from kernels.kernel_set import KernelOps


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`; `gate_up_proj.weight` is `cat(gate.weight, up.weight)` along rows.

    Under tensor parallelism a rank holds the same block of gate and up rows (so SwiGLU applies locally) and the
    matching columns of down, whose partial sums it all-reduces."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        parts = gate_up_slices(intermediate_size, tp.size, tp.rank)
        self.gate_up_proj: nn.Module = ColumnParallelLinear(hidden_size, parts, False, dtype)
        self.down_proj: nn.Module = RowParallelLinear(intermediate_size, hidden_size, False, tp, dtype)

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        return self.tp.all_reduce_sum(self.partial(x, ops))

    def partial(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """This rank's partial sum of the output (the whole output at size 1), before the all-reduce."""
        result: torch.Tensor = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return result
