"""JetMoE's mixture of attention: each token's queries and output projection come from the `top_k` of `experts`
attention experts its router picks, over one shared key-value projection.

The router (`router`, softmax over its `top_k` best logits, in float32) picks experts for a token; each chosen expert
e projects the token to one query per KV head (`q_experts[e]`, `kv_heads * head_dim` rows), so a token has `top_k *
kv_heads` query heads (the chosen experts' in turn, each over every KV head), turned by rope with the keys; `kv_proj`
gives the keys and values. Each expert's attention output goes through its own `o_experts[e]` and the token's output
is the sum of those weighted by the router's weights, plus `o_bias`. The experts' projections are plain linear layers
(one per expert: quantized like any other); a step runs each expert over the tokens that chose it, adding the experts'
shares in expert order (so a token's sum does not depend on its batch).
"""

from __future__ import annotations

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.lora.slots import LayerLora
from ladle_kernels.kernel_set import KernelOps


class MixtureOfAttention(nn.Module):
    """One JetMoE attention layer (module doc); same call as `PagedSelfAttention`. Its checkpoint's banks
    (`experts.input_linear`, `experts.output_linear`) are split into `q_experts` / `o_experts` at load
    (`models.jetmoe`)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.kv_heads, self.head_dim = config.num_key_value_heads, config.head_dim
        width = self.kv_heads * self.head_dim
        self.router = nn.Linear(config.hidden_size, self.experts, bias=False, dtype=dtype)
        self.q_experts = nn.ModuleList(
            nn.Linear(config.hidden_size, width, bias=False, dtype=dtype) for _ in range(self.experts)
        )
        self.o_experts = nn.ModuleList(
            nn.Linear(width, config.hidden_size, bias=False, dtype=dtype) for _ in range(self.experts)
        )
        self.o_bias = nn.Parameter(torch.zeros(config.hidden_size, dtype=dtype), requires_grad=False)
        self.kv_proj = nn.Linear(config.hidden_size, 2 * width, bias=False, dtype=dtype)
        self.scale = self.head_dim**-0.5

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
        """hidden `[T, hidden]` -> `[T, hidden]`; writes this step's K/V into `kv_cache` before attending. No LoRA
        adapters (refused at load)."""
        tokens = hidden.shape[0]
        logits, chosen = self.router(hidden).float().topk(self.top_k, dim=-1)
        weights = torch.softmax(logits, dim=-1).to(hidden.dtype)  # [T, k]
        width = self.kv_heads * self.head_dim
        queries = hidden.new_zeros(tokens, self.top_k, width)
        for expert, rows, slots in self._routes(chosen):
            queries[rows, slots] = self.q_experts[expert](hidden.index_select(0, rows))
        k, v = self.kv_proj(hidden).chunk(2, dim=-1)
        # Query heads KV-head-major (the kernels' grouping): head j * k + s is expert slot s's query for KV head j.
        q = queries.view(tokens, self.top_k, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q.reshape(tokens, self.kv_heads * self.top_k, self.head_dim)
        k = k.reshape(tokens, self.kv_heads, self.head_dim)
        q, k = ops.rotary_embedding(positions, q, k.contiguous(), cos_sin_cache)
        ops.write_kv_cache(k, v.reshape(tokens, self.kv_heads, self.head_dim), kv_cache, meta.slot_mapping)
        out = ops.paged_attention(q, kv_cache, meta, self.scale, 0, 0.0, None)
        out = out.view(tokens, self.kv_heads, self.top_k, self.head_dim).transpose(1, 2).reshape(tokens, self.top_k,
                                                                                                  width)  # fmt: skip
        result = torch.zeros_like(hidden)
        for expert, rows, slots in self._routes(chosen):
            share = self.o_experts[expert](out[rows, slots]) * weights[rows, slots, None]
            result.index_add_(0, rows, share)
        return result + self.o_bias

    def _routes(self, chosen: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(expert, the tokens that chose it, the slot each chose it in) for each expert some token chose, in expert
        order."""
        routes = []
        for expert in chosen.unique().tolist():
            rows, slots = (chosen == expert).nonzero(as_tuple=True)
            routes.append((int(expert), rows, slots))
        return routes
