"""Mixtral: Mistral's attention with a mixture of experts in every layer (top-2 of 8, renormalised weights)."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class MixtralForCausalLM(CausalLM):
    """Mixtral: no attention biases; each layer's `block_sparse_moe` holds the router (`gate`) and the experts'
    `w1` (gate), `w3` (up) and `w2` (down) projections, read as `layers.moe.SparseMoE`'s names."""

    checkpoint_renames = (
        (".block_sparse_moe.", ".mlp."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    )
