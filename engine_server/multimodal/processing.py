"""A chat's images prepared as the model's own processor prepares them, and their placeholders laid into its prompt.

`ImageProcessing.prepare` takes the prompt's token ids, in which the chat template wrote the image token once per image
(LLaVA's `<image>`), and the images' encoded files in the same order: each file is decoded (Pillow, at most
`max_image_pixels`), turned into pixel values by the checkpoint's image processor (`preprocessor_config.json`, read by
transformers' PIL backend, as transformers' own processor would), and its one placeholder becomes its tokens
(LLaVA's one per patch, `ImageInput.tokens_per_image`; the Qwen-VL towers' one per merged patch of its grid), the
prompt's M-RoPE positions laid out where the model has them (`qwen_vl.mrope_positions`). Where the model's processor
lays its images out in the prompt's text (Gemma 3's; Idefics 2's, whose marks around an image depend on the text beside
it), the text is laid out first (`prompt_ids`) and each image's runs of image tokens are found in its ids. Runs in the
frontend, off the step loop.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from engine_server.config import ImageInput, MultimodalCheckpoint
from engine_server.errors import ValidationError
from engine_server.multimodal.image_files import DEFAULT_MAX_IMAGE_PIXELS, decoded_image
from engine_server.multimodal.inputs import ImageSpan, MultimodalInputs, image_digest, placeholder_places
from engine_server.multimodal.layouts import PROCESSOR_LAYOUTS, TEXT_LAYOUTS, image_runs, layout_processor
from engine_server.multimodal.qwen_vl import mrope_positions

_PROCESSOR_CONFIG = "preprocessor_config.json"
# Keeps the digest of a LLaVA-OneVision image laid out as its base view alone (a prompt's several images) apart from
# the same file's laid out in tiles (`ImageSpan.digest`: running requests share an image's features by it).
_BASE_VIEW_DOMAIN = b"ladle.v1 base view\0"


@dataclass(frozen=True)
class PromptImage:
    """One image of a chat: its encoded file and the request field it came in (for errors)."""

    data: bytes
    param: str


class ImageProcessing:
    """The images of a model whose images are served (`ModelConfig.multimodal.images`). Thread-safe: it holds no
    state but the processor's configuration."""

    def __init__(
        self, spec: ImageInput, processor: Any, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        row_marks: tuple[int, int] | None = None, image_marks: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        """`row_marks`, `image_marks`: the ids of `spec.row_marks` (Mistral 3's row break and image end tokens) and of
        `spec.image_marks` (InternVL's image start and end tokens)."""
        if (spec.row_marks is None) != (row_marks is None) or (spec.image_marks is None) != (image_marks is None):
            raise ValueError(f"{spec.encoder} images need the ids of their tokens {spec.row_marks or spec.image_marks}")
        self.spec = spec
        self.processor = processor
        self.max_image_pixels = max_image_pixels
        self.row_marks = row_marks
        self.image_marks = image_marks
        # What lays an image's tokens out where the model's own does (`for_model`): Idefics 3's and SmolVLM's
        # tokenizer (their layouts are text), LLaVA-NeXT's processor, Idefics 2's (over the whole prompt's text).
        self.layout: Any = None

    @classmethod
    def for_model(cls, spec: ImageInput, folder: Path, tokenizer: Any = None) -> ImageProcessing:
        """The images of the checkpoint in `folder` (its `preprocessor_config.json`, which must be there);
        `tokenizer` gives the ids of the row tokens a layout has (`ImageInput.row_marks`)."""
        from transformers import AutoImageProcessor  # (only for these models)

        processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
        rows, image = _mark_ids(spec.row_marks, tokenizer, folder), _mark_ids(spec.image_marks, tokenizer, folder)
        processing = cls(spec, processor, row_marks=rows, image_marks=image)
        if spec.encoder in (*PROCESSOR_LAYOUTS, *TEXT_LAYOUTS):  # (its processor lays an image's tokens out)
            if tokenizer is None:
                raise ValueError(f"{spec.encoder} images need the tokenizer for their layout")
            processing.layout = layout_processor(spec, processor, tokenizer)
        if spec.split_rows:
            if tokenizer is None:
                raise ValueError(f"{spec.encoder} images need the tokenizer for their prompt text")
            processing.layout = tokenizer
        return processing

    def expand_text(self, text: str) -> str:
        """The prompt text with each image's mark replaced by its tokens' text, where the model's processor expands
        images in the text (`ImageInput.text_marks`: Gemma 3's); else `text` as it is."""
        if self.spec.text_marks is None:
            return text
        start, image, end = self.spec.text_marks
        return text.replace(start, f"\n\n{start}{image * self.spec.extra_tokens}{end}\n\n")

    def prompt_ids(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """The ids of a chat's rendered `text` whose turns hold images, as `prepare` takes them: `encode(text)` (the
        tokenizer's), Gemma 3's text expanded first (`expand_text`); where the model's processor lays its images out
        in the text (`TEXT_LAYOUTS`: Idefics 2's), that processor's ids of the text."""
        if self.spec.encoder in TEXT_LAYOUTS:
            return [int(token) for token in self.layout(text=text, add_special_tokens=False)["input_ids"][0]]
        return encode(self.expand_text(text))

    def prepare(self, token_ids: Sequence[int], images: Sequence[PromptImage]) -> tuple[list[int], MultimodalInputs]:
        """`token_ids` with each image's placeholder expanded to its tokens (where the text was laid out already,
        `prompt_ids`, each image's runs of image tokens are found), and the images as the encoder takes them.
        ValidationError for a file that is no image, one too large, or a prompt whose placeholders do not match the
        images one for one (a turn's text that spells the placeholder itself)."""
        image_token = self.spec.image_token_id
        if self.spec.text_marks is not None or self.spec.encoder in TEXT_LAYOUTS:
            return self._prepare_expanded(token_ids, images)
        if self.spec.cross_attention:
            return self._prepare_cross(token_ids, images)
        placeholder = image_token
        if self.spec.placeholder is not None:
            placeholder = int(self.layout.tokenizer.convert_tokens_to_ids(self.spec.placeholder))
        places = placeholder_places(token_ids, placeholder, len(images), "image", "images")
        out: list[int] = []
        spans = []
        done = 0
        together = self.spec.encoder == "llava_onevision" and len(images) > 1  # (laid out by how many share the prompt)
        processed = self._processed_together(images) if together else [self._processed(image) for image in images]
        for place, image, each in zip(places, images, processed, strict=True):
            tokens, runs, pixels, grid = self._laid_out(each)
            out.extend(token_ids[done:place])
            digest = image_digest(image.data)
            if together:  # (its features are not the same image's alone in a prompt, which are shared by digest)
                digest = hashlib.sha256(_BASE_VIEW_DOMAIN + digest).digest()
            spans.append(ImageSpan(len(out), len(tokens), pixels, digest, grid, runs))
            out.extend(tokens)
            done = place + 1
        out.extend(token_ids[done:])
        if not self.spec.mrope_section:
            return out, MultimodalInputs(tuple(spans))
        positions, delta = mrope_positions(len(out), spans, self.spec.merge_size)
        return out, MultimodalInputs(tuple(spans), positions, delta)

    def _prepare_expanded(
        self, token_ids: Sequence[int], images: Sequence[PromptImage]
    ) -> tuple[list[int], MultimodalInputs]:
        """`prepare` of a prompt whose images were laid out with its text (`prompt_ids`): each image's tokens are the
        next of its tiles' runs of `extra_tokens` image tokens (Gemma 3's one run; Idefics 2's one a tile, one
        `<fake_token_around_image>` apart), its span from its first image token to its last."""
        image_token, count = self.spec.image_token_id, self.spec.extra_tokens
        runs = image_runs(token_ids, image_token)
        tiled = [self._tiles(self._processed(image)) for image in images]
        groups, first = [], 0
        for _, _, tiles in tiled:
            groups.append(runs[first : first + tiles])
            first += tiles
        apart = all(b - a == count + 1 for group in groups for (a, _), (b, _) in pairwise(group))
        if first != len(runs) or any(length != count for _, length in runs) or not apart:
            raise ValidationError(
                f"the prompt's image tokens do not lay out {len(images)} images of {count} tokens a tile: a message's "
                "text may not spell the model's image marks itself", "messages",
            )  # fmt: skip
        spans = []
        for image, group, (pixels, grid, tiles) in zip(images, groups, tiled, strict=True):
            start, end = group[0][0], group[-1][0] + count
            inner = tuple((offset - start, count) for offset, _ in group) if tiles > 1 else ()
            spans.append(ImageSpan(start, end - start, pixels, image_digest(image.data), grid, inner))
        return list(token_ids), MultimodalInputs(tuple(spans), bidirectional=self.spec.bidirectional)

    def _prepare_cross(
        self, token_ids: Sequence[int], images: Sequence[PromptImage]
    ) -> tuple[list[int], MultimodalInputs]:
        """`prepare` of Llama 3.2 Vision's prompt: each image's token stays one token (its span, no rows of its own:
        `ImageSpan.num_features` is not read), its pixels its tiles `[max tiles, 3, H, W]` as its processor pads them,
        its grid (aspect ratio id, then the processor's aspect ratio mask, one a tile); the prompt's
        cross-attention mask its processor's (`MultimodalInputs.cross_attention_mask`)."""
        from transformers.models.mllama.processing_mllama import (
            convert_sparse_cross_attention_mask_to_dense,
            get_cross_attention_token_mask,
        )

        image_token = self.spec.image_token_id
        places = placeholder_places(token_ids, image_token, len(images), "image", "images")
        spans, tiles = [], []
        for place, image in zip(places, images, strict=True):
            processed = self._processed(image)
            grid = (int(processed["aspect_ratio_ids"][0][0]), *(int(m) for m in processed["aspect_ratio_mask"][0][0]))
            spans.append(ImageSpan(place, 1, processed["pixel_values"][0][0], image_digest(image.data), grid))
            tiles.append(int(processed["num_tiles"][0][0]))
        ids = list(token_ids)
        mask = convert_sparse_cross_attention_mask_to_dense(
            [get_cross_attention_token_mask(ids, image_token)], [tiles], int(self.processor.max_image_tiles), len(ids)
        )  # fmt: skip
        return ids, MultimodalInputs(tuple(spans), cross_attention_mask=torch.from_numpy(mask[0]).to(torch.uint8))

    @staticmethod
    def _tiles(processed: Any) -> tuple[Any, tuple[int, ...] | None, int]:
        """An image's pixels as its encoder takes them, its grid and its tiles' count, from its processor's output
        where its tokens were laid out with the text: Gemma 3's `[3, H, W]`, one tile; Idefics 2's tiles `[n, 3, H, W]`
        padded to the largest of them, `grid` each tile's (height, width) in turn that its pixel mask covers (the
        mask's top left: transformers' Idefics 2 image processor pads at the bottom and the right)."""
        pixels = processed["pixel_values"][0]
        mask = processed.get("pixel_attention_mask")
        if mask is None:
            return pixels, None, 1
        sizes = [(int(tile[:, 0].sum()), int(tile[0].sum())) for tile in mask[0]]
        return pixels, tuple(side for size in sizes for side in size), len(sizes)

    def _laid_out(
        self, processed: Any
    ) -> tuple[list[int], tuple[tuple[int, int], ...], Any, tuple[int, ...] | None]:
        """An image's tokens, the runs of them its embeddings go to (`ImageSpan.runs`), its pixels and grid, from its
        processor's output: LLaVA's `[3, H, W]` a token per patch; Mistral 3's a row of merged patches' tokens and a
        break (the last row an end) after each; InternVL's tiles `[n, 3, H, W]` their tokens between a start and an
        end token; the Qwen-VL processors' patches a token per merged patch of their (t, h, w) grid."""
        image_token, merge = self.spec.image_token_id, self.spec.merge_size
        pixels, grid = processed["pixel_values"], processed.get("image_grid_thw")
        if grid is not None:
            size = (int(grid[0][0]), int(grid[0][1]), int(grid[0][2]))
            return [image_token] * (size[0] * size[1] * size[2] // merge**2), (), pixels, size
        if self.spec.split_rows:  # Idefics 3's and SmolVLM's: the processor's text for its rows of tiles
            return self._split_rows(processed)
        if self.spec.encoder in PROCESSOR_LAYOUTS:  # the processor's own layout (LLaVA-NeXT's: the image's size)
            tokens = [int(t) for t in processed["input_ids"][0]]
            sizes = processed.get("image_sizes")
            original = None if sizes is None else (int(sizes[0][0]), int(sizes[0][1]))
            pixels = pixels[0] if pixels.dim() == 5 else pixels  # (LLaVA-NeXT's `[1, n, 3, H, W]`; Aya's `[n, ...]`)
            high = processed.get("high_res_pixel_values")
            if high is not None:  # (DeepSeek-VL hybrid's two views: flattened one after the other, their sides a grid)
                pixels, original = torch.cat([pixels.flatten(), high.flatten()]), (pixels.shape[-1], high.shape[-1])
            return tokens, image_runs(tokens, image_token), pixels, original
        if self.image_marks is not None:  # InternVL's: its tiles' tokens between its start and end tokens
            count = self.spec.extra_tokens * int(pixels.shape[0])
            start, end = self.image_marks
            return [start, *[image_token] * count, end], ((1, count),), pixels, None
        pixels = pixels[0]
        height, width = int(pixels.shape[-2]), int(pixels.shape[-1])
        if self.row_marks is None:
            return [image_token] * self.spec.tokens_per_image(height, width), (), pixels, None
        side = self.spec.patch_size * merge
        rows, columns = height // side, width // side
        row_break, end = self.row_marks
        tokens = [token for _ in range(rows) for token in [*[image_token] * columns, row_break]]
        tokens[-1] = end
        return tokens, tuple((row * (columns + 1), columns) for row in range(rows)), pixels, None

    def _split_rows(
        self, processed: Any
    ) -> tuple[list[int], tuple[tuple[int, int], ...], Any, tuple[int, ...] | None]:
        """Idefics 3's and SmolVLM's layout of an image split into rows x columns of tiles and a global view: the text
        their processors write (transformers' own `get_image_prompt_string`: each tile's row and column token and its
        image tokens, a line a row, the global view's last), read by the tokenizer alone (it starts and ends with a
        special token, so it reads as it would in the prompt); the image tokens' runs, one a tile."""
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        tokenizer, image_token = self.layout, self.spec.image_token_id
        text = get_image_prompt_string(
            int(processed["rows"][0][0]), int(processed["cols"][0][0]), self.spec.extra_tokens,
            getattr(tokenizer, "fake_image_token", "<fake_token_around_image>"),
            getattr(tokenizer, "image_token", "<image>"), getattr(tokenizer, "global_image_token", "<global-img>"),
        )  # fmt: skip
        tokens = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
        return tokens, image_runs(tokens, image_token), processed["pixel_values"][0], None

    def _processed_together(self, images: Sequence[PromptImage]) -> list[dict[str, Any]]:
        """LLaVA-OneVision's processor's output for a prompt's several images, an image's part each: its processor
        lays out each image of a prompt with more than one as its base view alone (padded square, one tile and its
        newline), all in one call, as transformers' processor takes the prompt's images."""
        placeholder = self.layout.tokenizer.convert_ids_to_tokens(self.spec.image_token_id)
        rgbs = [self._decoded(image) for image in images]
        out = self.layout(text=placeholder * len(images), images=[rgbs], return_tensors="pt", add_special_tokens=False)
        ids, count = out["input_ids"][0], len(images)
        each = len(ids) // count  # (every image of such a prompt takes as many tokens: a tile's and its newline)
        return [{"input_ids": ids[i * each : (i + 1) * each][None], "pixel_values": out["pixel_values"][i : i + 1],
                 "image_sizes": out["image_sizes"][i : i + 1]} for i in range(count)]  # fmt: skip

    def _processed(self, image: PromptImage) -> Any:
        """The processor's output for one image file (its first frame): `pixel_values`, and the Qwen-VL processors'
        `image_grid_thw`."""
        rgb = self._decoded(image)
        if self.spec.encoder in PROCESSOR_LAYOUTS:  # (its processor: the tiles and the placeholder's expansion alike)
            placeholder = self.spec.placeholder or self.layout.tokenizer.convert_ids_to_tokens(self.spec.image_token_id)
            return self.layout(text=placeholder, images=[rgb], return_tensors="pt", add_special_tokens=False)
        if self.spec.encoder in TEXT_LAYOUTS:  # (Idefics 2's: its tiles padded to the largest, their pixel masks)
            return self.processor(images=[[rgb]], return_tensors="pt", do_pad=True)
        if self.spec.split_rows:  # (Idefics 3's and SmolVLM's: with its rows and columns of tiles)
            return self.processor(images=[[rgb]], return_tensors="pt", return_row_col_info=True)
        if self.spec.cross_attention:  # (Llama 3.2 Vision's: its tiles, aspect ratio ids and mask, their count)
            return self.processor(images=[[rgb]], return_tensors="pt")
        if self.spec.tiles:  # (InternVL's: tiles and a thumbnail, as its processor asks)
            return self.processor(images=[rgb], return_tensors="pt", crop_to_patches=True)
        if self.row_marks is not None:  # (Pixtral's: sized to whole merged patches, as Mistral 3's processor asks)
            side = self.spec.patch_size * self.spec.merge_size
            return self.processor(images=[rgb], return_tensors="pt", patch_size=side)
        return self.processor(images=[rgb], return_tensors="pt")

    def _decoded(self, image: PromptImage) -> Any:
        """One image file's first frame as an RGB PIL image (`image_files.decoded_image`)."""
        return decoded_image(image.data, image.param, self.max_image_pixels)


def _mark_ids(marks: tuple[str, str] | None, tokenizer: Any, folder: Path) -> tuple[int, int] | None:
    """The ids of an image layout's two marking tokens (None without); ValueError where the tokenizer lacks them."""
    if marks is None:
        return None
    if tokenizer is None:
        raise ValueError(f"images with the tokens {marks} need the tokenizer for their ids")
    ids = [tokenizer.convert_tokens_to_ids(mark) for mark in marks]
    if any(not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"{folder}: the tokenizer has no {marks} tokens for its images")
    return int(ids[0]), int(ids[1])


def served_images(
    multimodal: MultimodalCheckpoint | None, folder: Path, tokenizer: Any = None,
    max_num_batched_tokens: int | None = None, tensor_parallel_size: int = 1,
) -> tuple[ImageProcessing | None, str]:  # fmt: skip
    """How the model in `folder` (its `ModelConfig.multimodal`; its `tokenizer`) reads images on an engine whose steps
    take at most `max_num_batched_tokens` over `tensor_parallel_size` ranks, and the refusal of a turn with an image
    where it reads none (`images_refusal`)."""
    refusal = images_refusal(multimodal, folder, max_num_batched_tokens, tensor_parallel_size)
    if refusal or multimodal is None or multimodal.images is None:
        return None, refusal
    return ImageProcessing.for_model(multimodal.images, folder, tokenizer), ""


def images_refusal(
    multimodal: MultimodalCheckpoint | None, folder: Path, max_num_batched_tokens: int | None = None,
    tensor_parallel_size: int = 1,
) -> str:  # fmt: skip
    """Why the model in `folder` reads no images on an engine whose steps take at most `max_num_batched_tokens` (None:
    no cap) over `tensor_parallel_size` ranks; "" where it reads them (then its vision encoder loads on rank 0:
    `engine_server.model_loading`). Llama 3.2 Vision's are read on one rank alone (its cross-attention layers run on
    rank 0's), from a float checkpoint (its cross-attention layers stored as transformers stores them)."""
    if multimodal is None:
        return "this model reads no images; send text alone"
    if multimodal.images is None:
        return f"images are not served for {multimodal.model_type} checkpoints yet (their text model is); send text"
    if not (folder / _PROCESSOR_CONFIG).is_file():
        return f"this checkpoint has no image processor ({_PROCESSOR_CONFIG}) to read images with; send text alone"
    images = multimodal.images
    if images.cross_attention and tensor_parallel_size > 1:
        return (f"images are not served for {multimodal.model_type} (Llama 3.2 Vision) checkpoints under tensor "
                "parallelism (its cross-attention layers run on one rank; other kinds' images are served under it); "
                "serve it on one rank, or send text alone")  # fmt: skip
    if images.cross_attention and _stored_quantized(folder):
        return (f"images are served for float {multimodal.model_type} (Llama 3.2 Vision) checkpoints only: this one "
                "stores its weights quantized (quantization_config), its cross-attention layers too; send text alone")
    if images.bidirectional and max_num_batched_tokens is not None and max_num_batched_tokens < images.extra_tokens:
        return (f"an image's {images.extra_tokens} tokens run in one step on this model, more than this engine's "
                f"--max-num-batched-tokens {max_num_batched_tokens}; send text alone, or raise it")  # fmt: skip
    return ""


def _stored_quantized(folder: Path) -> bool:
    """Whether the checkpoint in `folder` stores its weights quantized (its `config.json` states a
    `quantization_config`, at the top or in its text model's)."""
    import json

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return "quantization_config" in config or "quantization_config" in (config.get("text_config") or {})
