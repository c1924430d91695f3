"""Qwen2 / Qwen2.5: Llama-shaped, with biases on the q/k/v projections only."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class Qwen2ForCausalLM(CausalLM):
    """Qwen2: `ModelConfig.attention_bias` is always set for this family; o_proj has no bias."""
