"""MiniMax-M3's block-sparse attention: grouped-query attention whose queries each attend over the blocks of earlier
keys a lightning indexer keeps (`config.BlockSparse`).

The indexer has `index_heads` query heads and one key head, `index_head_dim` wide (`q_proj`, `k_proj`, each head
RMS-normalised, then turned by rope as the attention's heads are). Query t's score of key j <= t is their dot
product in float32; each block of `block_size` positions scores its best key's, the `local_blocks` blocks ending at
t's own score +inf, and the `topk_blocks` best blocks are kept: the keys of those up to t's position are what t's
query heads of that index head attend over (index head i serves heads `[i * g, (i + 1) * g)`, g =
`num_attention_heads / index_heads`). This is transformers' `MiniMaxM3VLIndexer` with its block mask, computed the
same way.

Each token's index key is one more head of the layer's cache rows, after its KV heads, in the key half (zero-padded
to `head_dim`; the value half's row is zeros), so prefix caching, preemption and swapping keep it as they keep K/V.
A sequence at most `BlockSparse.dense_positions` long attends densely through the kernel set's paged attention (the
indexer would keep every block), with one more group of all-zero queries for the index head, whose output is
dropped; a longer one attends here in torch, sequence by sequence (each sequence's own choice, so its bits do not
depend on its batch: a step of both kinds runs the kernel over all and replaces the long ones' rows), its queries
in chunks whose scores stay under `_CHUNK_BYTES`: the index scores read every index key, the attention gathers the
kept positions' keys and values alone from the cache (at most `topk_blocks * block_size` a head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import BlockSparse, ModelConfig
from engine_server.layers.attention import PagedSelfAttention
from engine_server.layers.norm import RMSNorm
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import TensorParallel
from engine_server.parallel.layers import ColumnParallelLinear
from engine_server.parallel.sharding import PartSlice, heads_per_rank, query_heads_of_rank
from ladle_kernels.kernel_set import KernelOps
from ladle_kernels.reference import fp8_kv_values, is_fp8_kv_cache

_CHUNK_BYTES = 1 << 26  # the most float32 bytes one chunk of a sequence's queries scores at once


class BlockIndexer(nn.Module):
    """One layer's indexer; parameters named as MiniMax-M3's checkpoints name them (`self_attn.indexer.*`). Under
    tensor parallelism a rank holds the query heads of its share of the index heads (those its query heads read)
    and the whole key projection."""

    def __init__(self, config: ModelConfig, spec: BlockSparse, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.heads = heads_per_rank(spec.index_heads, tp.size)
        self.head_dim, self.rotary_dim = spec.index_head_dim, config.rotary_dim
        kept = query_heads_of_rank(spec.index_heads, tp.size, tp.rank)
        rows = PartSlice(spec.index_heads * self.head_dim, range(kept.start * self.head_dim, kept.stop * self.head_dim))
        self.q_proj: nn.Module = ColumnParallelLinear(config.hidden_size, [rows], False, dtype)
        self.k_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, cos_sin_cache: torch.Tensor, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden `[T, hidden]` -> (index queries `[T, heads, head_dim]`, index keys `[T, head_dim]`), normed and
        turned by their positions over their first `rotary_dim` dims."""
        queries = self.q_norm(self.q_proj(hidden).view(-1, self.heads, self.head_dim), ops)
        keys = self.k_norm(self.k_proj(hidden).view(-1, 1, self.head_dim), ops)
        dim = self.rotary_dim
        turned_q, turned_k = ops.rotary_embedding(
            positions, queries[..., :dim].contiguous(), keys[..., :dim].contiguous(), cos_sin_cache
        )
        queries = torch.cat((turned_q, queries[..., dim:]), dim=-1)
        keys = torch.cat((turned_k, keys[..., dim:]), dim=-1)
        return queries, keys.view(-1, self.head_dim)


