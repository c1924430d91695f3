"""SmolLM3 (SmolLM3-3B): Llama's block with no rope on every fourth layer (NoPE)."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class SmolLM3ForCausalLM(CausalLM):
    """SmolLM3: Llama's layers and names; the attention of `ModelConfig.nope_layers` uses no positions at all (its
    `no_rope_layers`), windows only with `use_sliding_window`."""
