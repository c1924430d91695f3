"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's images: their towers (transformers' own modules, over a processed image's
patches and its grid, merged into one token per `merge_size` x `merge_size` patches; Qwen3-VL's DeepStack features of
inner layers beside) and the 3-D M-RoPE positions of a prompt with images, as transformers' `get_rope_index` lays them
out for still images."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine_server.multimodal.checkpoint import CheckpointEncoder
from engine_server.multimodal.inputs import ImageSpan

# The tower's class in transformers, by model type.
_TOWERS = {
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel"),
    "qwen3_vl_moe": ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeVisionModel"),
    "glm4v": ("transformers.models.glm4v.modeling_glm4v", "Glm4vVisionModel"),
    "glm4v_moe": ("transformers.models.glm4v_moe.modeling_glm4v_moe", "Glm4vMoeVisionModel"),
    "glm46v": ("transformers.models.glm4v.modeling_glm4v", "Glm4vVisionModel"),
}


class QwenVisionEncoder(CheckpointEncoder):
    """One image's patches `[patches, C * T * P * P]` and grid -> `[patches / merge_size², text hidden]`."""

    parts = ("visual.",)

    def __init__(self, composite: Any) -> None:
        super().__init__()
        import importlib

        module, name = _TOWERS[composite.model_type]
        tower_class = getattr(importlib.import_module(module), name)
        self.visual = tower_class._from_config(composite.vision_config)

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One image's patches -> its tokens' embeddings (`ImageEncoder`)."""
        assert grid is not None and len(grid) == 3, "a Qwen-VL image has its (t, h, w) grid"
        return self(pixel_values, grid)

    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        """`[tokens, text hidden]`; Qwen3-VL's `[tokens, text hidden * (1 + DeepStack layers)]`: each token's
        embedding, then its DeepStack features in layer order (`ImageInput.deepstack_layers`)."""
        grid_thw = torch.tensor([grid], device=pixel_values.device)
        out = self.visual(pixel_values, grid_thw=grid_thw)
        deepstack = getattr(out, "deepstack_features", None) or []
        merged: torch.Tensor = torch.cat([out.pooler_output, *deepstack], dim=-1) if deepstack else out.pooler_output
        return merged


def mrope_positions(num_tokens: int, images: Sequence[ImageSpan], merge_size: int) -> tuple[torch.Tensor, int]:
    """The (temporal, height, width) rope positions `[3, num_tokens]` of a prompt with `images` (their runs and grids)
    and its position delta (`MultimodalInputs.position_delta`)."""
    pieces = []
    done = current = 0
    for image in images:
        assert image.grid is not None, "a Qwen-VL image has its grid"
        pieces.append(torch.arange(image.offset - done).expand(3, -1) + current)
        current += image.offset - done
        frames, rows, columns = image.grid[0], image.grid[1] // merge_size, image.grid[2] // merge_size
        grid = torch.stack(torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(columns),
                                          indexing="ij"))  # fmt: skip
        pieces.append(grid.reshape(3, -1) + current)
        current += max(rows, columns)
        done = image.end
    pieces.append(torch.arange(num_tokens - done).expand(3, -1) + current)
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 - num_tokens
