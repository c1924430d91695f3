"""A vision encoder built from a multimodal checkpoint's `config.json` (its composite config, as transformers reads it)
and loaded with the checkpoint's tensors under the encoder's prefixes: `load_encoder`, and `CheckpointEncoder`, the
encoders' base, which names its prefixes (`parts`) and builds itself from the composite config."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from engine_server.parallel.layers import CheckpointTensor, read_whole

Encoder = TypeVar("Encoder", bound=nn.Module)


def load_encoder(
    build: Callable[[Any], Encoder],
    folder: Path,
    weights: Iterable[tuple[str, CheckpointTensor]],
    parts: tuple[str, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> Encoder:
    """`build(composite config)` of the checkpoint in `folder`, its parameters the tensors of `weights` whose names
    (transformers 5's `model.` prefix dropped: the released names) start with one of `parts`, every other passed over
    unread; in `dtype` on `device`, in eval mode. ValueError where a tensor is missing or unexpected."""
    from transformers import CONFIG_MAPPING
    from transformers.initialization import no_init_weights

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    composite = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    with no_init_weights():  # (its weights are the checkpoint's; its derived buffers, rope's, made as usual)
        encoder = build(composite)
    state = {}
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if name.startswith(parts):
            state[name] = read_whole(tensor)
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}: the vision encoder's tensors do not match: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")  # fmt: skip
    return encoder.to(device=device, dtype=dtype).eval()


class CheckpointEncoder(nn.Module, ABC):
    """A vision encoder whose parameters are the checkpoint's tensors under `parts` (transformers 5's `model.` prefix
    dropped: the released names). A subclass builds itself from the composite config (`__init__(composite)`) and
    encodes one image (`multimodal.features.ImageEncoder`)."""

    parts: ClassVar[tuple[str, ...]] = ("vision_tower.", "multi_modal_projector.")

    @classmethod
    def from_checkpoint(
        cls, folder: Path, weights: Iterable[tuple[str, CheckpointTensor]], dtype: torch.dtype, device: torch.device
    ) -> CheckpointEncoder:
        """The encoder of the checkpoint in `folder`, loaded from `weights` (the text model's passed over unread)."""
        return load_encoder(cls, folder, weights, cls.parts, dtype, device)

    @abstractmethod
    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One image's processed pixels and grid -> its tokens' embeddings (`multimodal.features.ImageEncoder`)."""

