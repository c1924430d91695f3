"""Mamba-2: the selective state space mixer of Granite 4.0's, Nemotron-H's and Falcon-H1's hybrid layers, over a
state per sequence.

`in_proj` gives each token its gate z, x, B, C and a time step per head (`ModelConfig.mamba2`); a depthwise causal
convolution with SiLU runs over x, B and C, the scan over x (`ladle_kernels.mamba2`), then `rms_norm(y * silu(z))` over
each group's heads (or, as Falcon-H1 may, `y * silu(z)` alone) and `out_proj`. Where an attention layer keeps every
token's K/V in the paged cache, this layer keeps, per running sequence, the convolution's last inputs and one matrix
per head, in one float32 tensor per layer `[slots, state_size]` as Gated DeltaNet's states are
(`layers.gated_deltanet`: the same slots, prefix snapshots and copies, and the same reasons a step with it is never
stopped half way and speculative decoding does not serve it).
"""

from __future__ import annotations

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.gated_deltanet import DepthwiseConv, advance_states
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, ColumnParallelLinear, RowParallelLinear, read_whole
from engine_server.parallel.sharding import PartSlice
from ladle_kernels.kernel_set import KernelOps


class HeadSlice(nn.Module):
    """A per-head (or per-channel) vector of which this rank keeps `kept` (its heads' entries): the gated norm's
    weight, `A_log`, `dt_bias`, `D`. Loaded whole from the checkpoint, sliced here."""

    def __init__(self, kept: range, fill: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.kept = kept
        self.weight = nn.Parameter(torch.full((len(kept),), fill, dtype=dtype), requires_grad=False)

    own_tensors = ("weight",)  # loaded by `load_tensor` (`CausalLM.load_weights`)

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy this rank's entries of the checkpoint's whole vector; ValueError for another shape."""
        whole = read_whole(tensor).reshape(-1)
        if whole.shape[0] < self.kept.stop or tensor.dim() != 1:
            raise ValueError(f"has shape {tuple(tensor.shape)}, not one value for each of {self.kept.stop}+")
        with torch.no_grad():
            self.weight.copy_(whole[self.kept.start : self.kept.stop])


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer: `in_proj` (rows `cat(z, x, B, C, dt)`), the kernel set's `mamba2_mixer` (the convolution,
    the scan with `A = -exp(A_log)`, `dt = softplus(dt + dt_bias)` and the skip `D x`, the gated norm), then
    `out_proj`. Same call as `PagedSelfAttention`, with this layer's state tensor in place of its KV cache (and no
    rope); the checkpoint's `A_log`, `dt_bias` and `D` are read as `A_log.weight`, ... (`HeadSlice`s).

    Under tensor parallelism a rank holds a block of the heads (their rows of z, x and dt, their columns of
    `out_proj`, whose partial sums it all-reduces) and the B and C rows of the groups they read (`config.Mamba2.
    sharded`), their convolution channels and states. Where a group's heads span several ranks (fewer groups than
    ranks: the released models have one), its gated norm's statistic is summed over the ranks first."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if config.mamba2 is None:
            raise ValueError("Mamba2Mixer needs the model's mamba2 shape")
        self.tp = tp
        whole = self.whole = config.mamba2
        shape = self.shape = whole.sharded(tp.size)
        heads = range(tp.rank * shape.num_heads, (tp.rank + 1) * shape.num_heads)
        inner = range(heads.start * whole.head_dim, heads.stop * whole.head_dim)
        first = heads.start // (whole.num_heads // whole.groups)  # the first group this rank's heads read
        groups = range(first * whole.state_dim, (first + shape.groups) * whole.state_dim)
        self.group = first  # (where its heads are a part of one group's)
        grouped = whole.groups * whole.state_dim
        parts = [
            PartSlice(whole.inner, inner), PartSlice(whole.inner, inner), PartSlice(grouped, groups),
            PartSlice(grouped, groups), PartSlice(whole.num_heads, heads),
        ]  # fmt: skip
        self.sizes = [shape.inner, shape.conv_dim, shape.num_heads]
        self.in_proj: nn.Module = ColumnParallelLinear(config.hidden_size, parts, False, dtype)
        channels = [
            inner, range(whole.inner + groups.start, whole.inner + groups.stop),
            range(whole.inner + grouped + groups.start, whole.inner + grouped + groups.stop),
        ]  # fmt: skip
        self.conv1d = DepthwiseConv(channels, whole.conv_kernel, dtype, bias=whole.conv_bias)
        self.dt_bias = HeadSlice(heads, 1.0, dtype)
        self.A_log = HeadSlice(heads, 0.0, dtype)
        self.D = HeadSlice(heads, 1.0, dtype)
        self.norm = HeadSlice(inner, 1.0, dtype) if whole.gated_norm else None  # (Falcon-H1's may have none)
        self.eps = config.rms_norm_eps
        self.split_norm = whole.gated_norm and whole.groups < tp.size  # a group's heads (and its norm) on several ranks
        self.out_proj: nn.Module = RowParallelLinear(whole.inner, config.hidden_size, False, tp, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        state: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        """hidden `[T, hidden]` -> `[T, hidden]`; advances each sequence's state in `state` (its row
        `meta.state_slots[i]`) by its chunk. `positions`, `cos_sin_cache` and `lora` are not read."""
        z, xbc, dt = self.in_proj(hidden).split(self.sizes, dim=-1)
        core = advance_states(
            meta, state, "a Mamba-2 layer",
            lambda slots, fresh: ops.mamba2_mixer(
                xbc, z, dt, self.conv1d.weight, self.conv1d.bias, self.A_log.weight, self.dt_bias.weight,
                self.D.weight, None if self.split_norm or self.norm is None else self.norm.weight, self.eps,
                self.shape.groups, state,
                slots, meta.query_lens_cpu, fresh,
            ),
        )  # fmt: skip
        if self.split_norm:
            core = self._split_norm(core)
        result: torch.Tensor = self.tp.all_reduce_sum(self.out_proj(core))
        return result

    def _split_norm(self, gated: torch.Tensor) -> torch.Tensor:
        """The gated norm of `gated` (`y * silu(z)` of this rank's heads, a part of group `self.group`'s): each row's
        sum of squares in float32, summed over the ranks (by group: ranks holding other groups add zeros), over the
        group's whole width."""
        width = self.whole.inner // self.whole.groups
        squares = torch.zeros(gated.shape[0], self.whole.groups, dtype=torch.float32, device=gated.device)
        squares[:, self.group] = gated.float().pow(2).sum(dim=-1)
        total = self.tp.all_reduce_sum(squares)[:, self.group : self.group + 1]
        normed = gated.float() * torch.rsqrt(total / width + self.eps)
        assert self.norm is not None, "a split norm is a norm"
        return self.norm.weight * normed.to(gated.dtype)
