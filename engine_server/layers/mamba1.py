"""Mamba-1: the selective state space mixer of Jamba's, Mamba's and Falcon Mamba's layers, over a state per sequence.

`in_proj` gives each token x and its gate z; a depthwise causal convolution with SiLU runs over x; `x_proj` gives
the time step's low-rank input, B and C (each RMS-normalised in Jamba, without a weight in Falcon Mamba), `dt_proj`
lifts the time step to every channel; the scan (`ladle_kernels.mamba1`) with `A = -exp(A_log)` per channel and state
entry, `dt = softplus(dt)` and the skip `D x`, then `y * silu(z)` and `out_proj`. Its state per running sequence (the
convolution's last inputs and a row per channel) lives in one float32 tensor per layer `[slots, state_size]`, as
Mamba-2's does (`layers.mamba2`: the same slots, prefix snapshots and copies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.gated_deltanet import DepthwiseConv, advance_states
from engine_server.layers.mamba2 import HeadSlice
from engine_server.layers.norm import RMSNorm, WeightlessRMSNorm
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, ColumnParallelLinear, RowParallelLinear, read_whole
from engine_server.parallel.sharding import PartSlice
from ladle_kernels.kernel_set import KernelOps


class ChannelRows(nn.Module):
    """A per-channel matrix `[channels, width]` (`A_log`) of which this rank keeps the rows `kept`. Loaded whole
    from the checkpoint, sliced here."""

    def __init__(self, kept: range, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.kept = kept
        self.weight = nn.Parameter(torch.zeros(len(kept), width, dtype=dtype), requires_grad=False)

    own_tensors = ("weight",)  # loaded by `load_tensor` (`CausalLM.load_weights`)

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy this rank's rows of the checkpoint's whole matrix; ValueError for another shape."""
        whole = read_whole(tensor)
        if whole.dim() != 2 or whole.shape[0] < self.kept.stop or whole.shape[1] != self.weight.shape[1]:
            raise ValueError(f"has shape {tuple(whole.shape)}, not {self.kept.stop}+ rows of {self.weight.shape[1]}")
        with torch.no_grad():
            self.weight.copy_(whole[self.kept.start : self.kept.stop])


