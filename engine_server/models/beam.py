"""Beam (Reflection's Beam-1.0): Gemma's sandwich blocks with depth-scaled residual adds, gated grouped-query
attention (windowed with rope, full without), DeepSeek-V3's grouped routing over many small experts."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

from engine_server.models.base import CausalLM, reordered_tensor
from engine_server.parallel.layers import CheckpointTensor

_GATE_BIAS = ".self_attn.gate_bias"


class BeamForCausalLM(CausalLM):
    """Beam (`beam`): each attention's output gate is its `gate_proj` (read as `g_proj`) plus a bias a head
    (`gate_bias`, read as `g_proj.bias`: each head's value over its `head_dim` rows); the rest under transformers'
    names (`layers.decoder.SandwichDecoderLayer` with `ModelConfig.depth_scaled_residuals`, `layers.moe`)."""

    checkpoint_renames = ((".self_attn.gate_proj.", ".self_attn.g_proj."),)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        return self._gate_biases(weights)

    def _gate_biases(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        width = self.config.head_dim
        for name, tensor in weights:
            if not name.endswith(_GATE_BIAS):
                yield name, tensor
                continue
            spread = reordered_tensor(
                tensor, lambda bias: bias.repeat_interleave(width), shape=(int(tensor.shape[0]) * width,)
            )
            yield name.removesuffix(_GATE_BIAS) + ".self_attn.g_proj.bias", spread
