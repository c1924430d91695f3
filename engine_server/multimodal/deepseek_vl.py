"""DeepSeek-VL's and Janus's images: the vision tower's last hidden states through the aligner, as transformers'
`DeepseekVLModel.get_image_features` and `JanusModel.get_image_features` compute them, a fixed number of tokens an
image (one a patch of the tower's square image: their processors' `num_image_tokens`).

The tower and the aligner are transformers' own modules, built from the checkpoint's config and loaded with its
`vision_model.` and `aligner.` tensors: DeepSeek-VL's SigLIP (`AutoModel` of the vision config) and
`DeepseekVLAligner` (two linears around a GELU); Janus's `JanusVisionModel` and `JanusVisionAlignerMLP` (its
understanding path: the image generation's VQ model, aligner and head are not read).
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
        if composite.model_type == "janus":
            from transformers.models.janus.modeling_janus import JanusVisionAlignerMLP, JanusVisionModel

            self.vision_model: Any = JanusVisionModel._from_config(composite.vision_config)
            self.aligner: Any = JanusVisionAlignerMLP(composite.vision_config)
        else:
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
