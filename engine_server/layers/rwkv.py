"""RWKV-4's block (`config.Rwkv`; transformers' `RwkvBlock` with its CPU recurrence), over a state per sequence.

`h += time_mix(ln1(h)); h += channel_mix(ln2(h))` (the first block LayerNorms its input first, `pre_ln`). Each mix
reads its input x beside the previous token's (`shifted`: the state's for a chunk's first token), each projection's
input `x * mix + shifted * (1 - mix)` with a mix per channel:

- time mix: k, v and r from `key`, `value`, `receptance`; per channel the WKV recurrence with decay `-exp(time_decay)`
  and bonus `time_first`, kept in float32 as numerator, denominator and running maximum (exp of differences only);
  `output(sigmoid(r) * wkv)`;
- channel mix: `sigmoid(receptance(x_r)) * value(relu(key(x_k))²)`.

A block's state row holds the channel mix's previous input, the time mix's, then the WKV's three rows; a fresh
sequence starts from zeros (the running maximum from -1e38). Each `rescale_every`-th block's output projections are
read divided by 2^(block // rescale_every) and the hidden state is halved after it, as transformers serves it. The
recurrence runs in torch a token a step, each step over every sequence with a token there; sigmoids go through the
kernel set's `sigmoid_mul` (row by row on the CPU).

Under tensor parallelism a rank holds a block of the WKV channels (their rows of `key`, `value` and `receptance`,
their decays and states) and of the channel mix's width, all-reducing both output projections; the mixes, norms and
the channel mix's receptance are whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.norm import BiasedLayerNorm
from engine_server.layers.rowwise import recurrence_steps, rowwise
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, ColumnParallelLinear, RowParallelLinear, read_whole
from engine_server.parallel.sharding import PartSlice
from ladle_kernels.kernel_set import KernelOps

_FRESH_MAXIMUM = -1e38  # the WKV's running maximum before any token: exp of anything less it is 0


class ChannelMixes(nn.Module):
    """A mix's per-channel weights (`time_mix_key`, ...; `[1, 1, hidden]` in checkpoints) and, on the time mix, this
    rank's channels' `time_decay` and `time_first`."""

    def __init__(self, names: tuple[str, ...], hidden: int, dtype: torch.dtype, channels: range | None = None) -> None:
        super().__init__()
        self.channels = channels
        for name in names:
            self.register_parameter(name, nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False))
        if channels is not None:
            for name in ("time_decay", "time_first"):
                self.register_parameter(name, nn.Parameter(torch.zeros(len(channels), dtype=dtype),
                                                           requires_grad=False))  # fmt: skip
        self.own_tensors = (*names, *(("time_decay", "time_first") if channels is not None else ()))

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy a mix (any shape of `hidden` values) or this rank's channels of `time_decay` / `time_first`."""
        whole = read_whole(tensor).reshape(-1)
        dest = self.get_parameter(kind)
        if kind in ("time_decay", "time_first") and self.channels is not None:
            if whole.shape[0] < self.channels.stop:
                raise ValueError(f"has {whole.shape[0]} values, expected one per channel")
            whole = whole[self.channels.start : self.channels.stop]
        if whole.shape != dest.shape:
            raise ValueError(f"has {whole.shape[0]} values, expected {dest.shape[0]}")
        with torch.no_grad():
            dest.copy_(whole)


