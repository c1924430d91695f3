"""The vision encoder's outputs for the running requests' images, and the rows a prefill step lays them over.

An image is encoded once, when a step first reaches its placeholders, and its rows are kept until the request is
released (a later chunk, or a recompute after a preemption, reads them again); the runner calls this on the step
thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine_server.core.request import Request


class ImageEncoder(Protocol):
    """A model's vision encoder (`llava.LlavaImageEncoder`, `qwen_vl.QwenVisionEncoder`)."""

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, int, int] | None = None) -> torch.Tensor:
        """One image's processed pixels (`ImageSpan.pixel_values`, on the encoder's device and dtype) and grid ->
        its tokens' embeddings `[ImageSpan.length, text hidden]`."""
        ...


class ImageFeatures:
    """Per request, each image's encoder output `[length, hidden]` (`ImageSpan.length` rows), made on first need."""

    def __init__(self, encoder: ImageEncoder, device: torch.device, dtype: torch.dtype) -> None:
        self.encoder = encoder
        self.device = device
        self.dtype = dtype
        self._features: dict[str, list[torch.Tensor | None]] = {}

    def step_rows(
        self, chunks: Sequence[tuple[Request, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a step whose request i computes positions `[start_i, start_i + count_i)` (`chunks`: (request, start,
        count), in the step's row order), the rows that take image embeddings and those embeddings; None when no
        chunk reaches an image."""
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        base = 0
        for request, start, count in chunks:
            images = request.multimodal
            if images is not None and start < request.num_prompt_tokens:
                for piece in images.chunk_rows(start, count):
                    rows.extend(range(base + piece.chunk_row, base + piece.chunk_row + piece.count))
                    embeds.append(self._image(request, piece.image)[piece.first : piece.first + piece.count])
            base += count
        if not rows:
            return None
        return torch.tensor(rows, dtype=torch.long, device=self.device), torch.cat(embeds)

    def _image(self, request: Request, index: int) -> torch.Tensor:
        assert request.multimodal is not None
        images = request.multimodal.images
        cached = self._features.setdefault(request.request_id, [None] * len(images))
        features = cached[index]
        if features is None:
            span = images[index]
            features = self.encoder.encode(span.pixel_values.to(device=self.device, dtype=self.dtype), span.grid)
            if features.shape[0] != span.length:
                raise RuntimeError(
                    f"the vision encoder made {features.shape[0]} rows for an image of {span.length} placeholders"
                )
            cached[index] = features
        return features

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's images."""
        self._features.pop(request_id, None)


def step_mrope_positions(chunks: Sequence[tuple[Request, int, int]]) -> torch.Tensor:
    """The (temporal, height, width) rope positions `[3, T]` of a step's tokens (`chunks` as `step_rows` takes them):
    a prompt's with M-RoPE from its `MultimodalInputs.positions`, its later tokens' index plus its delta, every other
    request's tokens their index in all three."""
    pieces = []
    for request, start, count in chunks:
        end = start + count
        images = request.multimodal
        if images is None or images.positions is None:
            pieces.append(torch.arange(start, end).expand(3, -1))
            continue
        prompt = request.num_prompt_tokens
        if start < prompt:
            pieces.append(images.positions[:, start : min(end, prompt)])
        if end > prompt:
            pieces.append(torch.arange(max(start, prompt), end).expand(3, -1) + images.position_delta)
    return torch.cat(pieces, dim=1)
