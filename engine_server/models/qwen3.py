"""Qwen3 (dense): Llama-shaped, with an RMSNorm over each head of q and k before rope."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """Qwen3: `ModelConfig.qk_norm` is always set for this family; no projection biases by default (`attention_bias`
    puts them on q/k/v and o_proj, as for Llama)."""
