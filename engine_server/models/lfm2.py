"""LFM2 (Liquid AI): hybrids of gated short convolutions (`layers.short_conv`) and grouped-query attention with
per-head q/k norms, each layer Llama's pre-norm block under names of its own."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class Lfm2ForCausalLM(CausalLM):
    """LFM2 (`lfm2`) and LFM2-MoE (`lfm2_moe`): a layer's token mixer is `ShortConv` where
    `ModelConfig.short_convolution` says (checkpoint `conv`), else attention with an RMSNorm over each head of q and k
    before rope (`qk_norm`); its MLP (`feed_forward`) is SwiGLU (`w1` gate, `w3` up, `w2` down), or past LFM2-MoE's
    dense layers experts of it chosen by DeepSeek-V3's router in one group (`gate`, with `expert_bias` for the choice);
    the final norm is the checkpoint's `embedding_norm`; embeddings tied."""

    # The attention's `out_proj` is renamed before the convolution's projections take `self_attn.` names.
    checkpoint_renames = (
        (".self_attn.out_proj.", ".self_attn.o_proj."),
        (".self_attn.q_layernorm.", ".self_attn.q_norm."),
        (".self_attn.k_layernorm.", ".self_attn.k_norm."),
        (".conv.conv.", ".self_attn.conv1d."),
        (".conv.in_proj.", ".self_attn.in_proj."),
        (".conv.out_proj.", ".self_attn.out_proj."),
        (".operator_norm.", ".input_layernorm."),
        (".ffn_norm.", ".post_attention_layernorm."),
        (".feed_forward.", ".mlp."),  # the MLP, or LFM2-MoE's router, experts (one per tensor) and routing bias
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
        (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
        ("model.embedding_norm.", "model.norm."),
    )
