"""Kolibri-1.1's indexed attention (`config.KolibriIndex`; transformers' `Kolibri1_1Indexer` and the attention that
reads its choice).

An indexed layer has no rope. Its indexer has no weights: a query's score of a key is the mean over the first
`heads` query heads (those of key head 0) of `relu(q . k) / sqrt(head_dim)`, query and key rounded to NVFP4
(`nvfp4_round`) first. A pool layer picks each query's pool: every key where it sees at most `pool_size`, else the
`pool_size / compression` blocks of `compression` keys whose NVFP4-rounded mean key scores best (an incomplete block
scores 0, later ones are not seen). Each indexed layer keeps of its latest pool layer's pool the `topk` best keys
beside the first `sinks` and last `local` positions (every key where at most `topk + local + sinks` are visible);
ties go to the earlier key, as the reference kernels' radix selection breaks them. The heads then attend over the
kept keys, keys and values rounded to NVFP4.

A layer that reads an earlier indexed layer's K/V (`KolibriIndex.kv_sources`) has only queries (and their norm):
its cache is that layer's very tensor, whose step K/V that layer has written. The cache holds K/V as computed; the
rounding happens as they are read. Everything here runs in torch, sequence by sequence, over the sequence's whole
K/V (quadratic in its length: the reference's arithmetic, not a fast kernel).
"""

from __future__ import annotations

import torch

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.attention import PagedSelfAttention
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import TensorParallel
from ladle_kernels.kernel_set import KernelOps
from ladle_kernels.reference import fp8_kv_values, is_fp8_kv_cache

_E2M1_MAX = 6.0


def nvfp4_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to NVFP4 and back, in x's dtype: E2M1 values (magnitudes 0 to 6, steps 0.5, 1 and 2) with one E4M3
    scale per 16 consecutive values of the last dim (their largest magnitude over 6, within [2^-9, 448]), ties to
    even."""
    blocks = x.float().unflatten(-1, (-1, 16))
    scale = (blocks.abs().amax(-1, keepdim=True) / _E2M1_MAX).clamp(2**-9, 448).to(torch.float8_e4m3fn).float()
    scaled = blocks / scale
    magnitude = scaled.abs().clamp(max=_E2M1_MAX)
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return ((torch.round(magnitude / step) * step).copysign(scaled) * scale).flatten(-2).to(x.dtype)


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's `k` highest finite scores (`[rows, n]` -> bool), ties to the lowest indices; -inf never kept."""
    k = min(k, scores.shape[-1])
    kth = scores.topk(k, dim=-1).values[..., -1:]
    above = scores > kth
    tied = (scores == kth) & (kth > float("-inf"))
    rank = tied.cumsum(-1, dtype=torch.int32)
    return above | (tied & (rank <= k - above.sum(-1, keepdim=True)))


