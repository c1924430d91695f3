"""Gemma 4 (text): Gemma 3's block with plain-weight norms, per-layer inputs, full-attention layers of their own head
shape (values from the keys' projection, proportional rope) and K/V shared by the last layers (`layers.gemma4`)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from engine_server.layers.gemma4 import Gemma4DecoderModel
from engine_server.models.base import CausalLM, text_model_weights
from engine_server.parallel.layers import CheckpointTensor

# What a multimodal checkpoint holds beside its text model, not read: the vision and audio towers and their
# projections into the text model's embeddings.
_SKIPPED_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
                     "model.vision_embedder.")  # (Gemma 4 Unified's released name for its vision embedder)


class Gemma4ForCausalLM(CausalLM):
    """Gemma 4's text model (`gemma4_text`, or a multimodal `gemma4` checkpoint's `model.language_model.`, its vision
    and audio towers not read): `ModelConfig.gemma4` says what its layers do; the LM head is tied to the embeddings.
    The layers that attend over an earlier layer's K/V have no K/V projections in the checkpoint, nor a value norm
    weight (its norm has none)."""

    decoder_class = Gemma4DecoderModel

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The text model's weights."""
        return super().checkpoint_weights(text_model_weights(weights, _SKIPPED_PREFIXES), replaced)
