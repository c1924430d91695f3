"""Gemma 3n (text: E2B, E4B): Gemma 4's layers under AltUp's streams, with LAuReL and sparse MLPs
(`layers.gemma3n`)."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator

from engine_server.layers.gemma3n import Gemma3nDecoderModel
from engine_server.models.gemma4 import Gemma4ForCausalLM
from engine_server.parallel.layers import CheckpointTensor

# A layer's K/V projections and key norm, which the released checkpoints hold for every layer.
_KEY_VALUE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:k_proj|v_proj|k_norm)\.weight")


class Gemma3nForCausalLM(Gemma4ForCausalLM):
    """Gemma 3n's text model (`gemma3n_text`, or a multimodal `gemma3n` checkpoint's `model.language_model.`, its
    vision and audio towers not read, as Gemma 4's): `ModelConfig.gemma4` and `ModelConfig.altup` say what its layers
    do; the LM head is tied to the embeddings. The released checkpoints (and llama.cpp's files) hold K/V projections
    and key norms for the layers that attend over an earlier layer's K/V too: never read, as transformers does not
    read them (`without_shared_key_values`)."""

    decoder_class = Gemma3nDecoderModel

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The text model's weights, the K/V-sharing layers' own K/V tensors left out."""
        return self.without_shared_key_values(super().checkpoint_weights(weights, replaced))

    def without_shared_key_values(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        """`weights` (the text model's, by its own names) without the K/V projections and key norms of the layers
        that attend over another's K/V."""
        for name, tensor in weights:
            match = _KEY_VALUE.fullmatch(name)
            if match is None or self.config.kv_source(int(match[1])) == int(match[1]):
                yield name, tensor