class KolibriIndexedAttention(PagedSelfAttention):
    """A Kolibri-1.1 indexed layer (module doc): `PagedSelfAttention`'s projections and q/k norms without rope, on a
    layer that reads another's K/V its queries alone. Not under tensor parallelism (its indexer reads the query
    heads of key head 0 on every rank; refused at load)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, index: int) -> None:
        super().__init__(config, dtype, tp=tp, rope=False, index=index)
        spec = config.kolibri_index
        assert spec is not None and index in spec.layers
        self.spec, self.index = spec, index
        self.pool_layer = spec.pool_layer(index)
        self.group = self.num_heads // self.num_kv_heads

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
        """hidden `[T, hidden]` -> `[T, hidden]`; a layer with K/V of its own writes the step's before attending.
        `lora`: the step's adapters on o_proj."""
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.shares_kv:
            q = qkv.view(tokens, self.num_heads, self.head_dim)
            q = self.q_norm(q, ops) if self.q_norm is not None else q
        else:
            q, k, v, _ = self.queries_keys_values(positions, qkv, cos_sin_cache, ops)
            ops.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        pools = meta.index_pools.setdefault(self.pool_layer, []) if self.index == self.pool_layer else None
        block, start = kv_cache.shape[2], 0
        for row, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            table = meta.block_tables[row, : -(-seq_len // block)].long()
            keys, values = (kv_cache[half, table].flatten(0, 1)[:seq_len] for half in (0, 1))  # [L, kv_heads, D]
            if is_fp8_kv_cache(kv_cache):
                keys, values = fp8_kv_values(keys, q.dtype), fp8_kv_values(values, q.dtype)
            queries = q[start : start + query_len]
            lengths = torch.arange(seq_len - query_len, seq_len, device=q.device) + 1  # keys each query sees
            if pools is not None:
                pools.append(self._pool(queries, keys, lengths))
            pool = meta.index_pools[self.pool_layer][row]
            kept = self._kept(queries, keys, lengths, pool)
            out[start : start + query_len] = self._attend(queries, nvfp4_round(keys), nvfp4_round(values), kept)
            start += query_len
        return self._project(out.reshape(tokens, self.q_size), ops, lora)

    def _scores(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """`[Q, K]`: the indexer's scores of keys `[K, D]` (rounded) for queries `[Q, heads, D]` (their first
        `heads` heads rounded), the heads' ReLUs summed in order, as transformers sums them."""
        routing = nvfp4_round(queries[:, : self.spec.heads]).float()
        scores = routing.new_zeros(queries.shape[0], keys.shape[0])
        for head in range(self.spec.heads):
            scores += (routing[:, head] @ keys.t()).relu()
        return scores * (self.head_dim**-0.5 / self.spec.heads)

    def _pool(self, queries: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor | None:
        """Each query's pool `[Q, L]` (bool) of a sequence's keys `[L, kv_heads, D]`; None where every query sees
        at most `pool_size` keys (its pool is every key it sees)."""
        size, compression = self.spec.pool_size, self.spec.compression
        if int(lengths.max()) <= size:
            return None
        length = keys.shape[0]
        count = length // compression
        blocks = keys[: count * compression, 0].float().unflatten(0, (count, compression))
        summaries = nvfp4_round(blocks.sum(1) / compression)
        scores = torch.nn.functional.pad(self._scores(queries, summaries), (0, 1))
        numbers = torch.arange(count + 1, device=scores.device)
        scores = torch.where(numbers < (lengths // compression)[:, None], scores, 0.0)
        scores = scores.masked_fill(numbers >= ((lengths + compression - 1) // compression)[:, None], float("-inf"))
        chosen = top_k_mask(scores, size // compression).repeat_interleave(compression, dim=-1)[:, :length]
        seen = torch.arange(length, device=scores.device) < lengths[:, None]
        return torch.where((lengths <= size)[:, None], seen, chosen & seen)

    def _kept(
        self, queries: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor, pool: torch.Tensor | None
    ) -> torch.Tensor:
        """Each query's kept keys `[Q, L]` (bool) of a sequence's keys `[L, kv_heads, D]`, from its `pool` (None:
        every key it sees)."""
        spec, length = self.spec, keys.shape[0]
        positions = torch.arange(length, device=keys.device)
        seen = positions < lengths[:, None]
        if int(lengths.max()) <= spec.budget:
            return seen
        scores = self._scores(queries, nvfp4_round(keys[:, 0]).float())
        sinks = positions < spec.sinks
        last = lengths[:, None] - spec.local
        local = (positions >= last) & seen
        candidates = (seen if pool is None else pool) & ~sinks & (positions < last)
        chosen = top_k_mask(scores.masked_fill(~candidates, float("-inf")), spec.topk)
        kept = (chosen | sinks | local) & seen
        return torch.where((lengths <= spec.budget)[:, None], seen, kept)

    def _attend(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor
    ) -> torch.Tensor:
        """queries `[Q, heads, D]` over keys and values `[L, kv_heads, D]`, each over its `kept` keys `[Q, L]`: the
        softmax in float32 (transformers' eager attention) -> `[Q, heads, D]`."""
        heads = torch.arange(self.num_heads, device=queries.device) // self.group
        keys, values = keys[:, heads].transpose(0, 1), values[:, heads].transpose(0, 1)  # [heads, L, D]
        scores = torch.matmul(queries.transpose(0, 1), keys.transpose(1, 2)) * self.scale  # [heads, Q, L]
        scores = scores.masked_fill(~kept, float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(queries.dtype)
        return torch.matmul(weights, values).transpose(0, 1)
