"""LFM2 and LFM3 (Liquid AI): hybrids of gated short convolutions (`layers.short_conv`) and grouped-query attention with
per-head q/k norms, each layer Llama's pre-norm block (LFM3: Gemma's sandwich) under names of its own."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

import torch

from engine_server.config import ModelConfig
from engine_server.models.base import CausalLM, gated_query, joined_queries, reordered_tensor
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor

# LFM3's query and per-head gate projections, which the shared attention reads as one q_proj.
_QUERY_OR_GATE = re.compile(r"(?P<layer>.+\.self_attn)\.(?P<part>q_proj|g_proj|gate_proj)\.weight")
# The names LFM2 and LFM3 share (the attention's `out_proj` is renamed before the convolution's projections take
# `self_attn.` names).
_SHARED_RENAMES = (
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".conv.conv.", ".self_attn.conv1d."),
    (".conv.in_proj.", ".self_attn.in_proj."),
    (".conv.out_proj.", ".self_attn.out_proj."),
    (".operator_norm.", ".input_layernorm."),
)
# LFM3's four norms as Gemma's sandwich names them (`post_ffn_norm` before `ffn_norm`, which it contains).
_SANDWICH_NORMS = (
    (".post_operator_norm.", ".post_attention_layernorm."),
    (".post_ffn_norm.", ".post_feedforward_layernorm."),
    (".ffn_norm.", ".pre_feedforward_layernorm."),
)
_MLP_RENAMES = (
    (".feed_forward.", ".mlp."),  # the MLP, or LFM2-MoE's router, experts (one per tensor) and routing bias
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
    (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
    ("model.embedding_norm.", "model.norm."),
)


class Lfm2ForCausalLM(CausalLM):
    """LFM2 (`lfm2`), LFM2-MoE (`lfm2_moe`) and LFM3 (`lfm3`): a layer's token mixer is `ShortConv` where
    `ModelConfig.short_convolution` says (checkpoint `conv`), else attention with an RMSNorm over each head of q and k
    before rope (`qk_norm`); its MLP (`feed_forward`) is SwiGLU (`w1` gate, `w3` up, `w2` down), or past LFM2-MoE's
    dense layers experts of it chosen by DeepSeek-V3's router in one group (`gate`, with `expert_bias` for the choice);
    the final norm is the checkpoint's `embedding_norm`; embeddings tied. LFM3's layers are Gemma's sandwich
    (`operator_norm` before the mixer, `post_operator_norm` after it, `ffn_norm` and `post_ffn_norm` around the MLP)
    and each attention head's output is times the sigmoid of its `g_proj` row (`gate_proj` as released): read into
    q_proj as the shared gated attention takes it (each head's query rows, then its gate row once per dim)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, dtype, tp)
        norms = _SANDWICH_NORMS if config.sandwich_norms else ((".ffn_norm.", ".post_attention_layernorm."),)
        self.checkpoint_renames = (*_SHARED_RENAMES, *norms, *_MLP_RENAMES)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """LFM3's q_proj and per-head g_proj (`gate_proj` as released, each row once per dim) as one q_proj
        (`gated_query`); the rest as they are."""
        if self.config.attention_output_gate:
            head_dim = self.config.head_dim
            weights = joined_queries(weights, _QUERY_OR_GATE,
                                     lambda query, gate: gated_query(query, _per_dim_gate(gate, head_dim), head_dim))
        return super().checkpoint_weights(weights, replaced)



def _per_dim_gate(gate: CheckpointTensor, head_dim: int) -> CheckpointTensor:
    """A per-head gate `[heads, hidden]` as `[heads * head_dim, hidden]`: each head's row once per dim (the same
    sigmoid on each of the head's outputs); unread while it is."""
    shape = (gate.shape[0] * head_dim, gate.shape[1])
    return reordered_tensor(gate, lambda rows: rows.repeat_interleave(head_dim, dim=0), shape=shape)
