"""Gated DeltaNet: the linear attention of Qwen3-Next's and Qwen3.5's hybrid layers, over a state per sequence.

Where an attention layer keeps every token's K/V in the paged cache, this layer keeps, per running sequence, one
fixed-size state (`ModelConfig.linear_attention`): the short convolution's last inputs and a matrix per value head
(`ladle_kernels.gated_delta`). The states of all sequences live in one float32 tensor per layer, `[slots, state_size]`,
row `AttentionMetadata.state_slots[i]` being sequence i's (the scheduler gives each running request a slot,
`engine_server.core.state_slots`); a sequence whose chunk starts at position 0 starts from zeros. Between the input
and output projections the kernel set's `gated_delta_net` runs the step (on the CPU one C++ call). Rows after the
slots hold prefixes' snapshots (`engine_server.core.state_snapshots`): the step's `AttentionMetadata.state_copies`
copy them into the slots of the requests that start from them before the update, and slots that reached a
prompt's snapshot point into theirs after it.

A step's update of the states cannot be taken back, so a step with this layer is never stopped half way
(`ModelRunner.can_interrupt`), and speculative decoding (which re-runs rejected tokens) does not serve these models.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import LinearAttention, ModelConfig
from engine_server.loader.lazy_tensor import LazyTensor, derived
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, ColumnParallelLinear, RowParallelLinear, read_whole
from engine_server.parallel.sharding import PartSlice
from ladle_kernels.kernel_set import KernelOps


class GatedRMSNorm(nn.Module):
    """The gated norm's weight `[Dv]` and eps (`ladle_kernels.gated_delta.gated_norm`: `weight * rms_norm(x) * silu(z)`
    over each value head), which the kernel set's `gated_delta_net` applies; not offset like the model's norms."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps


