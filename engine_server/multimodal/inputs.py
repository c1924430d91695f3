"""A request's images: where their placeholder tokens sit in its prompt, what the encoder reads, and which of their
embedding rows a prefill chunk takes.

Each image's tokens are one run of `length` placeholder ids from prompt position `offset`; the vision encoder turns
its `pixel_values` into exactly `length` rows of the text model's embeddings, which replace the placeholders'
embeddings (the model never reads the placeholder id's own row). A chunk of the prompt may start or end inside a run
(chunked prefill, a prefix-cache hit): it takes the rows of its own positions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from engine_server.errors import ValidationError

_DIGEST_DOMAIN = b"ladle.v1 images\0"  # keeps the images' digest apart from any other hash input


@dataclass(frozen=True)
class ImageSpan:
    """One image of a prompt: its placeholder run `[offset, offset + length)`, the processor's `pixel_values`
    (`[3, H, W]`, float32; the Qwen-VL processors' `[patches, C * T * P * P]` beside their `grid`, the image's
    (temporal, height, width) patches; LLaVA-NeXT's tiles `[n, 3, H, W]` beside its original (height, width) as its
    `grid`; Idefics 2's tiles `[n, 3, H, W]`, padded to the largest, beside each tile's own (height, width) in turn;
    DeepSeek-VL hybrid's two square views `[3, L, L]` and `[3, H, H]` flattened one after the other, (L, H) its `grid`;
    Llama 3.2 Vision's tiles `[max tiles, 3, H, W]` beside its aspect ratio id and then its aspect ratio mask, one a
    tile, as its `grid`, its span its one image token; an audio clip's log-mel windows `[windows, mel bins, frames]`
    beside each window's valid frames: `multimodal.audio`) and the sha256 of its file's bytes (`digest`)."""

    offset: int
    length: int
    pixel_values: torch.Tensor
    digest: bytes
    grid: tuple[int, ...] | None = None
    # Where its embeddings go: runs (offset in the span, length), in order (Mistral 3's rows, each before a break
    # token); empty: the whole span, one embedding a token.
    runs: tuple[tuple[int, int], ...] = ()

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_features(self) -> int:
        """Rows of its encoder output: one per token of its runs."""
        return sum(length for _, length in self.runs) if self.runs else self.length


@dataclass(frozen=True)
class ChunkImageRows:
    """The embedding rows one prefill chunk takes from one image (one run of it): rows `[first, first + count)` of the
    image's encoder output go to the chunk's rows `[chunk_row, chunk_row + count)`."""

    image: int  # index into `MultimodalInputs.images`
    first: int
    count: int
    chunk_row: int


@dataclass(frozen=True)
class MultimodalInputs:
    """A prompt's images in prompt order (their runs disjoint and ascending). Immutable: every choice of an `n > 1`
    request shares it.

    With M-RoPE (the Qwen-VL text models), `positions` `[3, prompt tokens]` are the prompt's (temporal, height, width)
    rope positions: a text token's all three its index past the images before it, an image's tokens their row and
    column in its grid of merged patches from where the text before it ends; every later token (the outputs) turns as
    plain rope by its index plus `position_delta` (largest position + 1 - prompt tokens, <= 0)."""

    images: tuple[ImageSpan, ...]
    positions: torch.Tensor | None = None
    position_delta: int = 0
    # Gemma 3's: an image's tokens attend to each other both ways (each to its image's later tokens too), so a prefill
    # chunk never ends inside an image (`core.scheduler`) and the layers attend its rows again (`layers.image_blocks`).
    bidirectional: bool = False
    # Llama 3.2 Vision's (`ImageInput.cross_attention`): which of each image's tiles each prompt token's
    # cross-attention reads, `[prompt tokens, images, max tiles]` uint8 (1: read), as its processor makes it
    # (transformers' `get_cross_attention_token_mask`, `convert_sparse_cross_attention_mask_to_dense`); None: not
    # such a prompt.
    cross_attention_mask: torch.Tensor | None = None
    # A Whisper transcription's (`multimodal.whisper`): its one span the clip's log-mel features (no placeholder: the
    # decoder reads the encoder's states through cross-attention inside every layer).
    transcription: bool = False
    # A Whisper language detection's (`multimodal.transcription`): the transcription that follows it reads the same
    # clip, so its encoder states outlive it (`multimodal.whisper.WhisperCrossStates`).
    detects_language: bool = False
    # A Whisper transcription's asking word timings (`multimodal.whisper`): its output rows' cross-attention of the
    # alignment heads over the clip's first `align_frames` encoder frames is kept for it; 0: none is.
    align_frames: int = 0

    def cross_mask_rows(self, start: int, count: int) -> torch.Tensor:
        """`cross_attention_mask`'s rows of positions `[start, start + count)`, a position past the prompt's (an
        output token) the prompt's last token's row, as transformers' generation extends it."""
        assert self.cross_attention_mask is not None, "a prompt read by cross-attention has its mask"
        last = self.cross_attention_mask.shape[0] - 1
        return self.cross_attention_mask[torch.arange(start, start + count).clamp(max=last)]

    def image_ends(self, start: int, end: int) -> int:
        """Where a chunk `[start, end)` of a bidirectional prompt may end: `end`, unless it would cut an image; then
        before that image (where it starts after `start`), or after it (where `start` is inside it)."""
        for image in self.images:
            if image.offset < end < image.end:
                return image.offset if image.offset > start else image.end
        return end

    @cached_property
    def digest(self) -> bytes:
        """One hash of every image's bytes in order: two prompts whose equal placeholder ids stand for other images
        differ here (the prefix cache's chain starts from it: `core.kv_cache_manager.root_hash`)."""
        joined = b"".join(len(image.digest).to_bytes(2, "little") + image.digest for image in self.images)
        return hashlib.sha256(_DIGEST_DOMAIN + joined).digest()

    def chunk_rows(self, start: int, count: int) -> list[ChunkImageRows]:
        """The image rows that the prompt positions `[start, start + count)` take, in position order."""
        end = start + count
        rows = []
        for index, image in enumerate(self.images):
            feature = 0
            for run_offset, run_length in image.runs or ((0, image.length),):
                run = image.offset + run_offset
                first, last = max(start, run), min(end, run + run_length)
                if first < last:
                    rows.append(ChunkImageRows(index, feature + first - run, last - first, first - start))
                feature += run_length
        return rows


def placeholder_places(token_ids: Sequence[int], token: int, count: int, kind: str, items: str) -> list[int]:
    """The prompt positions of the placeholder `token` (a `kind`'s: "image", "audio"), one for each of the prompt's
    `count` `items`; ValidationError where they do not match one for one (a turn's text that spells the placeholder
    itself)."""
    places = [i for i, each in enumerate(token_ids) if each == token]
    if len(places) != count:
        raise ValidationError(
            f"the prompt holds {len(places)} {kind} placeholders for {count} {items}: a message's text may not spell "
            f"the model's {kind} token itself", "messages",
        )  # fmt: skip
    return places


def image_digest(data: bytes) -> bytes:
    """sha256 of an image file's bytes."""
    return hashlib.sha256(data).digest()
