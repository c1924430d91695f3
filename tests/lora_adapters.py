"""Random LoRA adapters saved by PEFT into a folder as a trained one is (nothing fetched), and PEFT's own model on
them: the oracle the engine's adapters must equal token for token on the float path.

PEFT initialises B to zero (an adapter that changes nothing); here A and B are both drawn so that each adapter moves
the model's greedy output well away from the base model's and from every other adapter's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def save_adapter(
    base: Path, folder: Path, targets: list[str] | str, rank: int, *, alpha: int = 16, rslora: bool = False,
    seed: int = 0, scale: float = 0.15, **settings: Any,
) -> Path:  # fmt: skip
    """A random adapter of `rank` on the `targets` modules of the model in `base` (names, or PEFT's regex over module
    paths), saved by PEFT to `folder`."""
    import peft

    from tests.families import load_reference

    model = load_reference(base)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False, **settings
    )
    wrapped = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    wrapped.save_pretrained(folder)
    return folder


def load_peft(base: Path, adapter: Path) -> Any:
    """transformers' model on `base` with PEFT's adapter from `adapter` applied unmerged, float32 on the CPU."""
    import peft

    from tests.families import load_reference

    return peft.PeftModel.from_pretrained(load_reference(base), adapter).eval()


def save_merged(base: Path, adapter: Path, folder: Path) -> Path:
    """The adapter merged into the base weights (PEFT's `merge_and_unload`), saved as a plain model with the
    base's tokenizer."""
    import shutil

    merged = load_peft(base, adapter).merge_and_unload()
    merged.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / name).is_file():
            shutil.copy(base / name, folder / name)
    return folder
