"""The models' own processors that lay an image's tokens out in the prompt (transformers' `LlavaNextProcessor`,
`AyaVisionProcessor`, `Idefics2Processor`, ...), built over the checkpoint's PIL image processor and its tokenizer
without the video processors that would need torchvision, and the runs of image tokens in what they lay out."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from engine_server.config import ImageInput

# The kinds whose own processor lays an image's tokens out (`layout_processor`).
PROCESSOR_LAYOUTS = (
    "llava_next", "llava_next_video", "llava_onevision", "aya_vision", "deepseek_vl", "janus", "deepseek_vl_hybrid",
)
# The kinds whose own processor lays the images out in the whole prompt's text (`ImageProcessing.prompt_ids`):
# Idefics 2's (adjacent images share the `<fake_token_around_image>` between them; text right after one starts with
# a space).
TEXT_LAYOUTS = ("idefics2",)
# The processors of the kinds whose image is a fixed number of tokens (`ImageInput.extra_tokens`).
_FIXED_COUNT_PROCESSORS = {"deepseek_vl": "DeepseekVLProcessor", "janus": "JanusProcessor",
                           "deepseek_vl_hybrid": "DeepseekVLHybridProcessor"}  # fmt: skip


def layout_processor(spec: ImageInput, image_processor: Any, tokenizer: Any) -> Any:
    """The model's own processor, which lays an image's tokens out (`PROCESSOR_LAYOUTS`, `TEXT_LAYOUTS`), over its
    PIL image processor and `tokenizer`, its sizes the model's: LLaVA-NeXT's and LLaVA-OneVision's (as many tokens as
    its tiles unpad to; OneVision's without its video processor, which needs torchvision), Aya Vision's (tiles of
    `<|IMG_PATCH|>` tokens after their tile tokens, then the global view's), Idefics 2's (`<fake_token_around_image>`,
    `extra_tokens` image tokens a tile, `<fake_token_around_image>`; over a copy of the tokenizer, to which it adds its
    tokens: ValueError where the tokenizer lacks any), DeepSeek-VL's (`extra_tokens` image tokens an image; its
    tokenizer names its image token, `tokenizer.image_token`, else ValueError), DeepSeek-VL hybrid's (the same),
    Janus's (the same between its `tokenizer.boi_token` and `tokenizer.eoi_token`)."""
    import transformers

    if spec.encoder == "idefics2":
        own = copy.deepcopy(tokenizer)
        processor = transformers.Idefics2Processor(image_processor, own, image_seq_len=spec.extra_tokens)
        if len(own) != len(tokenizer):
            raise ValueError("the tokenizer lacks Idefics 2's tokens (<fake_token_around_image>, <image>, "
                             "<end_of_utterance>) for its images")  # fmt: skip
        return processor
    if spec.encoder in ("llava_next", "llava_next_video"):  # (LLaVA-NeXT-Video's images are LLaVA-NeXT's)
        return transformers.LlavaNextProcessor(
            image_processor, tokenizer, patch_size=spec.patch_size, vision_feature_select_strategy="full",
            num_additional_image_tokens=spec.extra_tokens,
        )  # fmt: skip
    if spec.encoder in _FIXED_COUNT_PROCESSORS:
        names = ("image_token", "boi_token", "eoi_token") if spec.encoder == "janus" else ("image_token",)
        if any(getattr(tokenizer, name, None) is None for name in names):  # (its processor reads them by these names)
            raise ValueError(f"{spec.encoder} images need a tokenizer that names its {', '.join(names)}")
        processor = getattr(transformers, _FIXED_COUNT_PROCESSORS[spec.encoder])
        return processor(image_processor, tokenizer, num_image_tokens=spec.extra_tokens)
    if spec.encoder == "llava_onevision":

        class ImagesOnly(transformers.LlavaOnevisionProcessor):  # (no video processor: it needs torchvision)
            def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> type:
                return type(argument)

        return ImagesOnly(
            image_processor, tokenizer, video_processor=None, num_image_tokens=spec.extra_tokens,
            vision_feature_select_strategy="full", vision_aspect_ratio=spec.vision_aspect_ratio,
        )  # fmt: skip
    side = int(image_processor.size["height"])  # (Aya Vision's tiles: the tower's image size)
    return transformers.AyaVisionProcessor(image_processor, tokenizer, img_size=side,
                                           patch_size=spec.patch_size * spec.merge_size)  # fmt: skip


def image_runs(tokens: Sequence[int], image_token: int) -> tuple[tuple[int, int], ...]:
    """The runs (offset, length) of `image_token` in an image's `tokens`."""
    runs, start = [], None
    for index, token in enumerate([*tokens, -1]):
        if token == image_token and start is None:
            start = index
        elif token != image_token and start is not None:
            runs.append((start, index - start))
            start = None
    return tuple(runs)
