"""Llama family (Llama 2/3 incl. llama3 rope scaling, SmolLM2, Mistral with or without its sliding window)."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class LlamaForCausalLM(CausalLM):
    """Llama: `attention_bias`, when set, applies to q/k/v and o_proj alike."""
