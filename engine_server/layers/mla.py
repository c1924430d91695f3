"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Mistral 4), run as plain multi-head attention over the
paged KV cache.

The queries come from a low-rank projection (`q_a_proj`, its norm, `q_b_proj`; or one `q_proj`); the keys and
values from one compressed latent per token (`kv_a_proj_with_mqa`: `kv_lora_rank` latent dims and one rope key of
`qk_rope_head_dim` shared by every head), normalised and expanded per head by `kv_b_proj` into a key part without
positions (`qk_nope_head_dim`) and a value (`v_head_dim`). Each head's key is its nope part beside the shared rope
key; only the rope dims turn by position.

This module expands every token's latent into per-head keys and values and caches those: the cache's head dim is
the key's (`qk_nope_head_dim + qk_rope_head_dim`) and each value is stored zero-padded to it, so the attention
kernels (and their sinks, windows, FP8 rows) are the ones every other family uses. That costs the memory a latent
cache would save; keeping the latent (and absorbing `kv_b_proj` into the query and the output) is a later step.
Within a head the rope dims lead (`cat(rope, nope)` for both the query and the key: the same order on both sides
leaves their product unchanged), so the shared partial rotary turns them; DeepSeek-V3's interleaved rope pairs
(`rope_interleave`) are first laid out as halves, which is what transformers' interleaved rotation computes.
Tensor parallelism is refused: the heads are not split yet.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.norm import RMSNorm
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import SINGLE, TensorParallel
from kernels.kernel_set import KernelOps


class MultiLatentAttention(nn.Module):
    """One layer's latent attention (module doc); parameters named as DeepSeek's checkpoints name them."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError("multi-head latent attention is not sharded yet: use tensor_parallel_size 1")
        self.tp = tp
        mla = config.latent_attention
        assert mla is not None
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim, self.value_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.head_dim = self.nope_dim + self.rope_dim  # the cache's, and the key's
        self.kv_lora_rank = mla.kv_lora_rank
        self.interleaved = mla.rope_interleave
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.query_scale_beta, self.query_scale_positions = config.query_scale_beta, config.query_scale_positions
        hidden, heads, bias = config.hidden_size, self.num_heads, config.attention_bias
        if mla.q_lora_rank:
            self.q_a_proj: nn.Module | None = nn.Linear(hidden, mla.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm: RMSNorm | None = RMSNorm(mla.q_lora_rank, config.rms_norm_eps, dtype)
            self.q_b_proj: nn.Module = nn.Linear(mla.q_lora_rank, heads * self.head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = self.q_a_layernorm = None
            self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps, dtype)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.nope_dim + self.value_dim), bias=False, dtype=dtype)
        self.o_proj = nn.Linear(heads * self.value_dim, hidden, bias=bias, dtype=dtype)

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
        """hidden `[T, hidden]` -> `[T, hidden]`; writes this step's keys and (padded) values into `kv_cache`
        before attending. `lora` must be None: adapters are not applied to latent attention."""
        if lora is not None:
            raise ValueError("LoRA adapters are not applied to multi-head latent attention")
        tokens, heads = hidden.shape[0], self.num_heads
        if self.q_a_proj is not None and self.q_a_layernorm is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden), ops))
        else:
            q = self.q_proj(hidden)
        q_nope, q_rope = q.view(tokens, heads, self.head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent, ops)).view(tokens, heads, self.nope_dim + self.value_dim)
        k_nope, v = kv.split([self.nope_dim, self.value_dim], dim=-1)
        q_rope, k_rope = self._halves(q_rope), self._halves(k_rope.reshape(tokens, 1, self.rope_dim))
        q_rope, k_rope = ops.rotary_embedding(positions, q_rope.contiguous(), k_rope.contiguous(), cos_sin_cache)
        q = torch.cat((q_rope, q_nope), dim=-1)
        if self.query_scale_beta:  # Mistral 4: Llama 4's temperature, by position (`ModelConfig.query_scale_beta`)
            steps = torch.floor(positions.to(torch.float32) / self.query_scale_positions)
            q = q * (1 + self.query_scale_beta * torch.log(1 + steps)).to(q.dtype)[:, None, None]
        k = torch.cat((k_rope.expand(tokens, heads, self.rope_dim), k_nope), dim=-1)
        v = torch.nn.functional.pad(v, (0, self.head_dim - self.value_dim))
        ops.write_kv_cache(k, v.contiguous(), kv_cache, meta.slot_mapping)
        out = ops.paged_attention(q, kv_cache, meta, self.scale, 0, 0.0, None)
        return self.o_proj(out[..., : self.value_dim].reshape(tokens, heads * self.value_dim))

    def _halves(self, x: torch.Tensor) -> torch.Tensor:
        """Rope dims in interleaved pairs `(x0, x1), (x2, x3), ...` laid out as halves `(x0, x2, ..., x1, x3, ...)`,
        as the shared rotary reads them (`rope_interleave`); as they are otherwise."""
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.interleaved else x
