"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer picks, for each query, the `topk` earlier
positions (its own included) that latent attention (`layers.mla`) attends over.

Each token has one index key, `head_dim` wide (`wk`, a LayerNorm with a bias, rope over its first
`qk_rope_head_dim` dims, HY-V4's over its last); each query `heads` index queries (`wq_b` over the attention's
normalised low-rank query) and a weight per index head (`weights_proj`). Position j's score for query t is
`sum_h w[t, h] * relu(q[t, h] . k[j] / sqrt(head_dim)) / sqrt(heads)`, in float32 as transformers computes it; the
`topk` best of the positions up to t's own are attended, all of them while there are no more than `topk`.

The index keys live in the layer's paged cache beside the latents, so prefix caching, preemption and the cache's
size all hold them as they hold K/V: each row of the key half is `cat(latent, rope key)` and each row of the value
half `cat(latent, index key)` (attention reads only the latent of a value), both zero-padded to the cache's row,
the longer of the two (`ModelConfig.head_dim`). A step whose every sequence is at most `topk` long attends
densely, through the paged kernels every family uses (what the indexer would pick is every position); otherwise
the whole step attends here over the chosen rows gathered from the cache (torch: decode rows of many sequences in
one batch, a sequence's prefill chunk in one, each group's scores and gathered rows under `_CHUNK_BYTES`). A layer
without an indexer of its own (GLM-5's "shared" ones) attends over the positions the last one before it chose, kept
on the step's metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.norm import BiasedLayerNorm
from ladle_kernels.kernel_set import KernelOps
from ladle_kernels.reference import fp8_kv_values, is_fp8_kv_cache

_CHUNK_BYTES = 1 << 26  # the most float32 bytes one group of rows scores or gathers at once (`_row_groups`)


class LightningIndexer(nn.Module):
    """One layer's indexer; parameters named as DeepSeek-V3.2's and GLM-5's checkpoints name them
    (`self_attn.indexer.*`)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        spec, mla = config.sparse_indexer, config.latent_attention
        assert spec is not None and mla is not None
        if not mla.q_lora_rank:
            raise ValueError("a sparse-attention indexer reads the low-rank query: q_lora_rank must be set")
        self.heads, self.head_dim, self.rope_dim = spec.heads, spec.head_dim, mla.qk_rope_head_dim
        self.interleaved, self.rope_last = spec.rope_interleave, spec.rope_last
        self.wq_b = nn.Linear(mla.q_lora_rank, self.heads * self.head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.k_norm = BiasedLayerNorm(self.head_dim, spec.key_norm_eps, dtype)
        self.weights_proj = nn.Linear(config.hidden_size, self.heads, bias=False, dtype=dtype)

    def keys(
        self, positions: torch.Tensor, hidden: torch.Tensor, cos_sin_cache: torch.Tensor, ops: KernelOps
    ) -> torch.Tensor:
        """hidden `[T, hidden]` -> each token's index key `[T, head_dim]`, turned by its position."""
        keys = self.k_norm(self.wk(hidden), ops).view(-1, 1, self.head_dim)
        return self._turned(positions, keys, cos_sin_cache, ops).view(-1, self.head_dim)

    def queries(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        q_resid: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        ops: KernelOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(index queries `[T, heads, head_dim]` turned by position, weights `[T, heads]` float32 with the
        1/sqrt(heads) folded in) from hidden `[T, hidden]` and the attention's normalised low-rank query."""
        queries = self.wq_b(q_resid).view(-1, self.heads, self.head_dim)
        weights = self.weights_proj(hidden).float() * self.heads**-0.5
        return self._turned(positions, queries, cos_sin_cache, ops), weights

    def _turned(
        self, positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, ops: KernelOps
    ) -> torch.Tensor:
        """x `[T, H, head_dim]` with rope on its first `rope_dim` dims, or its last (`rope_last`, HY-V4's; GLM-5's
        interleaved pairs laid out as halves first, as transformers' interleaved rotation leaves them: scores are dot
        products, the same either way)."""
        kept_dims = self.head_dim - self.rope_dim
        if self.rope_last:
            kept, turned = x.split([kept_dims, self.rope_dim], dim=-1)
        else:
            turned, kept = x.split([self.rope_dim, kept_dims], dim=-1)
        if self.interleaved:
            turned = torch.cat((turned[..., 0::2], turned[..., 1::2]), dim=-1)
        turned, _ = ops.rotary_embedding(positions, turned.contiguous(), turned[:, :1].contiguous(), cos_sin_cache)
        return torch.cat((kept, turned) if self.rope_last else (turned, kept), dim=-1)


def select_positions(
    queries: torch.Tensor,
    weights: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    key_offset: int,
    topk: int,
) -> torch.Tensor:
    """The positions each of the step's tokens attends over, `[T, topk]` int64, -1 past the positions it has: the
    `topk` best by the indexer's score (module doc) among positions up to its own (`positions`), whose index keys are
    the value half's dims `[key_offset, key_offset + head_dim)` (this step's already written)."""
    tokens, heads, dim = queries.shape
    chosen = torch.full((tokens, topk), -1, dtype=torch.int64, device=queries.device)
    for rows, slots in _row_groups(meta, 4 * (heads + dim)):
        keys = _rows(kv_cache[1], slots.flatten(), key_offset, dim).view(*slots.shape, dim)  # [G, W, D]
        scores = torch.relu(torch.matmul(queries[rows].float(), keys.transpose(1, 2)) * dim**-0.5)  # [R, H, W]
        index = torch.matmul(weights[rows].unsqueeze(1), scores).squeeze(1)  # [R, W]
        later = torch.arange(slots.shape[1], device=index.device)[None, :] > positions[rows, None]
        best, picked = index.masked_fill(later, float("-inf")).topk(min(topk, slots.shape[1]), dim=-1)
        chosen[rows, : picked.shape[1]] = picked.masked_fill(best == float("-inf"), -1)
    return chosen


def attend_positions(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, chosen: torch.Tensor, scale: float, width: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Latent attention of q `[T, H, K]` over the key half's rows (their first K dims) at each token's `chosen`
    positions (`select_positions`), weighting the value half's first `width` dims: `[T, H, width]`. With `sinks`
    (`[H]` float32, HY-V4's) each head's softmax has one more logit, its sink, which weights no value."""
    tokens, heads, dim = q.shape
    out = q.new_empty(tokens, heads, width)
    for rows, slots in _row_groups(meta, 4 * (dim + width), chosen.shape[1]):
        picked = chosen[rows]  # [R, k]
        where = torch.gather(slots.expand(len(rows), -1), 1, picked.clamp(min=0)).flatten()
        keys = _rows(kv_cache[0], where, 0, dim).view(*picked.shape, dim).to(q.dtype)
        values = _rows(kv_cache[1], where, 0, width).view(*picked.shape, width).to(q.dtype)
        scores = torch.bmm(q[rows], keys.transpose(1, 2)) * scale  # [R, H, k]
        scores = scores.masked_fill((picked < 0)[:, None, :], float("-inf"))
        if sinks is None:
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
        else:
            sink = sinks.to(scores.dtype)[None, :, None].expand(len(rows), -1, 1)
            weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        out[rows] = torch.bmm(weights.to(q.dtype), values)
    return out


def _row_groups(
    meta: AttentionMetadata, position_bytes: int, positions: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's token rows in groups of at most `_CHUNK_BYTES` of work, a row's being `position_bytes` for each of
    `positions` (0: of its group's W): (rows `[R]` int64, slots `[G, W]`), the flat cache slots of positions
    `[0, W)` of each row's sequence, W its group's longest. Decode rows (one new token each) are grouped across
    sequences, G == R; a sequence's several new tokens (a prefill chunk, a draft's verification) share its slots,
    G == 1. Slots past a sequence's length are its table's padding: callers mask what lies past each row's
    position. Built once per step and cost, for every layer (`AttentionMetadata.sparse_groups`)."""
    key = (position_bytes, positions)
    if key not in meta.sparse_groups:
        meta.sparse_groups[key] = list(_grouped(meta, lambda width: position_bytes * (positions or width)))
    return meta.sparse_groups[key]


def _grouped(meta: AttentionMetadata, row_bytes: Callable[[int], int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`_row_groups`' groups, one row's work `row_bytes(W)` for W positions."""
    device = meta.block_tables.device
    first = 0
    decode: list[tuple[int, int]] = []  # (sequence, its row) of the one-token sequences
    for seq, (count, length) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        if count == 1:
            decode.append((seq, first))
        else:
            rows = max(1, _CHUNK_BYTES // row_bytes(length))
            for start in range(first, first + count, rows):
                stop = min(start + rows, first + count)
                yield torch.arange(start, stop, device=device), _slots(meta, [seq], length)
        first += count
    group: list[tuple[int, int]] = []
    widest = 0
    for seq, row in decode:
        length = meta.seq_lens_cpu[seq]
        if group and (len(group) + 1) * row_bytes(max(widest, length)) > _CHUNK_BYTES:
            yield _decode_group(meta, group, widest)
            group, widest = [], 0
        group.append((seq, row))
        widest = max(widest, length)
    if group:
        yield _decode_group(meta, group, widest)


def _decode_group(
    meta: AttentionMetadata, group: list[tuple[int, int]], width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_row_groups`' group of decode rows, `group` their (sequence, row) pairs: (rows, slots `[len(group), width]`)."""
    rows = torch.tensor([row for _, row in group], dtype=torch.int64, device=meta.block_tables.device)
    return rows, _slots(meta, [seq for seq, _ in group], width)


def _slots(meta: AttentionMetadata, sequences: list[int], width: int) -> torch.Tensor:
    """The flat cache slots of positions `[0, width)` of each of `sequences`, `[len(sequences), width]` int64 (a
    shorter sequence's past its length are its table's padding)."""
    index = torch.tensor(sequences, dtype=torch.int64, device=meta.block_tables.device)
    blocks = meta.block_tables.index_select(0, index)[:, : -(-width // meta.block_size)].to(torch.int64)
    offsets = torch.arange(meta.block_size, device=blocks.device)
    return (blocks[:, :, None] * meta.block_size + offsets).flatten(1)[:, :width]


def _rows(half: torch.Tensor, slots: torch.Tensor, offset: int, dim: int) -> torch.Tensor:
    """Dims `[offset, offset + dim)` of one cache half's rows at `slots` (`[blocks, block_size, 1, row]`), float32
    (an FP8 cache's rows decoded whole first: their scale is the row's)."""
    flat = half.view(-1, half.shape[-1])
    if is_fp8_kv_cache(half):
        return fp8_kv_values(flat.index_select(0, slots))[:, offset : offset + dim]
    return flat[:, offset : offset + dim].index_select(0, slots).float()
