"""MiniMax-01's lightning attention: linear attention with a fixed decay per head, over a state per sequence.

`qkv_proj` (`qkv_heads`) gives each head its q, k and v (a head's three rows together), SiLU'd; head h keeps a
`d x d` matrix `S` that decays by `lambda_h = exp(-slope_h)` a token (`config.Lightning.slopes`):
`S_t = lambda S_{t-1} + k_t^T v_t`, `o_t = q_t S_t`. The heads' outputs are RMS-normalised together (`norm`, over
every head: under tensor parallelism the squares are summed over the ranks), times `sigmoid(output_gate(x))`, then
`out_proj`. On CUDA a chunk of tokens is computed in blocks of `block_size` as transformers computes its prefill
(each block's queries against the state before it, decayed, plus the block's own decayed products:
`lightning_chunk`); on the CPU token by token (`lightning_recurrence`), so that a token's bits do not depend on where
its chunk starts. The state lives in the layer's float32 state rows as every recurrent layer's does
(`layers.gated_deltanet`'s `advance_states`: the same slots, prefix snapshots and copies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.gated_deltanet import advance_states
from engine_server.layers.norm import ShardedRMSNorm
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine_server.parallel.sharding import PartSlice
from ladle_kernels.kernel_set import KernelOps

_NORM_EPS = 1e-6  # the heads' norm's (transformers' `MiniMaxRMSNorm` default), whatever the model's `rms_norm_eps`


def lightning_recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, slopes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lightning_chunk`'s result token by token: `S = lambda S + k^T v; o = q S`, each token's arithmetic the same
    wherever a chunk starts or ends (what the CPU path runs: a prompt's tokens then do not depend on how the scheduler
    cut it, nor on its batch)."""
    decay = torch.exp(-slopes.to(q.dtype))[:, None, None]
    outputs = [q.new_empty(q.shape[0], 0, v.shape[-1])]
    for t in range(q.shape[1]):
        state = decay * state + torch.matmul(k[:, t, :, None], v[:, t, None, :])
        outputs.append(torch.matmul(q[:, t, None, :], state))
    return torch.cat(outputs, dim=1), state


def lightning_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, slopes: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk: q, k, v `[H, n, d]`, its state `[H, d, d]` before them and the heads' rates `[H]` ->
    (outputs `[H, n, d]`, the state after them), in blocks of `block` tokens (module doc), in q's dtype: what the GPU
    path runs (a block's products in a few matrix products; their float sums then depend on where blocks start)."""
    rates = slopes.to(q.dtype)[:, None, None]
    outputs = []
    for start in range(0, q.shape[1], block):
        qb, kb, vb = (x[:, start : start + block] for x in (q, k, v))
        size = qb.shape[1]
        steps = torch.arange(1, size + 1, device=q.device, dtype=q.dtype)
        query_decay = torch.exp(-rates * steps[:, None])  # [H, b, 1]
        key_decay = torch.exp(-rates * (size - steps)[:, None])
        gaps = (steps[:, None] - steps[None, :])[None]  # [1, b, b]
        diagonal = torch.exp(torch.where(gaps >= 0, -rates * gaps, float("-inf")))
        within = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diagonal, vb)
        outputs.append(torch.matmul(qb * query_decay, state) + within)
        state = state * torch.exp(-rates * size) + torch.matmul((kb * key_decay).transpose(-1, -2), vb)
    return torch.cat(outputs, dim=1), state


class LightningAttention(nn.Module):
    """One lightning-attention layer (module doc), parameters named as transformers names them under `self_attn.`
    but `qkv_proj`, read as `qkv_heads` (its rows head by head, not this engine's fused q, k, v: `models.minimax`);
    same call as `PagedSelfAttention`, with this layer's state tensor in place of its KV cache (and no rope).

    Under tensor parallelism a rank holds a block of the heads: their q/k/v and gate rows, their states, their
    columns of `out_proj` (whose partial sums it all-reduces) and of the norm's weight."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE, index: int = 0) -> None:
        super().__init__()
        whole = config.lightning
        assert whole is not None, "a lightning-attention layer needs the model's lightning shape"
        shape = whole.sharded(tp.size, tp.rank)
        self.tp, self.heads, self.head_dim, self.block = tp, shape.heads, shape.head_dim, shape.block_size
        width = whole.heads * whole.head_dim
        kept = range(shape.first_head * shape.head_dim, (shape.first_head + shape.heads) * shape.head_dim)
        qkv_rows = range(3 * kept.start, 3 * kept.stop)
        self.qkv_heads: nn.Module = ColumnParallelLinear(config.hidden_size, [PartSlice(3 * width, qkv_rows)], False,
                                                        dtype)  # fmt: skip
        self.output_gate: nn.Module = ColumnParallelLinear(config.hidden_size, [PartSlice(width, kept)], False, dtype)
        self.norm = ShardedRMSNorm(width, kept, 1, _NORM_EPS, dtype, tp)
        self.out_proj: nn.Module = RowParallelLinear(width, config.hidden_size, False, tp, dtype)
        self.slopes = tuple(shape.slopes(index))  # (a tuple: no cast of the module's dtype touches them)

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
        `meta.state_slots[i]`) by its chunk. `positions`, `cos_sin_cache` are not read; LoRA adapters are refused."""
        if lora is not None:
            raise ValueError("LoRA adapters are not applied to lightning attention")
        qkv = F.silu(self.qkv_heads(hidden)).view(-1, self.heads, 3, self.head_dim)
        mixed = advance_states(
            meta, state, "lightning attention", lambda slots, fresh: self._chunks(qkv, state, slots, meta, fresh)
        )
        normed = self.norm(mixed.reshape(hidden.shape[0], -1), ops)
        gated = torch.sigmoid(self.output_gate(hidden)) * normed
        result: torch.Tensor = self.tp.all_reduce_sum(self.out_proj(gated))
        return result

    def _chunks(
        self, qkv: torch.Tensor, state: torch.Tensor, slots: list[int], meta: AttentionMetadata, fresh: list[bool]
    ) -> torch.Tensor:
        """Each sequence's chunk through `lightning_chunk` from its state row (zeros where its chunk starts it),
        the row written back; the outputs `[T, heads, head_dim]`."""
        out = torch.empty(qkv.shape[0], self.heads, self.head_dim, dtype=qkv.dtype, device=qkv.device)
        rates = torch.tensor(self.slopes, dtype=torch.float32, device=qkv.device)
        first = 0
        for slot, count, starts in zip(slots, meta.query_lens_cpu, fresh, strict=True):
            rows = qkv[first : first + count].transpose(0, 1)  # [H, n, 3, d]
            before = state[slot].view(self.heads, self.head_dim, self.head_dim)
            before = torch.zeros_like(before) if starts else before
            q, k, v = rows[:, :, 0], rows[:, :, 1], rows[:, :, 2]
            outputs, after = (
                lightning_chunk(q, k, v, before.to(qkv.dtype), rates, self.block) if qkv.is_cuda
                else lightning_recurrence(q, k, v, before.to(qkv.dtype), rates)
            )  # fmt: skip
            state[slot] = after.float().reshape(-1)
            out[first : first + count] = outputs.transpose(0, 1)
            first += count
        return out
