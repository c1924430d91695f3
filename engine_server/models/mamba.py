"""State space models alone: Mamba, Falcon Mamba (Mamba-1 layers, `layers.mamba1`) and Mamba-2 (`layers.mamba2`),
every layer `h += mixer(norm(h))` with neither attention nor an MLP (`hf_mamba`)."""

from __future__ import annotations

from engine_server.config import ModelConfig
from engine_server.models.nemotron_h import NemotronHForCausalLM


class MambaForCausalLM(NemotronHForCausalLM):
    """Mamba, Falcon Mamba and Mamba-2 (`mamba`): their checkpoints name tensors as Nemotron-H's do
    (`backbone.layers.N.norm`, `backbone.layers.N.mixer.*`, `backbone.embeddings`, `backbone.norm_f`), a block a
    layer, each a mixer: its norm read as the input norm, `mixer.` as `self_attn.`, `A_log`, `D` and Mamba-2's
    `dt_bias` as the mixer's per-channel or per-head tensors."""

    ignored_prefixes: tuple[str, ...] = ()

    @staticmethod
    def blocks_in_layers(config: ModelConfig) -> dict[int, tuple[int, bool]]:
        """Block N is layer N's mixer."""
        return {layer: (layer, True) for layer in range(config.num_hidden_layers)}
