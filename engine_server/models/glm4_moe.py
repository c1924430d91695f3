"""GLM-4.5 (and GLM-4.6, GLM-4.7, GLM-4.5-Air), Solar Open, K-EXAONE, Hy3, Sarvam 30B and MiMo-V2-Flash: DeepSeek-V3's
mixture of experts under grouped-query attention."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch

from engine_server.config import ModelConfig
from engine_server.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine_server.models.glm4 import GLM4_SANDWICH_RENAMES
from engine_server.models.mimo_v2_flash import mimo_weights
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor

# Kolibri-1's files' names for the norms after its attention and MLP, and for its routing bias.
_KOLIBRI_RENAMES = (
    (".post_attn_norm.", ".post_attention_layernorm."),
    (".post_ffn_norm.", ".post_feedforward_layernorm."),
    (".moe.router.expert_bias", ".mlp.gate.e_score_correction_bias"),
)


# Sarvam 30B's and Param2's checkpoints, in the names of the Ling (Bailing) models they came from: the embeddings as
# `word_embeddings`, q/k/v in one `query_key_value` (rows `cat(q, k, v)`, read as a fused `qkv_proj`), the per-head
# q/k norms and output projection under `attention`, the routing bias on the router as `expert_bias`.
_BAILING_RENAMES = (
    ("model.word_embeddings.", "model.embed_tokens."),
    (".attention.query_key_value.", ".self_attn.qkv_proj."),
    (".attention.dense.", ".self_attn.o_proj."),
    (".attention.query_layernorm.", ".self_attn.q_norm."),
    (".attention.key_layernorm.", ".self_attn.k_norm."),
    (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"),
)


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.5 (`glm4_moe`): each layer's attention is the standard grouped-query attention with q/k/v biases
    (`attention_bias`), rope over the first half of each head (`partial_rotary_factor` 0.5) and, where
    `use_qk_norm` says, per-head q/k norms; its MLP dense for the first `first_k_dense_replace` layers and otherwise
    DeepSeek-V3's (`layers.moe.GroupedTopkRouter`: sigmoid scores with a load-balancing bias, `routed_scaling_factor`,
    ungated shared experts, checkpoint `mlp.shared_experts`). Its multi-token-prediction layer after the last one
    (`model.layers.46` of GLM-4.5) is not used and not read, as DeepSeek-V3's; nor are K-EXAONE's (`mtp.`). Solar
    Open, K-EXAONE (`exaone_moe`), Hy3 (`hy_v3`), Kolibri-1 (`kolibri1`: GLM-4's sandwich norms, its experts chosen
    by logit plus bias), Flint (`flint`: sinks, its experts by sigmoid score without a bias), Sarvam 30B
    (`sarvam_moe`) and Param2 (`param2moe`; both under the Ling models' names, `_BAILING_RENAMES`) and MiniCPM5-MoE
    (`minicpm5_moe`: its `q_gate_proj` read as a gated `q_proj`) come in this layout:
    their quirks are `ModelConfig`'s; so does MiMo-V2-Flash (`mimo_v2_flash`), whose values are padded to the keys'
    width as they load (`models.mimo_v2_flash`) and whose multi-token-prediction layers (`model.mtp.`) are not read."""

    ignored_prefixes = ("mtp.", "model.mtp.")
    # K-EXAONE's checkpoints hold the router's load-balancing bias on the block (`mlp.e_score_correction_bias`);
    # Hy3's name the router `mlp.router.gate`, its bias `mlp.expert_bias` and the shared experts `shared_mlp`.
    checkpoint_renames = (
        *DeepseekV3ForCausalLM.checkpoint_renames,
        (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
        (".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),  # Laguna's files' place
        (".mlp.router.gate.", ".mlp.gate."),
        (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
        (".mlp.shared_mlp.", ".mlp.shared_expert."),
        (".self_attn.attention_sink_bias", ".self_attn.sinks"),  # MiMo-V2-Flash's released name for its sinks
        (".self_attn.softmax_offset", ".self_attn.sinks"),  # Flint's
        (".self_attn.q_gate_proj.", ".self_attn.q_proj."),  # MiniCPM5-MoE's queries and gates, head by head
        *_BAILING_RENAMES,
    )

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        """Kolibri-1 (`ModelConfig.sandwich_norms`): its norms around the attention and the MLP under GLM-4's names
        (transformers') or its files' (`post_attn_norm`, `post_ffn_norm`), its files' routing bias on `moe.router`."""
        super().__init__(config, dtype, tp)
        if config.sandwich_norms:
            self.checkpoint_renames = (*type(self).checkpoint_renames, *GLM4_SANDWICH_RENAMES, *_KOLIBRI_RENAMES)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """MiMo-V2-Flash's (values narrower than keys: `value_head_dim`) as `models.mimo_v2_flash.mimo_weights`
        gives them; the others' as DeepSeek-V3's."""
        if self.config.value_head_dim:
            weights = mimo_weights(self.config, weights)
        return super().checkpoint_weights(weights, replaced)
