"""Kimi Delta Attention (KDA): the linear attention of Kimi Linear's hybrid layers, over a state per sequence.

Gated DeltaNet's rule and state (`layers.gated_deltanet`, `ladle_kernels.gated_delta`) with Kimi's own parts: a key head
per value head; q, k and v from projections of their own (read as one `qkv_proj`, the convolution's channels in
that order); a decay per key channel, `g = -exp(A_log[head]) * softplus(f_b(f_a(x)) + dt_bias)`, whose projection
goes through the rank of one head; the output gate likewise low-rank (`g_b(g_a(x))`), and the norm gated by its
sigmoid rather than its SiLU. The kernel set's `gated_delta_net` runs the step, as for Gated DeltaNet.

Ling 3's (`LinearAttention.full_rank_gates`, `decay_bound`): whole `f_proj` and `g_proj` projections, and its safe
gate, `g = lower_bound * sigmoid(exp(A_log[head]) * (f_proj(x) + dt_bias))`, a decay bounded below.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.gated_deltanet import DepthwiseConv, GatedRMSNorm, advance_states
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, ColumnParallelLinear, RowParallelLinear, read_whole
from engine_server.parallel.sharding import PartSlice
from ladle_kernels.kernel_set import KernelOps


class KimiDeltaAttention(nn.Module):
    """One KDA layer under its checkpoints' names: `q_proj`, `k_proj`, `v_proj` (as `qkv_proj`), `conv1d`, `b_proj`
    (the write strength), `f_a_proj` / `f_b_proj` (Ling 3's: `f_proj`), `A_log` and `dt_bias` (the decay),
    `g_a_proj` / `g_b_proj` (Ling 3's: `g_proj`; the output gate), `o_norm` and `o_proj`. Same call as
    `PagedSelfAttention`, with this layer's state tensor in place of its KV cache (and no rope).

    Under tensor parallelism a rank holds its block of the heads: their rows of q, k, v, b and of the second
    low-rank projections, channels of the convolution, `A_log` and `dt_bias`, its states of them, and the matching
    columns of `o_proj`, whose partial sums it all-reduces; the rank-one-head first projections (`f_a_proj`,
    `g_a_proj`) are whole on every rank."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        whole = config.linear_attention
        if whole is None or not whole.kimi_delta:
            raise ValueError("KimiDeltaAttention needs the model's Kimi Delta Attention shape")
        self.tp = tp
        shape = self.shape = whole.sharded(tp.size)
        heads = range(tp.rank * shape.num_value_heads, (tp.rank + 1) * shape.num_value_heads)
        keys = range(tp.rank * shape.key_dim, (tp.rank + 1) * shape.key_dim)
        values = range(tp.rank * shape.value_dim, (tp.rank + 1) * shape.value_dim)
        self.heads, self.keys = heads, keys
        hidden, rank = config.hidden_size, whole.key_head_dim
        parts = [PartSlice(whole.key_dim, keys), PartSlice(whole.key_dim, keys), PartSlice(whole.value_dim, values)]
        self.qkv_proj = ColumnParallelLinear(hidden, parts, False, dtype)
        offsets = (0, whole.key_dim, 2 * whole.key_dim)
        kept = [
            range(offset + rows.start, offset + rows.stop)
            for offset, rows in zip(offsets, (keys, keys, values), strict=True)
        ]
        self.conv1d = DepthwiseConv(kept, whole.conv_kernel, dtype)
        self.b_proj = ColumnParallelLinear(hidden, [PartSlice(whole.num_value_heads, heads)], False, dtype)
        self.decay_bound, self.full_rank = whole.decay_bound, whole.full_rank_gates
        if self.full_rank:
            self.f_proj: nn.Module = ColumnParallelLinear(hidden, [PartSlice(whole.key_dim, keys)], False, dtype)
            self.g_proj: nn.Module = ColumnParallelLinear(hidden, [PartSlice(whole.value_dim, values)], False, dtype)
        else:
            self.f_a_proj: nn.Module = nn.Linear(hidden, rank, bias=False, dtype=dtype)
            self.f_b_proj: nn.Module = ColumnParallelLinear(rank, [PartSlice(whole.key_dim, keys)], False, dtype)
            self.g_a_proj: nn.Module = nn.Linear(hidden, rank, bias=False, dtype=dtype)
            self.g_b_proj: nn.Module = ColumnParallelLinear(rank, [PartSlice(whole.value_dim, values)], False, dtype)
        self.A_log = nn.Parameter(torch.zeros(shape.num_value_heads, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(shape.key_dim, dtype=dtype), requires_grad=False)
        self.o_norm = GatedRMSNorm(shape.value_head_dim, whole.norm_eps or config.rms_norm_eps, dtype)
        self.o_proj: nn.Module = RowParallelLinear(whole.value_dim, hidden, False, tp, dtype)

    own_tensors = ("A_log", "dt_bias")  # loaded by `load_tensor` (`CausalLM.load_weights`)

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy the checkpoint's `A_log` (a value per head, stored `[1, 1, heads, 1]`) or `dt_bias` (one per key
        channel), keeping this rank's; ValueError for another count."""
        whole = read_whole(tensor).reshape(-1)
        dest, kept = (self.A_log, self.heads) if kind == "A_log" else (self.dt_bias, self.keys)
        expected = dest.shape[0] * self.tp.size
        if whole.shape[0] != expected:
            raise ValueError(f"{kind} holds {whole.shape[0]} values, expected {expected}")
        with torch.no_grad():
            dest.copy_(whole[kept.start : kept.stop])

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
        `meta.state_slots[i]`) by its chunk. `positions`, `cos_sin_cache` and `lora` are not read (adapters target
        no linear-attention layer: `lora.targets`)."""
        mixed, b = self.qkv_proj(hidden), self.b_proj(hidden)
        if self.full_rank:
            decay, gate = self.f_proj(hidden), self.g_proj(hidden)
        else:
            decay, gate = self.f_b_proj(self.f_a_proj(hidden)), self.g_b_proj(self.g_a_proj(hidden))
        core = advance_states(
            meta, state, "Kimi delta attention",
            lambda slots, fresh: ops.gated_delta_net(
                mixed, gate, decay, b, self.conv1d.weight, self.A_log, self.dt_bias, self.o_norm.weight,
                self.o_norm.eps, self.shape.num_key_heads, state, slots, meta.query_lens_cpu, fresh, 1.0, True,
                self.decay_bound,
            ),
        )  # fmt: skip
        result: torch.Tensor = self.tp.all_reduce_sum(self.o_proj(core))
        return result
