"""LLaVA's images as the text model's embeddings: a vision tower's hidden states at the feature layer(s) (without the
class token under the "default" strategy) through a two-layer projector, as transformers' `LlavaModel` computes them.

The tower and the projector are transformers' own modules (`AutoModel` of the vision config and
`LlavaMultiModalProjector`), built from the checkpoint's config and loaded with its `vision_tower.` and
`multi_modal_projector.` tensors; they run in the model's dtype on its device, apart from the text model (never
quantized, never in the decode stack).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine_server.multimodal.checkpoint import CheckpointEncoder


class LlavaImageEncoder(CheckpointEncoder):
    """pixel values `[N, 3, H, W]` -> `[N, tokens, text hidden]` (`ImageInput.tokens_per_image` tokens an image).
    Aya Vision's the same over an image's tiles, through its own projector (pixel shuffle, SwiGLU); ViP-LLaVA's
    through its own (a LayerNorm over its layers' features before LLaVA's two linears), the class token always
    dropped."""

    def __init__(self, composite: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.aya_vision.modeling_aya_vision import AyaVisionMultiModalProjector
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
        from transformers.models.vipllava.modeling_vipllava import VipLlavaMultiModalProjector

        projectors = {"aya_vision": AyaVisionMultiModalProjector, "vipllava": VipLlavaMultiModalProjector}
        projector: Any = projectors.get(composite.model_type, LlavaMultiModalProjector)
        self.vision_tower = AutoModel.from_config(composite.vision_config)
        self.multi_modal_projector = projector(composite)
        self.feature_layers: int | list[int] = composite.vision_feature_layer
        strategy = getattr(composite, "vision_feature_select_strategy", "default")  # (ViP-LLaVA has none: "default")
        self.drops_class_token = strategy == "default"


    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One image's `[3, H, W]` (Aya Vision's tiles `[n, 3, H, W]`) -> its tokens' embeddings `[tokens, text
        hidden]`, its tiles' in order (`ImageEncoder`)."""
        batch = pixel_values if pixel_values.dim() == 4 else pixel_values.unsqueeze(0)
        features: torch.Tensor = self(batch)
        return features.reshape(-1, features.shape[-1])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        layers = [self.feature_layers] if isinstance(self.feature_layers, int) else self.feature_layers
        states = [out.hidden_states[layer] for layer in layers]
        if self.drops_class_token:
            states = [state[:, 1:] for state in states]
        projected: torch.Tensor = self.multi_modal_projector(torch.cat(states, dim=-1))
        return projected


class Mistral3ImageEncoder(CheckpointEncoder):
    """Mistral 3's images (Mistral Small 3.1 / 3.2, Magistral Small): Pixtral's hidden states at the feature layer(s)
    of one image at its own size, through Mistral 3's projector (its norm, the patch merger's `merge_size` x
    `merge_size` patches into one, two linears), as transformers' `Mistral3Model` computes them."""

    def __init__(self, composite: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        self.vision_tower = AutoModel.from_config(composite.vision_config)
        self.multi_modal_projector = Mistral3MultiModalProjector(composite)
        self.feature_layers: int | list[int] = composite.vision_feature_layer


    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One image's `[3, H, W]` -> its merged patches' embeddings `[(H / s) * (W / s), text hidden]`, s the merged
        patches' side (`ImageEncoder`)."""
        sizes = torch.tensor([list(pixel_values.shape[-2:])], device=pixel_values.device)
        out = self.vision_tower(pixel_values.unsqueeze(0), image_sizes=sizes, output_hidden_states=True,
                                return_dict=True)  # fmt: skip
        layers = [self.feature_layers] if isinstance(self.feature_layers, int) else self.feature_layers
        states = torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)
        projected: torch.Tensor = self.multi_modal_projector(states.squeeze(0), sizes)
        return projected


