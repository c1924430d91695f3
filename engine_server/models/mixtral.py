"""Mixtral: Mistral's attention with a mixture of experts in every layer (top-2 of 8, renormalised weights); PhiMoE
in the same layout."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class MixtralForCausalLM(CausalLM):
    """Mixtral: no attention biases; each layer's `block_sparse_moe` holds the router (`gate`) and the experts'
    `w1` (gate), `w3` (up) and `w2` (down) projections, read as `layers.moe.SparseMoE`'s names. PhiMoE's checkpoints
    name them so too (transformers 5 calls its router `mlp.router`); its quirks are `ModelConfig`'s (biased
    LayerNorms, q/k/v/o and LM head biases, `moe_scoring` "sparsemixer")."""

    checkpoint_renames: tuple[tuple[str, str], ...] = (
        (".block_sparse_moe.", ".mlp."),
        (".mlp.router.", ".mlp.gate."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    )
