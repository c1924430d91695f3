"""Gemma (the first): Llama's pre-norm block with Gemma's (1 + weight) RMSNorms, embeddings scaled by
sqrt(hidden), a GELU-tanh GeGLU and tied embeddings; no sandwich norms, soft-caps or windows."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class GemmaForCausalLM(CausalLM):
    """Gemma (`model_type` gemma): its quirks are `ModelConfig` fields the shared layers read (`norm_offset`,
    `embedding_multiplier`, `hidden_act`, `attention_scale`); the LM head is tied to the embeddings."""