class HeadBlocks(nn.Linear):
    """Zamba's per-head projection (its `x_proj_weight` `[H, dt_rank + 2N, head]`, `dt_proj_weight` `[H, head,
    dt_rank]` and `dt_proj_bias` `[H, head]`) as one block-diagonal linear layer over this rank's heads (`heads`),
    each head's block its own and the rest zeros; loaded by `load_tensor`, quantized like any linear layer."""

    def __init__(self, heads: range, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.heads = heads
        self.weight.requires_grad_(False)

    own_tensors = ("weight", "bias")

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy this rank's heads' blocks of the checkpoint's per-head weight (or bias) into place."""
        whole = read_whole(tensor)
        if whole.dim() != (3 if kind == "weight" else 2) or whole.shape[0] < self.heads.stop:
            raise ValueError(f"has shape {tuple(whole.shape)}, not one block per head of {self.heads.stop}+")
        blocks = whole[self.heads.start : self.heads.stop]
        with torch.no_grad():
            if kind == "bias":
                if self.bias is None or blocks.numel() != self.bias.numel():
                    raise ValueError(f"has shape {tuple(whole.shape)}, not a bias of {self.out_features}")
                self.bias.copy_(blocks.reshape(-1))
                return
            rows, cols = blocks.shape[1:]
            if (len(self.heads) * rows, len(self.heads) * cols) != tuple(self.weight.shape):
                raise ValueError(f"has shape {tuple(whole.shape)}, not {len(self.heads)} heads' blocks of a "
                                 f"{tuple(self.weight.shape)} weight")  # fmt: skip
            self.weight.zero_()
            for head, block in enumerate(blocks):
                self.weight[head * rows : (head + 1) * rows, head * cols : (head + 1) * cols] = block


class Mamba1Mixer(nn.Module):
    """One Mamba-1 layer (module doc), with the same call as `PagedSelfAttention`, its state tensor in place of a KV
    cache; the checkpoint's `A_log` and `D` are read as `A_log.weight` and `D.weight`.

    Under tensor parallelism a rank holds a block of the channels: their rows of `in_proj`'s x and z and of
    `dt_proj`, their convolution channels and states, `x_proj`'s columns for them (its partial sums all-reduced, so
    every rank has the whole time step input, B and C) and `out_proj`'s columns (all-reduced)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if config.mamba1 is None:
            raise ValueError("Mamba1Mixer needs the model's mamba1 shape")
        self.tp = tp
        whole = config.mamba1
        inner = self.inner = whole.sharded(tp.size).inner
        channels = range(tp.rank * inner, (tp.rank + 1) * inner)
        self.sizes = [whole.dt_rank, whole.state_dim, whole.state_dim]
        self.in_proj: nn.Module = ColumnParallelLinear(
            config.hidden_size, [PartSlice(whole.inner, channels), PartSlice(whole.inner, channels)], False, dtype
        )
        self.conv1d = DepthwiseConv([channels], whole.conv_kernel, dtype, bias=whole.conv_bias)
        self.heads = whole.sharded(tp.size).heads
        if whole.heads > 1:  # Zamba's: each head its own x_proj and dt_proj, one block-diagonal linear layer each
            heads = range(tp.rank * self.heads, (tp.rank + 1) * self.heads)
            self.x_proj: nn.Module = HeadBlocks(heads, inner, self.heads * sum(self.sizes), False, dtype)
            self.dt_proj: nn.Module = HeadBlocks(heads, self.heads * whole.dt_rank, inner, True, dtype)
        else:
            self.x_proj = RowParallelLinear(whole.inner, sum(self.sizes), False, tp, dtype)
            self.dt_proj = ColumnParallelLinear(whole.dt_rank, [PartSlice(whole.inner, channels)], True, dtype)
        self.A_log = ChannelRows(channels, whole.state_dim, dtype)
        self.D = HeadSlice(channels, 1.0, dtype)
        self.inner_norms = whole.inner_norms != "none"
        if self.inner_norms:
            norm = WeightlessRMSNorm if whole.inner_norms == "weightless" else RMSNorm
            self.dt_layernorm = norm(whole.dt_rank, whole.inner_norm_eps, dtype)
            self.b_layernorm = norm(whole.state_dim, whole.inner_norm_eps, dtype)
            self.c_layernorm = norm(whole.state_dim, whole.inner_norm_eps, dtype)
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
        x, z = self.in_proj(hidden).split([self.inner, self.inner], dim=-1)
        core = advance_states(meta, state, "a Mamba layer", lambda slots, fresh: self._core(x, z, state, slots,
                                                                                             fresh, meta, ops))
        result: torch.Tensor = self.tp.all_reduce_sum(self.out_proj(core))
        return result

    def _core(
        self, x: torch.Tensor, z: torch.Tensor, state: torch.Tensor, slots: list[int], fresh: list[bool],
        meta: AttentionMetadata, ops: KernelOps,
    ) -> torch.Tensor:  # fmt: skip
        """The convolution, the projections of the time step, B and C, and the scan, gated: `[T, inner]`."""
        rows = state[:, (self.conv1d.weight.shape[-1] - 1) * self.inner :]
        lens = meta.query_lens_cpu
        convolved = ops.mamba1_conv(x, self.conv1d.weight, self.conv1d.bias, state, slots, lens, fresh)
        if self.heads > 1:
            return self._heads_core(convolved, z, rows, slots, fresh, meta, ops)
        step, b, c = self.tp.all_reduce_sum(self.x_proj(convolved)).split(self.sizes, dim=-1)
        if self.inner_norms:
            step, b, c = self.dt_layernorm(step, ops), self.b_layernorm(b, ops), self.c_layernorm(c, ops)
        dt = F.softplus(self.dt_proj(step).float())
        a = -self.A_log.weight.float().exp()
        return ops.mamba1_scan(convolved, dt, a, b, c, self.D.weight, z, rows, slots, lens, fresh).to(x.dtype)

    def _heads_core(
        self, convolved: torch.Tensor, z: torch.Tensor, rows: torch.Tensor, slots: list[int], fresh: list[bool],
        meta: AttentionMetadata, ops: KernelOps,
    ) -> torch.Tensor:  # fmt: skip
        """`_core` after the convolution for Zamba's heads: each head's time step input, B and C from its block of
        `x_proj`, its time step from its block of `dt_proj`, its scan over its channels and their state rows."""
        tokens, heads, head = convolved.shape[0], self.heads, self.inner // self.heads
        step, b, c = self.x_proj(convolved).view(tokens, heads, -1).split(self.sizes, dim=-1)
        dt = F.softplus(self.dt_proj(step.reshape(tokens, -1)).float())
        a = -self.A_log.weight.float().exp()
        width = head * a.shape[1]
        outputs = []
        for index in range(heads):
            channels = slice(index * head, (index + 1) * head)
            outputs.append(ops.mamba1_scan(
                convolved[:, channels], dt[:, channels], a[channels], b[:, index], c[:, index],
                self.D.weight[channels], z[:, channels], rows[:, index * width : (index + 1) * width], slots,
                meta.query_lens_cpu, fresh,
            ))  # fmt: skip
        return torch.cat(outputs, dim=-1).to(convolved.dtype)
