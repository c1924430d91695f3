"""MiniMax-M3: Gemma-normed grouped-query attention, block-sparse on some layers (`layers.block_sparse_attention`),
over many small experts beside a shared one (or a dense MLP), every MLP gpt-oss's clamped SwiGLU."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from engine_server.models.base import CausalLM, text_model_weights
from engine_server.parallel.layers import CheckpointTensor

# What a multimodal checkpoint holds beside its text model, not read: its vision tower, projector and patch merger,
# under transformers' names and its released ones.
_TOWERS = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.",
           "patch_merge_mlp.")  # fmt: skip


class MiniMaxM3ForCausalLM(CausalLM):
    """MiniMax-M3 (`minimax_m3`), read from transformers' names or its released ones (transformers' conversion,
    reversed): the experts, router and shared experts under `block_sparse_moe` with Mixtral's `w1` (gate), `w3` (up)
    and `w2` (down), the routing bias on the block, the indexer's projections and norms on the attention as
    `index_q_proj`, `index_k_proj`, `index_q_norm` and `index_k_norm`. Its multi-token-prediction modules (`mtp.`)
    are not read. Every RMSNorm applies `1 + w` (`ModelConfig.norm_offset`)."""

    checkpoint_renames = (
        (".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
        (".block_sparse_moe.", ".mlp."),
        (".mlp.shared_experts.", ".mlp.shared_expert."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
        (".self_attn.index_q_proj.", ".self_attn.indexer.q_proj."),
        (".self_attn.index_k_proj.", ".self_attn.indexer.k_proj."),
        (".self_attn.index_q_norm.", ".self_attn.indexer.q_norm."),
        (".self_attn.index_k_norm.", ".self_attn.indexer.k_norm."),
    )
    ignored_prefixes = ("mtp.", "model.mtp.")

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The text model's weights (a multimodal checkpoint's towers left out)."""
        return text_model_weights(weights, _TOWERS)