class BlockSparseAttention(PagedSelfAttention):
    """A MiniMax-M3 sparse layer: `PagedSelfAttention` (Gemma's q/k norms, partial rope) over the blocks its
    `indexer` keeps (module docstring). Under tensor parallelism a rank attends with its query heads over its KV
    heads, their blocks chosen by its index heads, each rank's cache holding every token's index key."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, index: int) -> None:
        super().__init__(config, dtype, tp=tp, index=index)
        spec = config.block_sparse
        assert spec is not None and index in spec.layers
        self.spec = spec
        self.indexer = BlockIndexer(config, spec, dtype, tp)
        self.group = self.num_heads // self.num_kv_heads  # query heads per KV head
        self.index_group = self.num_heads // self.indexer.heads  # query heads per index head

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
        """hidden `[T, hidden]` -> `[T, hidden]`; writes this step's K/V and index keys into `kv_cache` (`[2, blocks,
        block_size, kv_heads + 1, row]`) before attending. No LoRA adapters (refused at load)."""
        tokens = hidden.shape[0]
        q, k, v, _ = self.queries_keys_values(positions, self.qkv_proj(hidden), cos_sin_cache, ops)
        index_q, index_k = self.indexer(positions, hidden, cos_sin_cache, ops)
        write_with_index_keys(k, v, index_k, kv_cache, meta, ops)
        out, long = attend_short_ones(q, kv_cache, meta, ops, self.scale, self.group, self.spec.dense_positions)
        if any(long):
            self._attend_blocks(out, q, index_q, kv_cache, meta, long)
        return self._project(out.reshape(tokens, self.q_size), ops, lora)

    def _attend_blocks(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        index_q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        long: list[bool],
    ) -> None:
        """Into `out` `[T, heads, head_dim]`: the attention of each token of the `long` sequences over the blocks its
        indexer keeps, sequence by sequence: the index scores read every index key of the sequence from the cache,
        the attention only the keys and values of the kept positions (at most `topk_blocks * block_size` a head).
        (A sequence's path is its own length's choice, whatever its batch: its bits are the same alone and
        batched.)"""
        cache_block = kv_cache.shape[2]
        start = 0
        for row, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            if not long[row]:
                start += query_len
                continue
            kept_keys = min(self.spec.topk_blocks, 1 + (seq_len - 1) // self.spec.block_size) * self.spec.block_size
            table = meta.block_tables[row, : -(-seq_len // cache_block)].long()
            index_keys = cached_index_keys(kv_cache, table, self.num_kv_heads, seq_len, self.spec.index_head_dim,
                                           q.dtype)  # fmt: skip
            per_query = 4 * (self.indexer.heads * seq_len + 2 * self.num_heads * kept_keys * self.head_dim)
            step = max(1, _CHUNK_BYTES // per_query)
            for begin in range(0, query_len, step):
                end = min(begin + step, query_len)
                chunk = slice(start + begin, start + end)
                positions = torch.arange(seq_len - query_len + begin, seq_len - query_len + end, device=q.device)
                kept = self._kept_positions(index_q[chunk], index_keys, positions)
                out[chunk] = self._attend(q[chunk], kv_cache, table, kept)
            start += query_len

    def _kept_positions(
        self, index_q: torch.Tensor, index_keys: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """`[index_heads, Q, k * block_size]`: the positions each of Q queries (index queries `[Q, index_heads, dim]`
        at `positions`) attends over, of a sequence of L index keys `[L, dim]`, block by chosen block as
        transformers' indexer chooses them (k of them, at most `topk_blocks`); -1 where a block is not kept or a
        position is past the query's own."""
        size, length = self.spec.block_size, index_keys.shape[0]
        scores = torch.matmul(index_q.transpose(0, 1).float(), index_keys.float().transpose(0, 1))
        future = torch.arange(length, device=scores.device)[None, None, :] > positions[None, :, None]
        scores = scores.masked_fill(future, float("-inf"))
        count = -(-length // size)
        scores = F.pad(scores, (0, count * size - length), value=float("-inf"))
        block_scores = scores.view(*scores.shape[:2], count, size).amax(dim=-1)  # [index_heads, Q, blocks]
        own = positions // size
        for back in range(self.spec.local_blocks):  # the local blocks always win
            local = (own - back).clamp(min=0)[None, :, None].expand(block_scores.shape[0], -1, 1)
            block_scores.scatter_(-1, local, float("inf"))
        best, chosen = block_scores.topk(min(self.spec.topk_blocks, count), dim=-1)
        kept = chosen[..., None] * size + torch.arange(size, device=chosen.device)  # [index_heads, Q, k, size]
        # a block past every key is kept nowhere; nor is a position past the query's own
        valid = (best != float("-inf"))[..., None] & (kept <= positions[None, :, None, None])
        return kept.masked_fill(~valid, -1).flatten(-2)

    def _attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor, kept: torch.Tensor
    ) -> torch.Tensor:
        """q `[Q, heads, D]` over its sequence's positions each index head keeps (`kept`, `[index_heads, Q, S]`):
        `attend_positions`."""
        return attend_positions(q, kv_cache, table, kept, self.group, self.index_group, self.scale)


def write_with_index_keys(
    k: torch.Tensor, v: torch.Tensor, index_keys: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
    ops: KernelOps,
) -> None:
    """Write the step's K/V `[T, kv_heads, D]` and each token's index key `[T, index_dim]` (one more head of the
    key half, zero-padded to D; zeros in the value half) into `kv_cache`."""
    row = F.pad(index_keys, (0, k.shape[-1] - index_keys.shape[-1])).to(k.dtype).unsqueeze(1)
    ops.write_kv_cache(torch.cat((k, row), dim=1), torch.cat((v, torch.zeros_like(row)), dim=1), kv_cache,
                       meta.slot_mapping)  # fmt: skip


def cached_index_keys(
    kv_cache: torch.Tensor, table: torch.Tensor, index_head: int, length: int, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """A sequence's index keys `[length, dim]` in `dtype` (FP8 rows decoded), read from the key half's head
    `index_head` of its blocks `table` of `kv_cache` (`write_with_index_keys`' rows)."""
    rows = kv_cache[0, table, :, index_head]  # [blocks, block_size, row]
    if is_fp8_kv_cache(kv_cache):
        rows = fp8_kv_values(rows, dtype)
    return rows.reshape(-1, rows.shape[-1])[:length, :dim]


def attend_short_ones(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, ops: KernelOps, scale: float, group: int,
    dense_positions: int,
) -> tuple[torch.Tensor, list[bool]]:
    """(out `[T, heads, D]`, which sequences are longer than `dense_positions`): the kernels' attention over every
    key for the step's short sequences (one more group of zero queries for the index head, its output dropped), the
    long ones' rows left for their own path to fill. Each sequence's path is its own length's choice, so its bits do
    not depend on its batch: a step of both kinds runs the kernel over all and the long ones' rows are replaced."""
    long = [seq_len > dense_positions for seq_len in meta.seq_lens_cpu]
    if all(long):
        return torch.empty_like(q), long
    tokens, heads, head_dim = q.shape
    padded = torch.cat((q, q.new_zeros(tokens, group, head_dim)), dim=1)
    return ops.paged_attention(padded, kv_cache, meta, scale, 0, 0.0, None)[:, :heads], long


def attend_positions(
    q: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor, kept: torch.Tensor, group: int, index_group: int,
    scale: float,
) -> torch.Tensor:
    """q `[Q, heads, D]` over its sequence's keys and values (its block `table` of `kv_cache`), each head over the
    positions its index head keeps (`kept`, `[index_heads, Q, S]`, -1 for none; head h reads index head
    `h // index_group` and KV head `h // group`), those rows alone gathered: `[Q, heads, D]`, the softmax in float32
    (transformers' eager attention)."""
    heads = torch.arange(q.shape[1], device=q.device)
    positions = kept.index_select(0, heads // index_group)  # [heads, Q, S]
    picked = positions.clamp(min=0)
    block = kv_cache.shape[2]
    slots = table[picked // block] * block + picked % block
    kv_heads = (heads // group)[:, None, None].expand_as(slots)
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    chosen_keys, chosen_values = flat[0, slots, kv_heads], flat[1, slots, kv_heads]  # [heads, Q, S, row]
    if is_fp8_kv_cache(kv_cache):
        chosen_keys, chosen_values = fp8_kv_values(chosen_keys, q.dtype), fp8_kv_values(chosen_values, q.dtype)
    scores = torch.matmul(q.transpose(0, 1).unsqueeze(2), chosen_keys.transpose(-1, -2)).squeeze(2) * scale
    scores = scores.masked_fill(positions < 0, float("-inf"))  # [heads, Q, S]
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(weights.unsqueeze(2), chosen_values).squeeze(2).transpose(0, 1)
