"""Self-attention layer over the paged KV cache: fused QKV projection, optional q/k norm, rope, output proj."""

from __future__ import annotations

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.norm import RMSNorm
from kernels.kernel_set import KernelOps


class PagedSelfAttention(nn.Module):
    """Grouped-query attention; `qkv_proj` rows are `cat(q_proj, k_proj, v_proj)` (weights and biases)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool = False) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_proj_bias, dtype=dtype)
        # Qwen3 normalises each head of q and k (over head_dim) before rope.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor:
        """hidden `[T, hidden]` -> `[T, hidden]`; writes this step's K/V into `kv_cache` before attending."""
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q, ops)
            k = self.k_norm(k, ops)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin_cache)
        ops.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        out = ops.paged_attention(q, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))
