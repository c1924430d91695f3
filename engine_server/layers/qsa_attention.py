"""Qwen4-Exp's QSA attention: Qwen3.5's gated attention whose queries each attend over the positions an indexer keeps
(`config.Qwen4Exp`; transformers' `Qwen4ExpTextQSAIndexer`).

The indexer's one projection gives `index_heads` query heads and one key head, `index_head_dim` wide. Its queries
are normed (`1 + w`) and turned by rope over their first `rotary_dim` dims, as the attention's are. Its keys are
kept raw: a block of `compress_ratio` consecutive positions scores by its keys' mean (float32, rounded back), normed
and turned by rope at the block's first position; query t's score of a block is the sum over its heads of
`relu(q . k)`, over sqrt(index_head_dim). Of the blocks complete at t's position the `budget / compress_ratio` best
are kept, and the positions of the incomplete block up to t's own: every query head attends over those alone.

Each token's raw index key is one more head of the layer's cache rows, after its KV heads, in the key half (zero-
padded to `head_dim`; the value half's row is zeros), so prefix caching, preemption and swapping keep it as they keep
K/V. A sequence at most `Qwen4Exp.dense_positions` long attends densely through the kernel set's paged attention (every
block is kept), with one more group of all-zero queries for the index head, whose output is dropped; a longer one
attends here in torch, sequence by sequence, the kept positions' keys and values alone gathered from the cache
(`block_sparse_attention.attend_positions`). The choice is each sequence's own, so its bits do not depend on its
batch: a step of both kinds runs the kernel over all of them and replaces the long ones' rows.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig, Qwen4Exp
from engine_server.layers.attention import PagedSelfAttention
from engine_server.layers.block_sparse_attention import (
    attend_positions,
    attend_short_ones,
    cached_index_keys,
    write_with_index_keys,
)
from engine_server.layers.norm import RMSNorm
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import TensorParallel
from ladle_kernels.kernel_set import KernelOps

_CHUNK_BYTES = 1 << 26  # the most float32 bytes one chunk of a sequence's queries scores at once


class QsaIndexer(nn.Module):
    """One layer's indexer; parameters named as Qwen4-Exp's checkpoints name them (`self_attn.indexer.*`)."""

    def __init__(self, config: ModelConfig, spec: Qwen4Exp, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.head_dim, self.rotary_dim = spec.index_heads, spec.index_head_dim, config.rotary_dim
        self.index_qk_proj = nn.Linear(config.hidden_size, (spec.index_heads + 1) * spec.index_head_dim, bias=False,
                                       dtype=dtype)  # fmt: skip
        self.q_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, cos_sin_cache: torch.Tensor, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden `[T, hidden]` -> (index queries `[T, heads, head_dim]`, normed and turned; raw index keys
        `[T, head_dim]`)."""
        queries, keys = self.index_qk_proj(hidden).split([self.heads * self.head_dim, self.head_dim], dim=-1)
        queries = self.q_layernorm(queries.reshape(-1, self.heads, self.head_dim), ops)
        return self.turn(positions, queries, cos_sin_cache, ops), keys

    def turn(
        self, positions: torch.Tensor, rows: torch.Tensor, cos_sin_cache: torch.Tensor, ops: KernelOps
    ) -> torch.Tensor:
        """rows `[T, heads, head_dim]` turned by rope at `positions` over their first `rotary_dim` dims."""
        dim = self.rotary_dim
        turned, _ = ops.rotary_embedding(positions, rows[..., :dim].contiguous(), rows[..., :dim].contiguous(),
                                         cos_sin_cache)  # fmt: skip
        return torch.cat((turned, rows[..., dim:]), dim=-1)

    def block_keys(
        self, raw: torch.Tensor, ratio: int, cos_sin_cache: torch.Tensor, ops: KernelOps
    ) -> torch.Tensor:
        """The complete blocks' keys `[B, head_dim]` of a sequence's raw index keys `[L, head_dim]` (B = L // ratio):
        each block's mean, normed, turned at its first position."""
        count = raw.shape[0] // ratio
        pooled = raw[: count * ratio].float().view(count, ratio, raw.shape[-1]).mean(dim=1).to(raw.dtype)
        normed = self.k_layernorm(pooled.unsqueeze(1), ops)
        starts = torch.arange(count, device=raw.device) * ratio
        return self.turn(starts, normed, cos_sin_cache, ops).squeeze(1)


