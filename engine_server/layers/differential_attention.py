"""DiffLlama's differential attention (transformers' `DiffLlamaAttention`): Llama's attention whose output is
`(softmax(Q1 K1ᵀ) - λ softmax(Q2 K2ᵀ)) V` per pair of heads, normalised.

Every query head h attends as usual (scores `q . k / sqrt(head_dim)` over its KV head j, causal softmax in float32),
once over the values of the first half of the KV heads (KV head j's value is that of head `j mod half`) and once over
those of the second half (`half + j mod half`); side by side per head (`2 * head_dim` wide), the first half of the
query heads' minus λ times the second half's, RMS-normalised without a weight over those `2 * head_dim` values and
times `1 - λ_init`, then `o_proj`. λ = `exp(λq1 . λk1) - exp(λq2 . λk2) + λ_init`, λ_init = `0.8 - 0.6 exp(-0.3
layer)`.

K/V live in the paged cache as any layer's; the attention runs here in torch, sequence by sequence over its keys
(its queries in chunks whose scores stay under `_CHUNK_BYTES`), as the reference would. Not under tensor parallelism
(the head halves pair across ranks) nor with LoRA adapters (refused at load).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.attention import PagedSelfAttention
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import TensorParallel
from ladle_kernels.kernel_set import KernelOps
from ladle_kernels.reference import fp8_kv_values, is_fp8_kv_cache

_CHUNK_BYTES = 1 << 26  # the most float32 bytes one chunk of a sequence's queries scores at once


class DifferentialAttention(PagedSelfAttention):
    """One DiffLlama attention layer (module doc); its λ vectors named as checkpoints name them (`lambda_q1`,
    `lambda_k1`, `lambda_q2`, `lambda_k2`)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, index: int) -> None:
        super().__init__(config, dtype, tp=tp, index=index)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            self.register_parameter(name, nn.Parameter(torch.zeros(self.head_dim, dtype=dtype), requires_grad=False))
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * index)
        self.group = self.num_heads // self.num_kv_heads
        self.eps = config.rms_norm_eps

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
        """hidden `[T, hidden]` -> `[T, hidden]`; writes this step's K/V into `kv_cache` before attending."""
        tokens = hidden.shape[0]
        q, k, v, _ = self.queries_keys_values(positions, self.qkv_proj(hidden), cos_sin_cache, ops)
        ops.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        both = self._attend(q, kv_cache, meta)  # [T, heads, 2 * head_dim]
        first, second = both.chunk(2, dim=1)
        weight = self._lambda(q.dtype)
        out = F.rms_norm(first - weight * second, (2 * self.head_dim,), eps=self.eps) * (1 - self.lambda_init)
        return self._project(out.reshape(tokens, self.q_size), ops, lora)

    def _lambda(self, dtype: torch.dtype) -> torch.Tensor:
        """λ (a scalar tensor in `dtype`), each exp from a float32 sum as transformers computes it."""
        parts = []
        for q_name, k_name in (("lambda_q1", "lambda_k1"), ("lambda_q2", "lambda_k2")):
            product = self.get_parameter(q_name) * self.get_parameter(k_name)
            parts.append(torch.exp(torch.sum(product, dim=-1, dtype=torch.float32)).to(dtype))
        return parts[0] - parts[1] + self.lambda_init

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`[T, heads, 2 * head_dim]`: each head's attention over the first half's values, then over the second's."""
        out = q.new_empty(q.shape[0], self.num_heads, 2 * self.head_dim)
        block, half = kv_cache.shape[2], self.num_kv_heads // 2
        kv_of = torch.arange(self.num_heads, device=q.device) // self.group
        first_values = kv_of % half
        second_values = half + kv_of % half
        start = 0
        for row, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            table = meta.block_tables[row, : -(-seq_len // block)].long()
            keys, values = (kv_cache[part, table].flatten(0, 1)[:seq_len] for part in (0, 1))  # [L, kv_heads, D]
            if is_fp8_kv_cache(kv_cache):
                keys, values = fp8_kv_values(keys, q.dtype), fp8_kv_values(values, q.dtype)
            keys = keys[:, kv_of].transpose(0, 1)  # [heads, L, D]
            both = torch.cat((values[:, first_values], values[:, second_values]), dim=-1).transpose(0, 1)
            step = max(1, _CHUNK_BYTES // (4 * self.num_heads * seq_len))
            for begin in range(0, query_len, step):
                end = min(begin + step, query_len)
                queries = q[start + begin : start + end].transpose(0, 1)  # [heads, Q, D]
                scores = torch.matmul(queries, keys.transpose(1, 2)) * self.scale
                positions = torch.arange(seq_len - query_len + begin, seq_len - query_len + end, device=q.device)
                future = torch.arange(seq_len, device=q.device)[None, :] > positions[:, None]
                weights = torch.softmax(scores.float().masked_fill(future, float("-inf")), dim=-1).to(q.dtype)
                out[start + begin : start + end] = torch.matmul(weights, both).transpose(0, 1)
            start += query_len
        return out
