"""RMSNorm layer with an optional fused residual add, its form over a projection split by heads over ranks, and
Cohere's LayerNorm (mean-centred, without a bias), PhiMoE's and Jais 2's (with one), OLMo's (without a weight) and
StableLM 2's over each head (a weight per head) with the same interface."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.config import ModelConfig
from engine_server.parallel.group import TensorParallel
from engine_server.parallel.layers import CheckpointTensor, read_whole
from ladle_kernels.kernel_set import KernelOps


class RMSNorm(nn.Module):
    """`weight * x / rms(x)` over the last dim (statistic in float32, as in `ladle_kernels.reference.rms_norm`)."""

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


class GatedRMSNorm(RMSNorm):
    """A.X K2's norm: `y * sigmoid(up(silu(down(y))))`, `y` the RMSNorm of its input, `down` to `rank` dims (its
    checkpoints' `norm.weight`, `mlp.fc1`, `mlp.fc2`; the sigmoid in float32, as transformers' `AXK2GatedRMSNorm`)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, rank: int) -> None:
        super().__init__(size, eps, dtype)
        self.gate_down = nn.Linear(size, rank, bias=False, dtype=dtype)
        self.gate_up = nn.Linear(rank, size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        return self._gated(super().forward(x, ops))

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(gated norm(x + residual), x + residual)`."""
        out, new_residual = super().add_and_norm(x, residual, ops)
        return self._gated(out), new_residual

    def _gated(self, y: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.gate_up(F.silu(self.gate_down(y))).float())
        return (y * gate).to(y.dtype)


class WeightlessRMSNorm(RMSNorm):
    """`x / rms(x)`: RMSNorm without a weight (Falcon Mamba's on its time step, B and C). Its `weight` is a buffer of
    ones (what `ops.rms_norm` multiplies by), not a parameter: nothing is loaded."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.register_buffer("weight", torch.ones(size, dtype=dtype), persistent=False)
        self.eps = eps


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a whole projection whose heads are split over the tensor-parallel ranks (OLMoE's, OLMo 2's and
    MiniMax-M2's q/k norms, over all of q or all of k at once): each rank holds `kept`, its heads' columns of the
    `full`-wide projection and of the weight, and the mean square is the sum of every rank's squares (all-reduced)
    over `full`. A rank among `replicas` holding the same heads (KV heads replicated past their count) adds its
    share of their squares, so that each head counts once. Computed as `ladle_kernels.reference.rms_norm` computes it;
    at one rank it is that norm, but for the order of the float sums."""

    own_tensors = ("weight",)  # the checkpoint's whole weight, kept's columns of it (`load_tensor`)

    def __init__(
        self, full: int, kept: range, replicas: int, eps: float, dtype: torch.dtype, tp: TensorParallel
    ) -> None:
        super().__init__(len(kept), eps, dtype)
        self.full, self.kept, self.replicas, self.tp = full, kept, replicas, tp

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy this rank's columns of a checkpoint's whole `[full]` weight."""
        whole = read_whole(tensor)
        if whole.shape != (self.full,):
            raise ValueError(f"has shape {tuple(whole.shape)}, expected ({self.full},)")
        with torch.no_grad():
            self.weight.copy_(whole[self.kept.start : self.kept.stop])

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        x32 = x.float()
        squares = x32.pow(2).sum(-1, keepdim=True)
        if self.replicas > 1:
            squares = squares / self.replicas
        mean = self.tp.all_reduce_sum(squares) / self.full
        return self.weight * (x32 * torch.rsqrt(mean + self.eps)).to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("a sharded q/k norm takes no residual")


class LayerNorm(RMSNorm):
    """Cohere's LayerNorm: `weight * (x - mean(x)) / sqrt(var(x) + eps)` over the last dim, no bias, computed in
    float32 as transformers' `CohereLayerNorm` computes it (row by row: a token's result does not depend on its
    batch)."""

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        variance = centred.pow(2).mean(-1, keepdim=True)
        return (self.weight.float() * (centred * torch.rsqrt(variance + self.eps))).to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`."""
        stream = x + residual
        return self.forward(stream, ops), stream


class BiasedLayerNorm(LayerNorm):
    """PhiMoE's and Jais 2's LayerNorm: torch's `layer_norm` with a weight and a bias (their `nn.LayerNorm`), in the
    input's dtype; row by row, as `LayerNorm` (whose `add_and_norm` it takes)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(size, eps, dtype)
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype))

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class WeightlessLayerNorm(LayerNorm):
    """OLMo's LayerNorm: torch's `layer_norm` without a weight or a bias, in float32, rounded to the input's dtype (as
    transformers' `OlmoLayerNorm`). Its `weight` is a buffer of ones, not a parameter: nothing is loaded."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.register_buffer("weight", torch.ones(size, dtype=dtype), persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps).to(x.dtype)


class HeadLayerNorm(LayerNorm):
    """StableLM 2's q/k norm: a LayerNorm without a bias over each head of `[T, heads, head_dim]`, each head with a
    weight of its own (`weight` `[heads, head_dim]`, this rank's heads: `kept` of the checkpoint's `total`), in the
    input's dtype as its `nn.LayerNorm`s compute it. The checkpoint's per-head weights come joined into one `[total,
    head_dim]` tensor (`models.gpt_neox`), of which `load_tensor` keeps `kept`'s rows. With `bias` (Persimmon's), a
    bias too, and a checkpoint's one `[head_dim]` weight (and bias) is every head's."""

    own_tensors = ("weight", "bias")

    def __init__(
        self, total: int, kept: list[int], head_dim: int, eps: float, dtype: torch.dtype, bias: bool = False
    ) -> None:
        nn.Module.__init__(self)
        self.weight = nn.Parameter(torch.ones(len(kept), head_dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(len(kept), head_dim, dtype=dtype)) if bias else None
        self.total, self.kept, self.eps = total, kept, eps

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy this rank's heads' rows of the whole `[total, head_dim]` weight (or bias), or a `[head_dim]` one
        shared by every head."""
        dest = self.weight if kind == "weight" else self.bias
        if dest is None:
            raise ValueError("this q/k LayerNorm has no bias")
        whole = read_whole(tensor)
        if whole.shape == (dest.shape[1],):
            whole = whole.expand(self.total, -1)
        if whole.shape != (self.total, dest.shape[1]):
            raise ValueError(f"has shape {tuple(whole.shape)}, expected ({self.total}, {dest.shape[1]})")
        with torch.no_grad():
            dest.copy_(whole[self.kept])

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        normed = F.layer_norm(x, (x.shape[-1],), None, None, self.eps) * self.weight
        return normed if self.bias is None else normed + self.bias


def norm_class(config: ModelConfig) -> Callable[[int, float, torch.dtype], RMSNorm]:
    """The norm a model's blocks use: a LayerNorm where its config says (`ModelConfig.layer_norm`), with a bias
    (`layer_norm_bias`: PhiMoE's, Jais 2's, the GPT-NeoX lineage's), without (Cohere's) or with no weight either
    (`norm_weightless`: OLMo's), else `RMSNorm`."""
    if not config.layer_norm:
        return RMSNorm
    if config.norm_weightless:
        return WeightlessLayerNorm
    return BiasedLayerNorm if config.layer_norm_bias else LayerNorm
