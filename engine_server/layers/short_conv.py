"""LFM2's gated short convolution: the token mixer of its non-attention layers, over a state per sequence.

`in_proj` gives each token B, C and x (each `hidden` wide); the layer returns `out_proj(C * conv(B * x))`, conv a
depthwise causal convolution of a few taps (`ModelConfig.short_convolution`). Where an attention layer keeps every
token's K/V in the paged cache, this layer keeps, per running sequence, the last `taps - 1` values of `B * x`
(`ladle_kernels.causal_conv.short_convolution`), in one float32 tensor per layer `[slots, state_size]` as Gated
DeltaNet's states are (`layers.gated_deltanet`: the same slots, prefix snapshots and copies, and the same reasons a step
with it is never stopped half way and speculative decoding does not serve it).
"""

from __future__ import annotations

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.gated_deltanet import DepthwiseConv, advance_states
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine_server.parallel.sharding import PartSlice
from ladle_kernels.kernel_set import KernelOps


class ShortConv(nn.Module):
    """One short-convolution layer: `in_proj` (rows `cat(B, C, x)`), the kernel set's `short_convolution` over
    `B * x`, the gate `C`, then `out_proj`. Same call as `PagedSelfAttention`, with this layer's state tensor in
    place of its KV cache (and no rope).

    Under tensor parallelism a rank holds a block of the channels: its rows of B, C and x, its channels of the
    convolution and their states, and the matching columns of `out_proj`, whose partial sums it all-reduces."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if config.short_convolution is None:
            raise ValueError("ShortConv needs the model's short_convolution shape")
        self.tp = tp
        whole = config.short_convolution
        self.channels = whole.sharded(tp.size).channels  # this rank's
        kept = range(tp.rank * self.channels, (tp.rank + 1) * self.channels)
        self.in_proj: nn.Module = ColumnParallelLinear(
            config.hidden_size, [PartSlice(whole.channels, kept)] * 3, False, dtype
        )
        self.conv1d = DepthwiseConv([kept], whole.conv_kernel, dtype)
        self.out_proj: nn.Module = RowParallelLinear(whole.channels, config.hidden_size, False, tp, dtype)

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
        b, c, x = self.in_proj(hidden).split(self.channels, dim=-1)
        convolved = advance_states(
            meta, state, "a short convolution",
            lambda slots, fresh: ops.short_convolution(b * x, self.conv1d.weight, state, slots, meta.query_lens_cpu,
                                                       fresh),
        )  # fmt: skip
        result: torch.Tensor = self.tp.all_reduce_sum(self.out_proj(c * convolved))
        return result
