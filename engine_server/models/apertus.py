"""Apertus (the Swiss AI Initiative's 8B and 70B): Llama's block with per-head q/k norms before rope (Qwen3's) and an
ungated MLP whose activation, xIELU, is learned per layer."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from engine_server.models.base import CausalLM, text_model_weights
from engine_server.parallel.layers import CheckpointTensor

# What an Apertus 1.5 multimodal checkpoint holds beside its text model, not read: its image and audio tokenizers.
_TOKENIZER_TOWERS = ("model.vision_tokenizer.", "model.audio_tokenizer.")


class ApertusForCausalLM(CausalLM):
    """Apertus: its quirks are `ModelConfig`'s (`qk_norm`, `hidden_act` "xielu": `layers.mlp.XIELU` reads each
    layer's `mlp.act_fn.alpha_p` / `alpha_n` / `beta` / `eps`). Its norms read as the shared layers':
    `attention_layernorm` as `input_layernorm`, `feedforward_layernorm` as `post_attention_layernorm`. Apertus 1.5
    (`apertus1p5_text`, `apertus1p5`): the same text model, its LM head the vocabulary's first `output_vocab_size`
    rows (`ModelConfig.output_vocab_size`); a multimodal checkpoint's text model is read (`model.language_model.`),
    its image and audio tokenizers are not."""

    checkpoint_renames = (
        (".attention_layernorm.", ".input_layernorm."),
        (".feedforward_layernorm.", ".post_attention_layernorm."),
    )

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The text model's weights (a multimodal Apertus 1.5 checkpoint's under its text-only names)."""
        return super().checkpoint_weights(text_model_weights(weights, _TOKENIZER_TOWERS), replaced)
