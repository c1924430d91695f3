"""Layers beside a text model's own that read a step's rows of some requests alone (Llama 3.2 Vision's cross-attention
layers over a request's images: `multimodal.mllama`, run between the decoder's layers; Whisper's cross-attention over
a request's clip: `multimodal.whisper`, run inside each layer, after its self-attention's residual add and before its
MLP's norm), where a step carries them (`AttentionMetadata.cross_attention`); a step without them runs the layers as it
always does."""

from __future__ import annotations

from typing import Protocol

import torch


class CrossAttention(Protocol):
    """A step's layers beside the text model's: `positions` are the decoder's layer indices where they run; with
    `inside` False before those layers (the number of the text model's layers before them; the layer count itself:
    after the last, before the norm), with `inside` True within those layers, between their attention and their MLP
    (`DecoderLayer.forward`)."""

    positions: frozenset[int]
    inside: bool

    def apply(
        self, position: int, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream (`hidden + residual`, or `hidden` alone before the first layer) after the layers at
        `position`, as (hidden, residual) whose sum it is; rows the layers do not read keep their values exactly."""
        ...
