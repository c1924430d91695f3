"""Llama family (Llama 2/3 incl. llama3 rope scaling, SmolLM2, Mistral with or without its sliding window, Ministral,
Ministral 3, a multimodal Mistral 3 checkpoint's text model, Arcee AFM's ungated relu² MLP, OLMo's weightless
LayerNorms, EXAONE 3's names)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from engine_server.models.base import CausalLM, text_model_weights
from engine_server.parallel.layers import CheckpointTensor

# What a multimodal Mistral 3 checkpoint (Mistral Small 3.1 / 3.2, Ministral 3) holds beside its text model, not
# read: the Pixtral vision tower and its projector, under either layout's names.
MISTRAL3_TOWERS = (
    "vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."
)  # fmt: skip


class LlamaForCausalLM(CausalLM):
    """Llama: `attention_bias`, when set, applies to q/k/v and o_proj alike. A multimodal Mistral 3 checkpoint's
    text model is read as a text-only checkpoint's (`text_model_weights`), its vision tower left out; an EXAONE 3
    checkpoint's GPT-2 style names as Llama's (`checkpoint_renames`, transformers' conversion of them)."""

    checkpoint_renames = (
        ("transformer.wte.", "model.embed_tokens."),
        ("transformer.h.", "model.layers."),
        ("transformer.ln_f.", "model.norm."),
        (".attn.attention.out_proj.", ".self_attn.o_proj."),
        (".attn.attention.", ".self_attn."),
        (".ln_1.", ".input_layernorm."),
        (".ln_2.", ".post_attention_layernorm."),
        (".mlp.c_fc_0.", ".mlp.gate_proj."),
        (".mlp.c_fc_1.", ".mlp.up_proj."),
        (".mlp.c_proj.", ".mlp.down_proj."),
    )

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The text model's weights."""
        return super().checkpoint_weights(text_model_weights(weights, MISTRAL3_TOWERS), replaced)
