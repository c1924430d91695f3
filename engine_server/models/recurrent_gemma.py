"""RecurrentGemma (Griffin): Griffin's recurrent blocks (`layers.rg_lru`) between local multi-query attention layers,
under Gemma's norms, embedding scale and GeGLU."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class RecurrentGemmaForCausalLM(CausalLM):
    """RecurrentGemma (`recurrent_gemma`), read from transformers' names: each layer's `temporal_pre_norm`,
    `temporal_block` (the recurrent block or the attention), `channel_pre_norm` and `mlp_block` as a pre-norm
    block's `input_layernorm`, `self_attn`, `post_attention_layernorm` and `mlp`; `final_norm` as `norm`. Its
    quirks are `ModelConfig` fields the shared layers read (`norm_offset`, `embedding_multiplier`, `rg_lru`)."""

    checkpoint_renames = (
        (".temporal_pre_norm.", ".input_layernorm."),
        (".temporal_block.", ".self_attn."),
        (".channel_pre_norm.", ".post_attention_layernorm."),
        (".mlp_block.", ".mlp."),
        ("model.final_norm.", "model.norm."),
    )
