"""Mamba-2: the selective state space mixer of Granite 4.0's hybrid layers, over a state per sequence.

`in_proj` gives each token its gate z, x, B, C and a time step per head (`ModelConfig.mamba2`); a depthwise causal
convolution with SiLU runs over x, B and C, the scan over x (`kernels.mamba2`), then `rms_norm(y * silu(z))` and
`out_proj`. Where an attention layer keeps every token's K/V in the paged cache, this layer keeps, per running
sequence, the convolution's last inputs and one matrix per head, in one float32 tensor per layer `[slots,
state_size]` as Gated DeltaNet's states are (`layers.gated_deltanet`: the same slots, prefix snapshots and copies,
and the same reasons a step with it is never stopped half way and speculative decoding does not serve it).
"""

from __future__ import annotations

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.gated_deltanet import DepthwiseConv, GatedRMSNorm, copy_state_rows
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, ColumnParallelLinear, RowParallelLinear, read_whole
from engine_server.parallel.sharding import PartSlice
from kernels.kernel_set import KernelOps


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer: `in_proj` (rows `cat(z, x, B, C, dt)`), the kernel set's `mamba2_mixer` (the convolution,
    the scan with `A = -exp(A_log)`, `dt = softplus(dt + dt_bias)` and the skip `D x`, the gated norm), then
    `out_proj`. Same call as `PagedSelfAttention`, with this layer's state tensor in place of its KV cache (and no
    rope). One device only (`config.Mamba2.sharded`)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if config.mamba2 is None:
            raise ValueError("Mamba2Mixer needs the model's mamba2 shape")
        self.tp = tp
        shape = self.shape = config.mamba2.sharded(tp.size)
        self.sizes = [shape.inner, shape.conv_dim, shape.num_heads]
        parts = [PartSlice(size, range(size)) for size in self.sizes]
        self.in_proj: nn.Module = ColumnParallelLinear(config.hidden_size, parts, False, dtype)
        self.conv1d = DepthwiseConv([range(shape.conv_dim)], shape.conv_kernel, dtype, bias=shape.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(shape.num_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(shape.num_heads, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.ones(shape.num_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(shape.inner, config.rms_norm_eps, dtype)
        self.out_proj: nn.Module = RowParallelLinear(shape.inner, config.hidden_size, False, tp, dtype)

    own_tensors = ("A_log", "dt_bias", "D")  # loaded by `load_tensor` (`CausalLM.load_weights`)

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy the checkpoint's `A_log`, `dt_bias` or `D` (`[num_heads]`)."""
        whole = read_whole(tensor)
        dest = {"A_log": self.A_log, "dt_bias": self.dt_bias, "D": self.D}[kind]
        if tuple(whole.shape) != tuple(dest.shape):
            raise ValueError(f"{kind} of shape {tuple(whole.shape)} is not one value per head")
        with torch.no_grad():
            dest.copy_(whole)

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
        slots = meta.state_slots_cpu
        if slots is None:
            raise ValueError("a step through a Mamba-2 layer needs each sequence's state slot (state_slots)")
        z, xbc, dt = self.in_proj(hidden).split(self.sizes, dim=-1)
        copies = meta.state_copies
        if copies is not None:  # prefixes' snapshots into the slots of the requests that start from them
            copy_state_rows(state, *copies.restores)
        # A chunk that starts its sequence starts from zeros (a slot's last holder left its own state there).
        fresh = [length == count for count, length in zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)]
        core = ops.mamba2_mixer(
            xbc, z, dt, self.conv1d.weight, self.conv1d.bias, self.A_log, self.dt_bias, self.D, self.norm.weight,
            self.norm.eps, self.shape.groups, state, slots, meta.query_lens_cpu, fresh,
        )  # fmt: skip
        if copies is not None:  # slots at their prompts' snapshot points into their snapshot rows
            copy_state_rows(state, *copies.saves)
        result: torch.Tensor = self.tp.all_reduce_sum(self.out_proj(core))
        return result