class QsaAttention(PagedSelfAttention):
    """A Qwen4-Exp indexed-attention layer: `PagedSelfAttention` (Qwen3.5's output gate, `1 + w` q/k norms, partial
    rope) over the positions its `indexer` keeps (module docstring). Under tensor parallelism a rank attends with its
    query heads over its KV heads, the indexer whole on every rank (every head reads the same positions), each
    rank's cache holding every token's raw index key."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, index: int) -> None:
        super().__init__(config, dtype, tp=tp, index=index)
        spec = config.qwen4_exp
        assert spec is not None and index in spec.qsa_layers
        self.spec = spec
        self.indexer = QsaIndexer(config, spec, dtype)
        self.group = self.num_heads // self.num_kv_heads  # query heads per KV head

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        """hidden `[T, hidden]` -> `[T, hidden]`; writes this step's K/V and raw index keys into `kv_cache` (`[2,
        blocks, block_size, kv_heads + 1, row]`) before attending. No LoRA adapters (refused at load)."""
        tokens = hidden.shape[0]
        q, k, v, gate = self.queries_keys_values(positions, self.qkv_proj(hidden), cos_sin_cache, ops)
        index_q, raw_keys = self.indexer(positions, hidden, cos_sin_cache, ops)
        write_with_index_keys(k, v, raw_keys, kv_cache, meta, ops)
        out, long = attend_short_ones(q, kv_cache, meta, ops, self.scale, self.group, self.spec.dense_positions)
        if any(long):
            self._attend_kept(out, q, index_q, kv_cache, meta, long, cos_sin_cache, ops)
        out = out.reshape(tokens, self.q_size)
        if gate is not None:
            out = ops.sigmoid_mul(out, gate.reshape(tokens, self.q_size))
        return self._project(out, ops, lora)

    def _attend_kept(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        index_q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        long: list[bool],
        cos_sin_cache: torch.Tensor,
        ops: KernelOps,
    ) -> None:
        """Into `out` `[T, heads, head_dim]`: the attention of each token of the `long` sequences over the positions
        its indexer keeps, sequence by sequence: the block keys from every raw index key of the sequence in the
        cache, the attention over the kept positions' keys and values alone. (A sequence's path is its own length's
        choice, whatever its batch: its bits are the same alone and batched.)"""
        cache_block, ratio = kv_cache.shape[2], self.spec.compress_ratio
        kept = self.spec.budget + ratio - 1
        start = 0
        for row, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            if not long[row]:
                start += query_len
                continue
            table = meta.block_tables[row, : -(-seq_len // cache_block)].long()
            raw = cached_index_keys(kv_cache, table, self.num_kv_heads, seq_len, self.spec.index_head_dim, q.dtype)
            blocks = self.indexer.block_keys(raw, ratio, cos_sin_cache, ops)
            per_query = 4 * (self.indexer.heads * max(1, blocks.shape[0]) + 2 * self.num_heads * kept * self.head_dim)
            step = max(1, _CHUNK_BYTES // per_query)
            for begin in range(0, query_len, step):
                end = min(begin + step, query_len)
                chunk = slice(start + begin, start + end)
                positions = torch.arange(seq_len - query_len + begin, seq_len - query_len + end, device=q.device)
                chosen = self._kept_positions(index_q[chunk], blocks, positions)
                out[chunk] = attend_positions(q[chunk], kv_cache, table, chosen.unsqueeze(0), self.group,
                                              self.num_heads, self.scale)  # fmt: skip
            start += query_len

    def _kept_positions(self, index_q: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`[Q, budget + compress_ratio - 1]`: the positions each of Q queries (index queries `[Q, heads, dim]` at
        `positions`) attends over, given its sequence's complete blocks' keys `[B, dim]`: its best complete blocks'
        positions, then those of its incomplete block up to its own; -1 in the rest.

        The best are `topk` of each query's row of scores cut to its complete blocks, as transformers takes them:
        the sum of relus ties often (at 0), and topk breaks ties by the row's length, so queries are taken together
        only with those of the same count of complete blocks."""
        ratio, topk = self.spec.compress_ratio, self.spec.block_topk
        scores = torch.matmul(index_q.float(), blocks.float().t())  # [Q, heads, B]
        scores = torch.relu(scores).sum(dim=1) / math.sqrt(self.spec.index_head_dim)
        complete = (positions + 1) // ratio  # each query's complete blocks
        picked = torch.full((len(positions), topk, ratio), -1, dtype=torch.int64, device=positions.device)
        offsets = torch.arange(ratio, device=positions.device)
        for count in torch.unique(complete).tolist():
            if count == 0:
                continue
            rows = (complete == count).nonzero().flatten()
            chosen = scores[rows, :count].contiguous().topk(min(topk, count), dim=-1).indices
            picked[rows, : chosen.shape[1]] = chosen[..., None] * ratio + offsets
        tail = (complete * ratio)[:, None] + torch.arange(ratio - 1, device=positions.device)
        tail = tail.masked_fill(tail > positions[:, None], -1)
        return torch.cat((picked.flatten(1), tail), dim=1)
