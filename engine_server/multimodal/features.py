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
from engine_server.layers.image_blocks import ImageBlock
from engine_server.multimodal.inputs import ImageSpan


class ImageEncoder(Protocol):
    """A model's vision encoder (`llava.LlavaImageEncoder`, `qwen_vl.QwenVisionEncoder`)."""

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One image's processed pixels (`ImageSpan.pixel_values`, on the encoder's device and dtype) and grid ->
        its tokens' embeddings `[ImageSpan.length, text hidden]`."""
        ...


class ImageFeatures:
    """Each image's encoder output `[length, width]` (`ImageSpan.length` rows), made on first need and shared by the
    running requests with the same image (by its file's digest: the choices of an `n > 1` request, a conversation's
    turns in flight together), kept until the last of them is released."""

    def __init__(self, encoder: ImageEncoder, device: torch.device, dtype: torch.dtype) -> None:
        self.encoder = encoder
        self.device = device
        self.dtype = dtype
        self._features: dict[bytes, torch.Tensor] = {}
        self._users: dict[bytes, set[str]] = {}  # the requests holding each image's features
        self._held: dict[str, set[bytes]] = {}  # the images each request holds (`release` reads its own alone)

    def step_rows(
        self, chunks: Sequence[tuple[Request, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a step whose request i computes positions `[start_i, start_i + count_i)` (`chunks`: (request, start,
        count), in the step's row order), the rows that take image embeddings (a host int64 tensor) and those
        embeddings (on the device, in the model's dtype); None when no chunk reaches an image."""
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        base = 0
        for request, start, count in chunks:
            images = request.multimodal
            if images is not None and start < request.num_prompt_tokens:
                for piece in images.chunk_rows(start, count):
                    rows.extend(range(base + piece.chunk_row, base + piece.chunk_row + piece.count))
                    features = self._image(request.request_id, images.images[piece.image])
                    embeds.append(features[piece.first : piece.first + piece.count])
            base += count
        if not rows:
            return None
        return torch.tensor(rows, dtype=torch.long), torch.cat(embeds)

    def _image(self, request_id: str, span: ImageSpan) -> torch.Tensor:
        features = self._features.get(span.digest)
        if features is None:
            pixels = span.pixel_values.to(device=self.device, dtype=self.dtype)
            features = self.encoder.encode(pixels, span.grid).to(self.dtype)
            if features.shape[0] != span.num_features:
                raise RuntimeError(
                    f"the vision encoder made {features.shape[0]} rows for an image of {span.num_features} tokens"
                )
            self._features[span.digest] = features
        self._users.setdefault(span.digest, set()).add(request_id)
        self._held.setdefault(request_id, set()).add(span.digest)
        return features

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's hold on its images (their features once no request holds them)."""
        for digest in self._held.pop(request_id, ()):
            users = self._users[digest]
            users.discard(request_id)
            if not users:
                del self._users[digest], self._features[digest]

    @property
    def num_images(self) -> int:
        """Images whose features are kept."""
        return len(self._features)


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


def step_image_blocks(chunks: Sequence[tuple[Request, int, int]]) -> list[ImageBlock] | None:
    """The images a step computes whose tokens attend both ways (`MultimodalInputs.bidirectional`), `chunks` as
    `step_rows` takes them: each image's tokens in the step; None for none. A chunk never ends inside such an image
    (`core.scheduler`)."""
    blocks: list[ImageBlock] = []
    base = 0
    for sequence, (request, start, count) in enumerate(chunks):
        images = request.multimodal
        if images is not None and images.bidirectional and start < request.num_prompt_tokens:
            for image in images.images:
                first, last = max(start, image.offset), min(start + count, image.end)
                if first < last:
                    assert last == image.end, "a chunk never ends inside an image whose tokens attend both ways"
                    blocks.append(ImageBlock(sequence, base + first - start, first, last - first, image.end))
        base += count
    return blocks or None
