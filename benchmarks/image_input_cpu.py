"""Images as input on the CPU: a random Qwen2.5-VL checkpoint (a 0.5B-class text model, Qwen2.5-0.5B's shape, beside
an 8-layer tower; images of 448 x 448 pixels, 256 tokens each) served by the engine, on the float path and on its int8
default, and by transformers' own model in the same run: one request (an image and a question, 64 new tokens) start to
end and to its first token, and 4 such requests with different images at once (the engine batches them; transformers
runs them one after another, as its `generate` takes one conversation at a time here). The float path's greedy tokens
must equal transformers' (the script fails otherwise).

    PYTHONPATH=. .venv/bin/python -m benchmarks.image_input_cpu --out benchmarks/results/image_input_cpu.jsonl
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import media_input
from benchmarks.common import append_result
from benchmarks.vl_checkpoints import QWEN_TEMPLATE, save_qwen_vl

NEW = 64
SIDE = 448  # pixels: 32 x 32 patches of 14, merged 2 x 2 into 256 tokens
TEXT = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}}  # fmt: skip
TOWER = {"depth": 8, "hidden_size": 640, "intermediate_size": 1728, "num_heads": 10, "out_hidden_size": 896,
         "window_size": 112, "fullatt_block_indexes": [3, 7]}  # fmt: skip
PIXELS: dict[str, Any] = {"min_pixels": SIDE * SIDE, "max_pixels": SIDE * SIDE}
QUESTION = "Describe this picture in detail, then say what stands out in it."


def picture(seed: int) -> bytes:
    """A random SIDE x SIDE picture as a PNG file."""
    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def prompt(image: bytes) -> Any:
    """The benchmark's chat: the image, then the question."""
    from engine_server.frontend import ChatPrompt
    from engine_server.tokenizer.chat import ChatImage, ChatMessage

    return ChatPrompt([ChatMessage("user", content_parts=(ChatImage(image), QUESTION))])


def transformers_run(folder: Path, images: list[bytes]) -> dict[str, Any]:
    """transformers' timings over `images` (`media_input.transformers_run`)."""
    import torch
    import transformers
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImagesOnly(transformers.Qwen2VLProcessor):  # (its video processor would need torchvision)
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> type:
            return type(argument)

    processor = ImagesOnly(Qwen2VLImageProcessorPil(**PIXELS), AutoTokenizer.from_pretrained(folder),
                           video_processor=None, chat_template=QWEN_TEMPLATE)  # fmt: skip
    model: Any = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    turn: Any = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)

    def generate(image: bytes, new: int) -> list[int]:
        inputs = processor(text=text, images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt",
                           add_special_tokens=False)  # fmt: skip
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return [int(t) for t in out[0, inputs["input_ids"].shape[1] :]]

    return media_input.transformers_run(generate, images, picture(99), NEW)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4, help="requests at once, each with its own image")
    parser.add_argument("--out", type=Path, help="append the results to this JSONL file")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.image_input_cpu" + (f" --out {args.out}" if args.out else "")
    images = [picture(seed) for seed in range(args.requests)]
    with tempfile.TemporaryDirectory() as root:
        folder = Path(root) / "qwen2_5_vl"
        save_qwen_vl(folder, "qwen2_5_vl", TEXT, TOWER, PIXELS, spreads=(0.05, 0.05))
        peer = transformers_run(folder, images)
        runs = media_input.compared_runs(folder, peer, [prompt(image) for image in images], prompt(picture(99)), NEW)
    if runs is None:
        return 1
    result = media_input.result_record(
        "image_input_cpu", command, runs, args.requests, NEW, model="qwen2_5_vl", text_shape=TEXT, tower_shape=TOWER,
        weights="random", image_pixels=[SIDE, SIDE],
    )  # fmt: skip
    print(result)
    if args.out:
        append_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
