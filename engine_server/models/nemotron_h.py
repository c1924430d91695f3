"""NVIDIA's Nemotron-H (Nemotron-H, Nemotron Nano 2, Nemotron 3): hybrids of Mamba-2 (`layers.mamba2`), attention
without rope and ungated relu² MLPs or experts, one of them per checkpoint block, read as this engine's pre-norm
layers."""

from __future__ import annotations

import re

import torch

from engine_server.config import ModelConfig, nemotron_blocks
from engine_server.models.base import CausalLM
from engine_server.parallel.group import SINGLE, TensorParallel

# A block's tensor as the checkpoints name it: `backbone.layers.N.<rest>` (transformers 5 reads `backbone.` as
# `model.`, and saves it so).
_BLOCK_TENSOR = re.compile(r"(?:backbone|model)\.layers\.(?P<block>\d+)\.(?P<rest>.+)")
_GLOBAL_NAMES = {
    "embeddings.weight": "model.embed_tokens.weight",
    "norm_f.weight": "model.norm.weight",
}
# Mamba-2's per-head vectors, which its layer holds as `HeadSlice`s (`<kind>.weight`).
_HEAD_VECTORS = ("A_log", "dt_bias", "D")


class NemotronHForCausalLM(CausalLM):
    """Nemotron-H (`nemotron_h`): each checkpoint block is `h += mixer(norm(h))`, its mixer Mamba-2, attention (no
    rope) or an MLP (`down(relu(up(x))²)`). `config.nemotron_blocks` pairs a Mamba-2 or attention block with the MLP
    block after it into one layer (its norm the layer's input norm, the MLP's the post-attention norm), so layer and
    block numbers differ: `checkpoint_name` maps each block's tensors to its layer's. An "E" block (Nemotron 3's) is a
    mixture of ungated relu² experts beside a shared expert, routed as DeepSeek-V3 (`mixer.gate`); its
    multi-token-prediction layers (`mtp.`) are not read, as transformers reads none."""

    ignored_prefixes: tuple[str, ...] = ("mtp.",)

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, dtype, tp)
        self.block_places = self.blocks_in_layers(config)

    @staticmethod
    def blocks_in_layers(config: ModelConfig) -> dict[int, tuple[int, bool]]:
        """Each checkpoint block's layer, and whether it is that layer's mixer (else its MLP)."""
        places: dict[int, tuple[int, bool]] = {}
        for layer, (mixer, mlp) in enumerate(nemotron_blocks(config.block_pattern)):
            places[mixer] = (layer, True)
            if mlp is not None:
                places[mlp] = (layer, False)
        return places

    def checkpoint_name(self, name: str) -> str:
        """A block's tensor under its layer's name: its norm as the input norm (a mixer's) or the post-attention one
        (an MLP's), `mixer.` as `self_attn.` or `mlp.`; the embeddings and final norm under the shared names. A
        block the pattern lacks keeps its name (refused as unexpected)."""
        bare = name.removeprefix("backbone.").removeprefix("model.")
        if bare in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[bare]
        match = _BLOCK_TENSOR.fullmatch(name)
        if match is None or int(match["block"]) not in self.block_places:
            return name
        layer, is_mixer = self.block_places[int(match["block"])]
        rest = match["rest"]
        if rest == "norm.weight":
            rest = "input_layernorm.weight" if is_mixer else "post_attention_layernorm.weight"
        elif rest.removeprefix("mixer.") in _HEAD_VECTORS:
            rest = f"self_attn.{rest.removeprefix('mixer.')}.weight"
        elif rest.startswith("mixer.shared_experts."):  # Nemotron 3's experts' shared expert
            rest = "mlp.shared_expert." + rest.removeprefix("mixer.shared_experts.")
        elif rest.startswith("mixer."):
            rest = ("self_attn." if is_mixer else "mlp.") + rest.removeprefix("mixer.")
        return f"model.layers.{layer}.{rest}"
