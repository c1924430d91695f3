"""Random Qwen-VL checkpoints that read images, saved as transformers saves them (the benchmarks' and the tests'
models): a tower and a text model of the caller's shape, the embedded tokenizer with Qwen-VL's vision tokens added and
a parts-reading chat template, and the Qwen-VL image processor (transformers' PIL backend)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A Qwen-VL chat template over OpenAI's parts: an image where its `{"type": "image"}` part is.
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# transformers' class name stem of each kind.
QWEN_STEMS = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL", "qwen3_vl_moe": "Qwen3VLMoe"}
_MARKS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def wide_tower(name: str) -> bool:
    """Whether a Qwen-VL (or GLM-4.xV) parameter is drawn wide: the tower's and the routers'."""
    return "visual" in name or name.endswith("mlp.gate.weight")


def vision_tokenizer(folder: Path, marks: list[str], template: str) -> Any:
    """The embedded tokenizer saved in `folder` (made if missing) with `marks` added as special tokens and `template`
    as its chat template; returns it."""
    from transformers import AutoTokenizer

    from engine_server.loader import resolve_model

    folder.mkdir(parents=True, exist_ok=True)
    source = resolve_model("default").tokenizer_path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": marks})
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_drawn(
    folder: Path, model_class: Any, config: Any, wide: Callable[[str], bool], spreads: tuple[float, float]
) -> Any:
    """`model_class(config)` with its matrices drawn N(0, spreads[0]), those `wide` names N(0, spreads[1]) (seed 0),
    saved in `folder`; returns it."""
    import torch

    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, spreads[1] if wide(name) else spreads[0])
    model.save_pretrained(folder)
    return model


def save_qwen_vl(
    folder: Path, kind: str, text: dict[str, Any], vision: dict[str, Any], pixels: dict[str, Any],
    spreads: tuple[float, float] = (0.08, 0.3),
) -> Any:  # fmt: skip
    """A random `kind` checkpoint in `folder` (made if missing): `text` the text config's keys (its vocabulary grown
    to hold the vision tokens), `vision` the tower's, `pixels` the image processor's (`min_pixels`, `max_pixels`);
    matrices drawn N(0, spreads[0]), the tower's and the routers' N(0, spreads[1]). Returns transformers' model."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = vision_tokenizer(folder, _MARKS, QWEN_TEMPLATE)
    ids: Any = tokenizer.convert_tokens_to_ids(_MARKS)
    start, image, end, video = (int(i) for i in ids)
    stem = QWEN_STEMS[kind]
    config = getattr(transformers, f"{stem}Config")(
        text_config={**text, "vocab_size": max(int(text.get("vocab_size", 0)), video + 8)}, vision_config=vision,
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
    )  # fmt: skip
    model = save_drawn(folder, getattr(transformers, f"{stem}ForConditionalGeneration"), config, wide_tower, spreads)
    Qwen2VLImageProcessorPil(**pixels).save_pretrained(folder)
    return model
