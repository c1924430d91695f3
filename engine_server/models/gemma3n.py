"""Gemma 3n (text: E2B, E4B): Gemma 4's layers under AltUp's streams, with LAuReL and sparse MLPs
(`layers.gemma3n`)."""

from __future__ import annotations

from engine_server.layers.gemma3n import Gemma3nDecoderModel
from engine_server.models.gemma4 import Gemma4ForCausalLM


class Gemma3nForCausalLM(Gemma4ForCausalLM):
    """Gemma 3n's text model (`gemma3n_text`, or a multimodal `gemma3n` checkpoint's `model.language_model.`, its
    vision and audio towers not read, as Gemma 4's): `ModelConfig.gemma4` and `ModelConfig.altup` say what its layers
    do; the LM head is tied to the embeddings. The layers that attend over an earlier layer's K/V have no K/V
    projections in the checkpoint."""

    decoder_class = Gemma3nDecoderModel
