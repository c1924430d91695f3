"""Gemma 2: Gemma 3's block without q/k norms or a local rope base, with its attention scores and final logits
soft-capped (`c * tanh(x / c)`); sliding windows on every other layer."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2 (`model_type` gemma2): its quirks are `ModelConfig` fields the shared layers read (`norm_offset`,
    `embedding_multiplier`, `hidden_act`, `sandwich_norms`, `attention_scale`, `attention_softcap`,
    `final_logit_softcap`, `layer_windows`); the LM head is tied to the embeddings."""
