"""LLaVA's images as the text model's embeddings: a vision tower's hidden states at the feature layer(s) (without the
class token under the "default" strategy) through a two-layer projector, as transformers' `LlavaModel` computes them.

The tower and the projector are transformers' own modules (`AutoModel` of the vision config and
`LlavaMultiModalProjector`), built from the checkpoint's config and loaded with its `vision_tower.` and
`multi_modal_projector.` tensors; they run in the model's dtype on its device, apart from the text model (never
quantized, never in the decode stack).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine_server.parallel.layers import CheckpointTensor, read_whole

_PARTS = ("vision_tower.", "multi_modal_projector.")


class LlavaImageEncoder(nn.Module):
    """pixel values `[N, 3, H, W]` -> `[N, tokens, text hidden]` (`ImageInput.tokens_per_image` tokens an image)."""

    def __init__(self, composite: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.vision_tower = AutoModel.from_config(composite.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(composite)
        self.feature_layers: int | list[int] = composite.vision_feature_layer
        self.drops_class_token = composite.vision_feature_select_strategy == "default"

    @classmethod
    def from_checkpoint(
        cls, folder: Path, weights: Iterable[tuple[str, CheckpointTensor]], dtype: torch.dtype, device: torch.device
    ) -> LlavaImageEncoder:
        """The encoder of the LLaVA checkpoint in `folder` (its `config.json`), loaded from `weights` (its tensors:
        transformers 5's names, `model.vision_tower.`, or the released ones, `vision_tower.`; the text model's are
        passed over unread). ValueError where a tensor is missing or unexpected."""
        from transformers import CONFIG_MAPPING

        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        with torch.device("meta"):
            encoder = cls(CONFIG_MAPPING["llava"].from_dict(config))
        state = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith(_PARTS):
                state[name] = read_whole(tensor)
        missing, unexpected = encoder.load_state_dict(state, strict=False, assign=True)
        missing = [name for name in missing if not name.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(f"{folder}: the vision encoder's tensors do not match: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")  # fmt: skip
        encoder.vision_tower.apply(_fresh_buffers)
        return encoder.to(device=device, dtype=dtype).eval()

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, int, int] | None = None) -> torch.Tensor:
        """One image's `[3, H, W]` -> its tokens' embeddings `[tokens, text hidden]` (`ImageEncoder`)."""
        return self(pixel_values.unsqueeze(0))[0]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        layers = [self.feature_layers] if isinstance(self.feature_layers, int) else self.feature_layers
        states = [out.hidden_states[layer] for layer in layers]
        if self.drops_class_token:
            states = [state[:, 1:] for state in states]
        projected: torch.Tensor = self.multi_modal_projector(torch.cat(states, dim=-1))
        return projected


def _fresh_buffers(module: nn.Module) -> None:
    """Buffers a tower derives from its config and does not save (CLIP's `position_ids`), made again off the meta
    device."""
    for name, buffer in list(module.named_buffers(recurse=False)):
        if buffer.is_meta and name == "position_ids":
            module.register_buffer(name, torch.arange(buffer.shape[-1]).expand(buffer.shape), persistent=False)
