"""Gemma 3 (text): Llama-shaped attention with q/k norms, sandwich norms, (1 + weight) RMSNorms, scaled
embeddings, a GELU-tanh GeGLU, and sliding windows on five layers in six with a rope base of their own."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text model (`model_type` gemma3_text): its quirks are `ModelConfig` fields the shared layers
    read (`norm_offset`, `embedding_multiplier`, `hidden_act`, `sandwich_norms`, `attention_scale`,
    `local_rope_theta`, `rope_linear_factor`, `layer_windows`); the LM head is tied to the embeddings."""