class RwkvTimeMix(nn.Module):
    """The time mix (`attention`, checkpoint names): `key`, `value`, `receptance` (this rank's channels), `output`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        assert config.rwkv is not None
        whole, hidden = config.rwkv.attention_hidden, config.hidden_size
        share = config.rwkv.sharded(tp.size).attention_hidden
        self.channels = range(tp.rank * share, (tp.rank + 1) * share)
        part = PartSlice(whole, self.channels)
        self.key, self.value, self.receptance = (ColumnParallelLinear(hidden, [part], False, dtype) for _ in range(3))
        self.output: nn.Module = RowParallelLinear(whole, hidden, False, tp, dtype)
        self.mixes = ChannelMixes(("time_mix_key", "time_mix_value", "time_mix_receptance"), hidden, dtype,
                                  self.channels)  # fmt: skip


class RwkvChannelMix(nn.Module):
    """The channel mix (`feed_forward`): `key` (this rank's share of the width), `receptance` (whole), `value`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        hidden, width = config.hidden_size, config.intermediate_size
        share = width // tp.size
        self.key = ColumnParallelLinear(hidden, [PartSlice(width, range(tp.rank * share, (tp.rank + 1) * share))],
                                        False, dtype)  # fmt: skip
        self.receptance = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.value: nn.Module = RowParallelLinear(width, hidden, False, tp, dtype)
        self.mixes = ChannelMixes(("time_mix_key", "time_mix_receptance"), hidden, dtype)


class RwkvLayer(nn.Module):
    """One block (module doc); parameters named as RWKV-4's checkpoints name them (`blocks.<i>.*`), its mixes'
    weights read into `mixes` (`models.rwkv`). Run by `models.rwkv.RwkvDecoderModel` through `advance_block`."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool, tp: TensorParallel = SINGLE, index: int = 0
    ) -> None:
        super().__init__()
        spec = config.rwkv
        assert spec is not None, "an RWKV layer needs the model's rwkv shape"
        self.tp, self.hidden = tp, config.hidden_size
        eps = config.rms_norm_eps
        self.pre_ln = BiasedLayerNorm(config.hidden_size, eps, dtype) if index == 0 else None
        self.ln1 = BiasedLayerNorm(config.hidden_size, eps, dtype)
        self.ln2 = BiasedLayerNorm(config.hidden_size, eps, dtype)
        self.attention = RwkvTimeMix(config, dtype, tp)
        self.feed_forward = RwkvChannelMix(config, dtype, tp)
        self.scale = 0.5 ** (index // spec.rescale_every) if spec.rescale_every > 0 else 1.0
        self.channels = spec.sharded(tp.size).attention_hidden

    def advance_block(
        self,
        hidden: torch.Tensor,
        state: torch.Tensor,
        slots: list[int],
        fresh: list[bool],
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor:
        """hidden `[T, hidden]` -> the block's output, inside `advance_states`: sequence i's state is row
        `slots[i]` of `state`, started afresh where `fresh[i]`."""
        size, channels = self.hidden, self.channels
        for slot, is_fresh in zip(slots, fresh, strict=True):
            if is_fresh:
                state[slot].zero_()
                state[slot, 2 * size + 2 * channels :] = _FRESH_MAXIMUM
        if self.pre_ln is not None:
            hidden = self.pre_ln(hidden, ops)
        mixed = self.ln1(hidden, ops)
        time = self.attention
        shifted = _shifted(mixed, state[:, size : 2 * size], slots, meta.query_lens_cpu)
        mixes = time.mixes
        key = time.key(_mix(mixed, shifted, mixes.get_parameter("time_mix_key")))
        value = time.value(_mix(mixed, shifted, mixes.get_parameter("time_mix_value")))
        receptance = time.receptance(_mix(mixed, shifted, mixes.get_parameter("time_mix_receptance")))
        wkv = self._wkv(key, value, state[:, 2 * size :], slots, meta.query_lens_cpu)
        out = time.output(ops.sigmoid_mul(wkv, receptance.contiguous()))
        hidden = hidden + self.tp.all_reduce_sum(out * self.scale if self.scale != 1.0 else out)
        mixed = self.ln2(hidden, ops)
        channel = self.feed_forward
        shifted = _shifted(mixed, state[:, :size], slots, meta.query_lens_cpu)
        key = torch.square(torch.relu(channel.key(_mix(mixed, shifted, channel.mixes.get_parameter("time_mix_key")))))
        value = self.tp.all_reduce_sum(channel.value(key))
        value = value * self.scale if self.scale != 1.0 else value
        gate = channel.receptance(_mix(mixed, shifted, channel.mixes.get_parameter("time_mix_receptance")))
        return hidden + ops.sigmoid_mul(value.contiguous(), gate.contiguous())

    def _wkv(
        self, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor, slots: list[int], query_lens: list[int]
    ) -> torch.Tensor:
        """The WKV of every token `[T, channels]` in key's dtype (transformers' CPU recurrence), each sequence's
        numerator, denominator and maximum (its row of `rows`, `[3 * channels]`) advanced in place: step j advances
        every sequence with a j-th token of this chunk at once, gathered from its row and written back (the exps
        over whole rows padded to whole vectors: a token's bits do not depend on its batch)."""
        mixes, channels = self.attention.mixes, self.channels
        decay = -torch.exp(mixes.get_parameter("time_decay").float())
        bonus = mixes.get_parameter("time_first").float()
        out = torch.empty_like(key)
        for index, tokens in recurrence_steps(slots, query_lens, key.device):
            numerator, denominator, maximum = rows.index_select(0, index).view(-1, 3, channels).unbind(1)
            k, v = key.index_select(0, tokens).float(), value.index_select(0, tokens)
            top = torch.maximum(maximum, k + bonus)
            old, new = rowwise(torch.exp, maximum - top), rowwise(torch.exp, k + bonus - top)
            out.index_copy_(0, tokens, ((old * numerator + new * v) / (old * denominator + new)).to(key.dtype))
            top = torch.maximum(maximum + decay, k)
            old, new = rowwise(torch.exp, maximum + decay - top), rowwise(torch.exp, k - top)
            advanced = (old * numerator + new * v, old * denominator + new, top)
            rows.index_copy_(0, index, torch.stack(advanced, dim=1).flatten(1))
        return out


def _mix(x: torch.Tensor, shifted: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x * weight + shifted * (1 - weight)`, as transformers computes it."""
    return x * weight + shifted * (1 - weight)


def _shifted(x: torch.Tensor, previous: torch.Tensor, slots: list[int], query_lens: list[int]) -> torch.Tensor:
    """Each token's previous input `[T, hidden]`: the one before it in its chunk, or for a chunk's first token its
    sequence's saved one (its row of `previous`, `[slots, hidden]` float32); the rows saved become each chunk's last
    input."""
    out, start = torch.empty_like(x), 0
    for slot, count in zip(slots, query_lens, strict=True):
        out[start] = previous[slot].to(x.dtype)
        out[start + 1 : start + count] = x[start : start + count - 1]
        previous[slot] = x[start + count - 1].float()
        start += count
    return out
