"""Phi-3 / Phi-4-mini: Llama-shaped, stored with fused `qkv_proj` and `gate_up_proj`, partial rotary, LongRoPE."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class Phi3ForCausalLM(CausalLM):
    """Phi-3: no projection biases; its checkpoints hold q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
    (loaded as they are into the same fused layers the other families fill part by part); rope over the first
    `partial_rotary_factor` of each head (Phi-4-mini: 0.75) and LongRoPE scaling (`config.LongRope`)."""
