"""xLSTM's mLSTM layer (`config.MLstm`; transformers' `xLSTMLayer` with its native recurrent step), over a state per
sequence.

Each token's q, k (`qk_head_dim` a head), v and output gate (`v_head_dim` a head) come from their projections, its
input and forget gate pre-activations (one a head, with biases) soft-capped (`cap * tanh(x / cap)`). Head by head,
with the stabiliser m (float32):

    m' = max(logsigmoid(f) + m, i);  a = exp(logsigmoid(f) + m - m');  b = exp(i - m')
    C' = a C + b k v^T;  n' = a n + b k;  h = (q' C') / (max(|q' . n'|, exp(-m')) + eps),  q' = q / sqrt(qk_head_dim)

then every head's h LayerNorm'd on its own (no bias), weighted, times the sigmoid of the output gate, and `out_proj`.
A sequence's state (its row of the layer's float32 state tensor, as Gated DeltaNet's: `layers.gated_deltanet`) holds
C, n and m of every head; a fresh one starts from zeros. The recurrence runs in torch a token a step (prefill
included), each step over every sequence that has a token there (a decode step is one step of all of them); the
gates' transcendental functions run over rows padded to whole vectors, so that a token's bits do not depend on its
batch.

Under tensor parallelism a rank holds a block of the heads: their rows of every projection and of the norm's weight,
its states of them, and the matching columns of `out_proj`, whose partial sums it all-reduces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.gated_deltanet import advance_states
from engine_server.layers.rowwise import recurrence_steps, rowwise
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, ColumnParallelLinear, RowParallelLinear, read_whole
from engine_server.parallel.sharding import PartSlice
from ladle_kernels.kernel_set import KernelOps


class HeadNorm(nn.Module):
    """The heads' LayerNorm weight (`multihead_norm`), this rank's heads' values of the checkpoint's."""

    def __init__(self, rows: range, dtype: torch.dtype) -> None:
        super().__init__()
        self.rows = rows
        self.weight = nn.Parameter(torch.ones(len(rows), dtype=dtype), requires_grad=False)

    own_tensors = ("weight",)

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy the checkpoint's weight (every head's), keeping this rank's heads' values."""
        whole = read_whole(tensor)
        if whole.dim() != 1 or whole.shape[0] < self.rows.stop:
            raise ValueError(f"has shape {tuple(whole.shape)}, expected one value per channel of every head")
        with torch.no_grad():
            self.weight.copy_(whole[self.rows.start : self.rows.stop])


class MLstmMixer(nn.Module):
    """One mLSTM layer (module doc); same call as `PagedSelfAttention`, with this layer's state tensor in place of
    its KV cache. Parameters named as xLSTM's checkpoints name them (`mlstm_layer.*`, read as `self_attn.*`)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if config.mlstm is None:
            raise ValueError("MLstmMixer needs the model's mlstm shape")
        whole = config.mlstm
        shape = self.shape = whole.sharded(tp.size)
        self.tp, self.norm_eps = tp, config.rms_norm_eps
        heads = range(tp.rank * shape.heads, (tp.rank + 1) * shape.heads)
        hidden = config.hidden_size

        def rows(width: int) -> ColumnParallelLinear:
            part = PartSlice(whole.heads * width, range(heads.start * width, heads.stop * width))
            return ColumnParallelLinear(hidden, [part], width == 1, dtype)

        self.q, self.k = rows(shape.qk_head_dim), rows(shape.qk_head_dim)
        self.v, self.ogate_preact = rows(shape.v_head_dim), rows(shape.v_head_dim)
        self.igate_preact, self.fgate_preact = rows(1), rows(1)
        dv = shape.v_head_dim
        self.multihead_norm = HeadNorm(range(heads.start * dv, heads.stop * dv), dtype)
        self.out_proj: nn.Module = RowParallelLinear(whole.heads * dv, hidden, False, tp, dtype)

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
        q, k, v = self.q(hidden), self.k(hidden), self.v(hidden)
        gates = torch.stack((self.igate_preact(hidden), self.fgate_preact(hidden)), dim=1).float()  # [T, 2, H]
        out = advance_states(
            meta, state, "mLSTM", lambda slots, fresh: self._recur(q, k, v, gates, state, slots, fresh, meta)
        )
        tokens, heads, dv = out.shape[0], self.shape.heads, self.shape.v_head_dim
        flat = out.float().view(tokens, heads, dv)
        normed = (flat - flat.mean(-1, keepdim=True)) * torch.rsqrt(flat.var(-1, keepdim=True, unbiased=False)
                                                                    + self.norm_eps)  # fmt: skip
        normed = normed.to(hidden.dtype).view(tokens, -1) * self.multihead_norm.weight
        gated = ops.sigmoid_mul(normed.contiguous(), self.ogate_preact(hidden).contiguous())
        result: torch.Tensor = self.tp.all_reduce_sum(self.out_proj(gated))
        return result

    def _recur(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        gates: torch.Tensor,
        state: torch.Tensor,
        slots: list[int],
        fresh: list[bool],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Every token's h `[T, heads, v_head_dim]` in q's dtype, each sequence's state (row `slots[i]`, zeroed first
        where `fresh[i]`) advanced in place: step j advances every sequence with a j-th token of this chunk at once
        (a decode step is one step of all of them), each gathered from its row and written back."""
        spec = self.shape
        heads, dk, dv, cap = spec.heads, spec.qk_head_dim, spec.v_head_dim, spec.gate_soft_cap
        out = q.new_empty(q.shape[0], heads, dv)
        queries = q.view(-1, heads, dk) * dk**-0.5
        keys, values = k.view(-1, heads, dk).float(), v.view(-1, heads, dv).float()
        for slot, is_fresh in zip(slots, fresh, strict=True):
            if is_fresh:
                state[slot].zero_()
        memory_size, norm_size = heads * dk * dv, heads * dk
        for rows, tokens in recurrence_steps(slots, meta.query_lens_cpu, state.device):
            row = state.index_select(0, rows)
            memory = row[:, :memory_size].view(-1, heads, dk, dv)
            normaliser = row[:, memory_size : memory_size + norm_size].view(-1, heads, dk)
            stabiliser = row[:, memory_size + norm_size :]
            capped = rowwise(lambda x: cap * torch.tanh(x / cap), gates.index_select(0, tokens))  # [A, 2, H]
            log_forget = rowwise(F.logsigmoid, capped[:, 1])
            top = torch.maximum(log_forget + stabiliser, capped[:, 0])
            forget = rowwise(torch.exp, log_forget + stabiliser - top)
            write = rowwise(torch.exp, capped[:, 0] - top)
            key, value = keys.index_select(0, tokens), values.index_select(0, tokens)
            outer = key[..., :, None] @ value[..., None, :]
            memory = forget[..., None, None] * memory + write[..., None, None] * outer
            normaliser = forget[..., None] * normaliser + write[..., None] * key
            query = queries.index_select(0, tokens)
            numerator = (query[..., None, :] @ memory.to(q.dtype)).squeeze(-2).float()
            dot = (query[..., None, :] @ normaliser[..., :, None].to(q.dtype)).squeeze(-1).squeeze(-1)
            denominator = torch.maximum(dot.abs(), rowwise(torch.exp, -top)) + spec.eps
            out.index_copy_(0, tokens, (numerator / denominator[..., None]).to(q.dtype))
            state.index_copy_(0, rows, torch.cat((memory.flatten(1), normaliser.flatten(1), top), dim=1))
        return out
