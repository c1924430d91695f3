"""DeepSeek-VL's images: its SigLIP tower's last hidden states through its aligner (two linears around a GELU), as
transformers' `DeepseekVLModel.get_image_features` computes them, a fixed number of tokens an image (one a patch of the
tower's square image: its processor's `num_image_tokens`).

The tower and the aligner are transformers' own modules (`AutoModel` of the vision config, `DeepseekVLAligner`), built
from the checkpoint's config and loaded with its `vision_model.` and `aligner.` tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from engine_server.multimodal.checkpoint import CheckpointEncoder


class DeepseekVLImageEncoder(CheckpointEncoder):
    """pixel values `[1, 3, S, S]` (its processor's square image) -> `[(S / patch)², text hidden]`."""

    parts = ("vision_model.", "aligner.")

    def __init__(self, composite: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.deepseek_vl.modeling_deepseek_vl import DeepseekVLAligner

        self.vision_model = AutoModel.from_config(composite.vision_config)
        self.aligner = DeepseekVLAligner(composite)

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One image's `[1, 3, S, S]` (or `[3, S, S]`) -> its tokens' embeddings `[tokens, text hidden]`."""
        batch = pixel_values if pixel_values.dim() == 4 else pixel_values.unsqueeze(0)
        states = self.vision_model(batch, return_dict=True).last_hidden_state
        features: torch.Tensor = self.aligner(states)
        return features.reshape(-1, features.shape[-1])