class InternVLImageEncoder(CheckpointEncoder):
    """InternVL's images (InternVL 3 / 3.5 as transformers' `-hf` checkpoints): each tile through InternViT, its hidden
    states at the feature layer (without the class token under the "default" strategy) pixel-shuffled by
    `downsample_ratio` and through InternVL's projector, as transformers' `InternVLModel` computes them."""

    def __init__(self, composite: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector

        self.vision_tower = AutoModel.from_config(composite.vision_config)
        self.multi_modal_projector = InternVLMultiModalProjector(composite)
        self.feature_layer: int = composite.vision_feature_layer
        self.drops_class_token = composite.vision_feature_select_strategy == "default"
        self.downsample_ratio = float(composite.downsample_ratio)


    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One image's tiles `[n, 3, H, W]` -> their tokens' embeddings `[n * tokens a tile, text hidden]`."""
        from transformers.models.internvl.modeling_internvl import InternVLModel

        out = self.vision_tower(pixel_values=pixel_values, output_hidden_states=True, return_dict=True)
        states = out.last_hidden_state if self.feature_layer == -1 else out.hidden_states[self.feature_layer]
        if self.drops_class_token:
            states = states[:, 1:, :]
        side = int(states.shape[1] ** 0.5)
        grid_states = states.reshape(states.shape[0], side, side, -1)
        shuffle: Any = InternVLModel.pixel_shuffle  # (it reads nothing of its model)
        shuffled = shuffle(self, grid_states, scale_factor=self.downsample_ratio)
        projected: torch.Tensor = self.multi_modal_projector(shuffled.reshape(states.shape[0], -1, shuffled.shape[-1]))
        return projected.reshape(-1, projected.shape[-1])


class TiledSiglipEncoder(CheckpointEncoder):
    """Idefics 3's and SmolVLM's images: each tile (the rows x columns of the split image, then its global view)
    through their SigLIP tower and the pixel-shuffle connector (`scale_factor`), as transformers' models compute them:
    `[tiles, 3, H, W]` -> `[tiles * tokens a tile, text hidden]`, in the tiles' order."""

    parts = ("vision_model.", "connector.")

    def __init__(self, composite: Any) -> None:
        super().__init__()
        import importlib

        kind = composite.model_type
        module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
        stem = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[kind]
        self.vision_model = getattr(module, f"{stem}VisionTransformer")._from_config(composite.vision_config)
        self.connector = getattr(module, f"{stem}Connector")(composite)
        self.patch_size = int(composite.vision_config.patch_size)


    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One image's tiles `[n, 3, H, W]` (whole: no padding within one image) -> their tokens' embeddings."""
        tiles, _, height, width = pixel_values.shape
        patches = torch.ones(tiles, height // self.patch_size, width // self.patch_size, dtype=torch.bool,
                             device=pixel_values.device)  # fmt: skip
        states = self.vision_model(pixel_values=pixel_values, patch_attention_mask=patches).last_hidden_state
        features: torch.Tensor = self.connector(states)
        return features.reshape(-1, features.shape[-1])


class Idefics2ImageEncoder(CheckpointEncoder):
    """Idefics 2's images: each tile (the image, or its four quarters then itself where the processor splits it) through
    the SigLIP-like tower over the patches its pixel mask covers whole, projected and resampled by the connector's
    perceiver into `resampler_n_latents` tokens, as transformers' `Idefics2Model.get_image_features` computes them:
    `[tiles, 3, H, W]` -> `[tiles * latents, text hidden]`, in the tiles' order."""

    parts = ("vision_model.", "connector.")

    def __init__(self, composite: Any) -> None:
        super().__init__()
        from transformers.models.idefics2.modeling_idefics2 import Idefics2Connector, Idefics2VisionTransformer

        self.config = composite  # (read by transformers' `get_image_features`: the patch size)
        self.vision_model = Idefics2VisionTransformer._from_config(composite.vision_config)
        self.connector = Idefics2Connector(composite)

    @property
    def dtype(self) -> torch.dtype:
        """The encoder's dtype (transformers' `get_image_features` casts the pixels to it)."""
        return self.connector.perceiver_resampler.latents.dtype

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One image's tiles `[n, 3, H, W]` (padded at the bottom and the right to the largest) and `grid`, each tile's
        (height, width) inside that padding in turn -> their tokens' embeddings."""
        from transformers.models.idefics2.modeling_idefics2 import Idefics2Model

        tiles = pixel_values.shape[0]
        assert grid is not None and len(grid) == 2 * tiles, "an Idefics 2 image has each tile's size"
        mask = torch.zeros(tiles, *pixel_values.shape[-2:], dtype=torch.long, device=pixel_values.device)
        for tile in range(tiles):  # (the processor's pixel mask: the tile's own pixels, not its padding)
            mask[tile, : grid[2 * tile], : grid[2 * tile + 1]] = 1
        features: Any = Idefics2Model.get_image_features  # (it reads its model's config, tower and connector alone)
        out = features(self, pixel_values.unsqueeze(0), mask.unsqueeze(0), return_dict=True)
        result: torch.Tensor = out.pooler_output[0]
        return result


class LlavaNextImageEncoder(CheckpointEncoder):
    """LLaVA-NeXT's images (LLaVA 1.6): the image's tiles of its any-resolution grid and its base view through the tower
    and the projector (as LLaVA's), then laid out as transformers' `LlavaNextModel` packs them: the base view's rows,
    then the grid's unpadded to the image's aspect, `image_newline` after each row of it. LLaVA-OneVision's the same,
    packed as `LlavaOnevisionModel` packs them: a grid larger than its `vision_aspect_ratio` allows scaled down, and an
    image of a prompt with several (its base view alone) followed by one `image_newline`."""

    parts = ("vision_tower.", "multi_modal_projector.", "image_newline")

    def __init__(self, composite: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava_next.modeling_llava_next import LlavaNextMultiModalProjector
        from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionMultiModalProjector

        self.onevision = composite.model_type == "llava_onevision"
        self.config = composite  # (read by transformers' packing: the grid's pinpoints, the tower's image size)
        self.vision_tower = AutoModel.from_config(composite.vision_config)
        projector: Any = LlavaOnevisionMultiModalProjector if self.onevision else LlavaNextMultiModalProjector
        self.multi_modal_projector = projector(composite)
        self.image_newline = nn.Parameter(torch.empty(composite.text_config.hidden_size))
        self.feature_layers: int | list[int] = composite.vision_feature_layer
        self.strategy: str = composite.vision_feature_select_strategy


    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One image's tiles `[n, 3, H, W]` (its base view first; OneVision's of a prompt with several images, that
        alone) and its original (height, width) `grid` -> its tokens' embeddings."""
        from transformers.models.llava_next.modeling_llava_next import LlavaNextModel
        from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

        assert grid is not None and len(grid) == 2, "a LLaVA-NeXT image has its original size"
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        layers = [self.feature_layers] if isinstance(self.feature_layers, int) else self.feature_layers
        states = torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)
        if self.strategy == "default":
            states = states[:, 1:]
        features = self.multi_modal_projector(states)
        sizes = torch.tensor([list(grid)])
        pack: Any  # (transformers' packing, which reads its model's config alone)
        if self.onevision:
            pack = LlavaOnevisionModel.pack_image_features
            packed, _ = pack(self, [features], sizes, image_newline=self.image_newline,
                             vision_aspect_ratio=self.config.vision_aspect_ratio)  # fmt: skip
        else:
            pack = LlavaNextModel.pack_image_features
            packed, _ = pack(self, [features], sizes, self.strategy, image_newline=self.image_newline)
        result: torch.Tensor = packed[0]
        return result


class Gemma3ImageEncoder(CheckpointEncoder):
    """Gemma 3's images: SigLIP's last hidden states, average-pooled to `mm_tokens_per_image` tokens, normed and
    projected (`Gemma3MultiModalProjector`), as transformers' `Gemma3Model` computes them."""

    def __init__(self, composite: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        self.vision_tower = AutoModel.from_config(composite.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(composite)


    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One image's `[3, H, W]` -> its `mm_tokens_per_image` tokens' embeddings."""
        states = self.vision_tower(pixel_values=pixel_values.unsqueeze(0), return_dict=True).last_hidden_state
        projected: torch.Tensor = self.multi_modal_projector(states)[0]
        return projected
