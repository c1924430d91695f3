"""ALiBi (BLOOM's, MPT's, Falcon-RW's): attention without rope whose every score gets a linear bias by distance,
`slope_h * (j - p)` for the query at position p and the key at j (head h's slope; transformers adds `slope_h * j`,
the same softmax). Falcon-RW's bias is its modeling code's: `slope_h * j` in bfloat16 (the slope rounded to it too),
then scaled with the scores.

The attention runs here in torch over the paged cache, sequence by sequence (no kernel of the kernel sets takes a
bias yet): each sequence's keys and values gathered from its blocks, the scores in the model's dtype, the bias and
the softmax in float32 (as transformers' BLOOM computes them). A CUDA graph cannot record it (`model_loading`).
"""

from __future__ import annotations

import math

import torch

from engine_server.attention_metadata import AttentionMetadata
from ladle_kernels.reference import fp8_kv_values, is_fp8_kv_cache


def bloom_slopes(heads: int) -> torch.Tensor:
    """Each of `heads` heads' slope, float32, as transformers' `_get_alibi_slopes` (BLOOM's) gives them: the powers
    of `2^(-8 / n)` for the largest power of two n <= heads, then every other power of `2^(-4 / n)` for the rest."""
    closest = 2 ** math.floor(math.log2(heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != heads:
        extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        remaining = min(closest, heads - closest)
        slopes = torch.cat([slopes, torch.pow(extra, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32))])
    return slopes


def mpt_slopes(heads: int, bias_max: float) -> torch.Tensor:
    """Each of `heads` heads' slope, float32, as MPT builds them (transformers' `build_mpt_alibi_tensor`):
    `2^(-i * bias_max / n)` for i = 1..n, n the smallest power of two >= heads; for other head counts the odd
    i's slopes first, then the even i's, the first `heads` of them."""
    closest = 2 ** math.ceil(math.log2(heads))
    exponents = torch.arange(1, closest + 1, dtype=torch.int64).float() * (bias_max / closest)
    slopes = 1.0 / torch.pow(2, exponents)
    if closest != heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:heads]
    return slopes


def alibi_slopes(kind: str, heads: int, bias_max: float) -> torch.Tensor:
    """The slopes of a model's `heads` heads, float32 (`ModelConfig.alibi`: "mpt" from `bias_max`; "bloom" and
    "falcon" BLOOM's, which `alibi_attention` rounds to bfloat16 for Falcon)."""
    return mpt_slopes(heads, bias_max) if kind == "mpt" else bloom_slopes(heads)


def alibi_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    slopes: torch.Tensor,
    falcon: bool = False,
) -> torch.Tensor:
    """Causal attention of q `[T, H, D]` over the paged cache `[2, blocks, block_size, Hkv, row]` (this step's K/V
    written already), each score `scale * q . k + slopes[h] * (j - p)` (`slopes` `[H]` float32): `[T, H, D]`.
    `falcon`: each score `scale * (q . k + bf16(slopes[h] * j))` instead (Falcon-RW's bias: slopes bfloat16)."""
    out = torch.empty_like(q)
    block, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // kv_heads
    start = 0
    for row, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        rows = kv_cache[:, meta.block_tables[row, : -(-seq_len // block)].long()]
        if is_fp8_kv_cache(kv_cache):
            rows = fp8_kv_values(rows, q.dtype)
        rows = rows.reshape(2, -1, kv_heads, rows.shape[-1])[:, :seq_len]
        keys = rows[0].transpose(0, 1).repeat_interleave(group, dim=0)  # [H, S, D]
        values = rows[1].transpose(0, 1).repeat_interleave(group, dim=0)
        queries = q[start : start + query_len].transpose(0, 1)  # [H, Q, D]
        keys_at = torch.arange(seq_len, device=q.device)
        queries_at = keys_at[seq_len - query_len :]
        distance = (keys_at[None, :] - queries_at[:, None]).float()  # [Q, S]
        scores = torch.matmul(queries, keys.transpose(1, 2)) * scale
        if falcon:  # the product in bfloat16, as its modeling code computes it, then scaled with the scores
            bias = (slopes.bfloat16()[:, None] * keys_at[None, :]).float()[:, None, :] * scale
        else:
            bias = slopes[:, None, None] * distance
        scores = scores.float() + bias
        scores = scores.masked_fill(distance > 0, float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(q.dtype)
        out[start : start + query_len] = torch.matmul(weights, values).transpose(0, 1)
        start += query_len
    return out
