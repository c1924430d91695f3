"""Granite (IBM Granite 3.x dense): Llama's block with multipliers on the embeddings, scores, residuals and logits."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class GraniteForCausalLM(CausalLM):
    """Granite: Llama's layers and names; embeddings times `embedding_multiplier`, attention scores scaled by
    `attention_multiplier` (not head_dim ** -0.5), each block's outputs times `residual_multiplier` before their
    residual adds, logits divided by `logits_scaling` (`ModelConfig`)."""
