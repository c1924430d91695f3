"""DeepSeek-VL's, Janus's and DeepSeek-VL hybrid's images: the vision tower's last hidden states through the aligner
(the hybrid's with its SAM tower's beside), as transformers' `get_image_features` of their models compute them, a
fixed number of tokens an image (one a patch of the tower's square image: their processors' `num_image_tokens`).

The tower and the aligner are transformers' own modules, built from the checkpoint's config and loaded with its
`vision_model.` and `aligner.` tensors: DeepSeek-VL's SigLIP (`AutoModel` of the vision config) and
`DeepseekVLAligner` (two linears around a GELU); Janus's `JanusVisionModel` and `JanusVisionAlignerMLP` (its
understanding path: the image generation's VQ model, aligner and head are not read); DeepSeek-VL hybrid's SigLIP and
SAM towers, SAM's neck and projection (its `high_res_vision_` tensors) and `DeepseekVLHybridAligner`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

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


class DeepseekVLHybridImageEncoder(CheckpointEncoder):
    """DeepSeek-VL hybrid's images (DeepSeek-VL 7B): the image's low-resolution view through SigLIP and its
    high-resolution view through SAM (its last hidden states and those of its first global-attention layer through
    the neck, each resized to the low-resolution grid by the projection's convolutions, the second scaled by
    `high_res_vision_alpha`), both through the hybrid aligner, as transformers' `DeepseekVLHybridModel` computes them:
    one token a patch of the low-resolution view. Its pixel values carry both views flattened one after the other, their
    sides its grid (`multimodal.processing`)."""

    parts = ("vision_model.", "aligner.", "high_res_vision_model.", "high_res_vision_neck.", "high_res_vision_proj.",
             "high_res_vision_alpha")  # fmt: skip

    def __init__(self, composite: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.deepseek_vl_hybrid import modeling_deepseek_vl_hybrid as hybrid

        high = composite.high_res_vision_config
        # (the names and the index transformers' `get_high_res_image_features` reads)
        self.global_attn_index = int(high.global_attn_indexes[0])
        self.vision_model = AutoModel.from_config(composite.vision_config)
        self.high_res_vision_model = AutoModel.from_config(high)
        self.high_res_vision_neck = hybrid.DeepseekVLSamVisionNeck(high)
        side = int(composite.vision_config.image_size) // int(composite.vision_config.patch_size)
        self.high_res_vision_proj = hybrid.DeepseekVLSamVisionProj(high, output_size=side)
        self.high_res_vision_alpha = nn.Parameter(torch.zeros(1))
        self.aligner = hybrid.DeepseekVLHybridAligner(composite)

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One image's two views flattened `[3 * L² + 3 * H²]` and their sides `grid` (L, H) -> its tokens'
        embeddings `[(L / patch)², text hidden]`."""
        from transformers.models.deepseek_vl_hybrid.modeling_deepseek_vl_hybrid import DeepseekVLHybridModel

        assert grid is not None and len(grid) == 2, "a DeepSeek-VL hybrid image has its two views' sides"
        low_side, high_side = grid
        low = pixel_values[: 3 * low_side**2].view(1, 3, low_side, low_side)
        high = pixel_values[3 * low_side**2 :].view(1, 3, high_side, high_side)
        states = self.vision_model(low, return_dict=True).last_hidden_state
        high_res: Any = DeepseekVLHybridModel.get_high_res_image_features  # (it reads the modules named as here)
        high_states = high_res(self, high).last_hidden_state
        features: torch.Tensor = self.aligner(states, high_states)
        return features.reshape(-1, features.shape[-1])