class DepthwiseConv(nn.Module):
    """The short causal convolution's weight, `[channels, 1, kernel]` as checkpoints store it, and with `bias` its
    bias `[channels]` (Mamba-2's), of this rank's channels (`kept`: their rows of the checkpoint's, in order)."""

    def __init__(self, kept: list[range], kernel: int, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        self.kept = kept
        channels = sum(len(rows) for rows in kept)
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(channels, dtype=dtype), requires_grad=False) if bias else None

    own_tensors = ("weight", "bias")  # loaded by `load_tensor` (`CausalLM.load_weights`)

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy the checkpoint's whole weight (or bias), keeping this rank's channels; ValueError on another shape,
        or for a bias this convolution has none of."""
        whole = read_whole(tensor)
        needed = self.kept[-1].stop  # the last of this rank's v channels
        if kind == "bias":
            if self.bias is None or whole.dim() != 1 or whole.shape[0] < needed:
                raise ValueError(f"a bias of shape {tuple(whole.shape)} for a convolution of "
                                 f"{'no bias' if self.bias is None else f'{self.bias.shape[0]} channels'}")  # fmt: skip
            dest = self.bias
        elif whole.dim() != 3 or whole.shape[1:] != self.weight.shape[1:] or whole.shape[0] < needed:
            raise ValueError(f"has shape {tuple(whole.shape)}, expected [channels, 1, {self.weight.shape[2]}]")
        else:
            dest = self.weight
        with torch.no_grad():
            dest.copy_(torch.cat([whole[rows.start : rows.stop] for rows in self.kept]))


def split_qkv(name: str, tensor: CheckpointTensor, shape: LinearAttention) -> list[tuple[str, CheckpointTensor]]:
    """Qwen3.5's `in_proj_qkv` weight as its q, k and v rows (`in_proj_q`, `in_proj_k`, `in_proj_v`), each a part of
    `GatedDeltaNet.in_proj` that tensor parallelism splits by heads; unread parts of an unread tensor (a layer
    served from a GGUF file's blocks reads none). ValueError when the rows do not add up."""
    if tensor.dim() != 2 or tensor.shape[0] != shape.conv_dim:
        raise ValueError(f"weight {name!r} of shape {tuple(tensor.shape)}: expected {shape.conv_dim} rows")
    return _row_parts(name.removesuffix("_qkv.weight") + "_{}.weight", tensor, ("q", "k", "v"),
                      [shape.key_dim, shape.key_dim, shape.value_dim], groups=1)  # fmt: skip


def split_fused_in_proj(
    name: str, tensor: CheckpointTensor, shape: LinearAttention
) -> list[tuple[str, CheckpointTensor]]:
    """Lara Mini's fused `in_proj` weight (rows q, k, v, z, b, a in turn, not grouped by head) as the parts
    `GatedDeltaNet.in_proj` loads (`in_proj_q`, ..., `in_proj_a`); unread parts of an unread tensor. ValueError when
    the rows do not add up."""
    sizes = [shape.key_dim, shape.key_dim, shape.value_dim, shape.value_dim, shape.num_value_heads,
             shape.num_value_heads]  # fmt: skip
    if tensor.dim() != 2 or tensor.shape[0] != sum(sizes):
        raise ValueError(f"weight {name!r} of shape {tuple(tensor.shape)}: expected {sum(sizes)} rows")
    return _row_parts(name.removesuffix("in_proj.weight") + "in_proj_{}.weight", tensor, ("q", "k", "v", "z", "b", "a"),
                      sizes, groups=1)  # fmt: skip


def split_grouped_projections(
    name: str, tensor: CheckpointTensor, shape: LinearAttention
) -> list[tuple[str, CheckpointTensor]]:
    """Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` weight as the parts `GatedDeltaNet.in_proj` loads: rows grouped by
    key head (`[q, k, v, z]` of each group, `[b, a]` of each) become `in_proj_q`, `in_proj_k`, `in_proj_v` and
    `in_proj_z` (or `in_proj_b` and `in_proj_a`), each head in its order; unread parts of an unread tensor.
    ValueError when the rows do not add up."""
    groups, per_group = shape.num_key_heads, shape.num_value_heads // shape.num_key_heads
    base = name.rpartition(".in_proj_")[0]
    names: tuple[str, ...]
    if name.endswith("in_proj_qkvz.weight"):
        value_rows = per_group * shape.value_head_dim
        sizes, names = [shape.key_head_dim, shape.key_head_dim, value_rows, value_rows], ("q", "k", "v", "z")
    else:
        sizes, names = [per_group, per_group], ("b", "a")
    if tensor.dim() != 2 or tensor.shape[0] != groups * sum(sizes):
        raise ValueError(f"weight {name!r} of shape {tuple(tensor.shape)}: expected {groups * sum(sizes)} rows")
    return _row_parts(base + ".in_proj_{}.weight", tensor, names, sizes, groups)


def _row_parts(
    pattern: str, tensor: CheckpointTensor, names: tuple[str, ...], sizes: list[int], groups: int
) -> list[tuple[str, CheckpointTensor]]:
    """`tensor`'s rows, `groups` groups each of parts `sizes` rows in turn, as one tensor per part (its rows of every
    group), named `pattern.format(name)`: now, or unread for an unread tensor (`loader.lazy_tensor.derived`)."""
    columns = tensor.shape[1]

    def part(index: int) -> CheckpointTensor:
        def cut(whole: torch.Tensor) -> torch.Tensor:
            return whole.view(groups, sum(sizes), columns).split(sizes, dim=1)[index].reshape(-1, columns)

        if isinstance(tensor, LazyTensor):
            return derived(tensor, (groups * sizes[index], columns), cut)
        return cut(read_whole(tensor))

    return [(pattern.format(name), part(index)) for index, name in enumerate(names)]


class GatedDeltaNet(nn.Module):
    """One linear-attention layer: `in_proj` (rows `cat(q, k, v, z, b, a)`), then the kernel set's `gated_delta_net`
    (the convolution over q/k/v, the gated delta rule with decay `g = -exp(A_log) * softplus(a + dt_bias)` and write
    strength `beta = LinearAttention.beta_scale * sigmoid(b)`, the gated norm by `z`), then `out_proj`. Same call as
    `PagedSelfAttention`, with this layer's state tensor in place of its KV cache (and no rope).

    Under tensor parallelism a rank holds its block of the key heads and of the value heads (`LinearAttention.
    sharded`: each value head beside the key head it reads), their rows of every input projection and channels of the
    convolution, their `A_log` and `dt_bias`, its states of them alone, and the matching columns of `out_proj`, whose
    partial sums it all-reduces."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if config.linear_attention is None:
            raise ValueError("GatedDeltaNet needs the model's linear_attention shape")
        self.tp = tp
        whole = config.linear_attention
        shape = self.shape = whole.sharded(tp.size)  # this rank's heads
        keys = range(tp.rank * shape.key_dim, (tp.rank + 1) * shape.key_dim)
        values = range(tp.rank * shape.value_dim, (tp.rank + 1) * shape.value_dim)
        heads = range(tp.rank * shape.num_value_heads, (tp.rank + 1) * shape.num_value_heads)
        self.heads = heads
        parts = [
            PartSlice(whole.key_dim, keys), PartSlice(whole.key_dim, keys), PartSlice(whole.value_dim, values),
            PartSlice(whole.value_dim, values), PartSlice(whole.num_value_heads, heads),
            PartSlice(whole.num_value_heads, heads),
        ]  # fmt: skip
        self.sizes = [shape.conv_dim, shape.value_dim, shape.num_value_heads, shape.num_value_heads]
        self.in_proj: nn.Module = ColumnParallelLinear(config.hidden_size, parts, False, dtype)
        # The convolution's channels are q, k and v side by side: this rank's of each.
        offsets = (0, whole.key_dim, 2 * whole.key_dim)
        kept = [
            range(offset + rows.start, offset + rows.stop)
            for offset, rows in zip(offsets, (keys, keys, values), strict=True)
        ]
        self.conv1d = DepthwiseConv(kept, whole.conv_kernel, dtype)
        self.dt_bias = nn.Parameter(torch.ones(shape.num_value_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(shape.num_value_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(shape.value_head_dim, whole.norm_eps or config.rms_norm_eps, dtype)
        self.out_proj: nn.Module = RowParallelLinear(whole.value_dim, config.hidden_size, False, tp, dtype)

    own_tensors = ("A_log", "dt_bias")  # loaded by `load_tensor` (`CausalLM.load_weights`)

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy the checkpoint's `A_log` or `dt_bias` (`[num_value_heads]`), keeping this rank's heads."""
        whole = read_whole(tensor)
        dest = self.A_log if kind == "A_log" else self.dt_bias
        if tuple(whole.shape) != (self.shape.num_value_heads * self.tp.size,):
            raise ValueError(f"{kind} of shape {tuple(whole.shape)} is not one value per value head")
        with torch.no_grad():
            dest.copy_(whole[self.heads.start : self.heads.stop])

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
        return advance_states(
            meta, state, "linear attention", lambda slots, fresh: self.advance(hidden, state, slots, fresh, meta, ops)
        )

    def advance(
        self,
        hidden: torch.Tensor,
        state: torch.Tensor,
        slots: list[int],
        fresh: list[bool],
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor:
        """`forward`'s step inside `advance_states` (whose caller copies the snapshots around it): sequence i's
        state is row `slots[i]` of `state` (its first `LinearAttention.own_state_size` values), zeroed first where
        `fresh[i]`."""
        mixed, z, b, a = self.in_proj(hidden).split(self.sizes, dim=-1)
        own = state if not self.shape.extra_state else state[:, : self.shape.own_state_size]
        core = ops.gated_delta_net(
            mixed, z, a, b, self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight, self.norm.eps,
            self.shape.num_key_heads, own, slots, meta.query_lens_cpu, fresh, self.shape.beta_scale,
        )  # fmt: skip
        result: torch.Tensor = self.tp.all_reduce_sum(self.out_proj(core))
        return result


def advance_states(
    meta: AttentionMetadata, state: torch.Tensor, what: str, step: Callable[[list[int], list[bool]], torch.Tensor]
) -> torch.Tensor:
    """A recurrent layer's core over a step, `step(slots, fresh)` (each sequence's state row, and whether its chunk
    starts it: then it starts from zeros, whatever a slot's last holder left there), between the step's prefix
    snapshot copies: restored into the slots of the requests that start from them before, slots at their prompts'
    snapshot points saved after. ValueError naming `what` when the step has no state slots."""
    slots = meta.state_slots_cpu
    if slots is None:
        raise ValueError(f"a step through {what} needs each sequence's state slot (state_slots)")
    copies = meta.state_copies
    if copies is not None:
        copy_state_rows(state, *copies.restores)
    fresh = [length == count for count, length in zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)]
    out = step(slots, fresh)
    if copies is not None:
        copy_state_rows(state, *copies.saves)
    return out


def copy_state_rows(state: torch.Tensor, sources: list[int], destinations: list[int]) -> None:
    """Copy rows `sources` of `state` over rows `destinations` (none may be among `sources`)."""
    if sources:
        device = state.device
        rows = state.index_select(0, torch.tensor(sources, dtype=torch.int64, device=device))
        state.index_copy_(0, torch.tensor(destinations, dtype=torch.int64, device=device), rows)
