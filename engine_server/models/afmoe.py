"""AFMoE (Arcee's Trinity Nano, Mini and Large): gated attention with per-head q/k norms and rope on its windowed
layers alone, norms before and after the attention and the MLP, and DeepSeek-V3's sigmoid routing beside shared
experts."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

from engine_server.models.base import CausalLM, gated_query, joined_queries
from engine_server.parallel.layers import CheckpointTensor

# A layer's query and output-gate projections, which the shared attention reads as one (`_query_and_gate`).
_QUERY_OR_GATE = re.compile(r"(?P<layer>.+\.self_attn)\.(?P<part>q_proj|gate_proj)\.weight")


class AfmoeForCausalLM(CausalLM):
    """AFMoE (`afmoe`): its quirks are `ModelConfig`'s (`sandwich_norms`, `attention_output_gate`, the windowed
    layers' rope, the grouped router). Checkpoint names read as the shared layers': the norms around the MLP
    (`pre_mlp_layernorm`, `post_mlp_layernorm`), the router (`mlp.router.gate`) and its bias (`mlp.expert_bias`), the
    shared experts; each layer's `self_attn.gate_proj` joins its `q_proj` as the shared attention takes a gated
    query (each head's query rows, then its gate's)."""

    checkpoint_renames = (
        (".pre_mlp_layernorm.", ".pre_feedforward_layernorm."),
        (".post_mlp_layernorm.", ".post_feedforward_layernorm."),
        (".mlp.router.gate.", ".mlp.gate."),
        (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
        (".mlp.shared_experts.", ".mlp.shared_expert."),
    )

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """Each layer's q_proj and gate_proj as one q_proj (`gated_query`), yielded once both are read."""
        head_dim = self.config.head_dim
        joined = joined_queries(weights, _QUERY_OR_GATE, lambda query, gate: gated_query(query, gate, head_dim))
        return super().checkpoint_weights(joined, replaced)

