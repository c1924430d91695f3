"""Cohere's Command models (Command R / R+ as `cohere`; Command R7B and Command A as `cohere2`; Command A+ as
`cohere2_moe`): the attention and the MLP in parallel off one norm, rope over interleaved pairs, the logits scaled."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

from engine_server.models.base import reordered_tensor, text_model_weights
from engine_server.models.interleaved_rope import InterleavedRopeCausalLM
from engine_server.parallel.layers import CheckpointTensor

_SHARED_DOWN = ".mlp.shared_experts.down_proj.weight"
# A multimodal Cohere Compass checkpoint's vision tower (Qwen3-VL's), not read.
_VISION = ("model.visual.",)


class CohereForCausalLM(InterleavedRopeCausalLM):
    """Cohere (`cohere`, `cohere2`, `cohere2_moe`): each block `h += attn(ln(h)) + mlp(ln(h))`
    (`layers.decoder.ParallelDecoderLayer`) with mean-centred LayerNorms without biases (`layers.norm.LayerNorm`;
    Cohere2-MoE's may be RMSNorms), tied embeddings, the logits times `logit_scale`; rope turns interleaved pairs of
    each head, read as halves at load (`InterleavedRopeCausalLM`). Command R7B and Command A (`cohere2`) window three
    layers in four and turn no rope on the others (`ModelConfig.nope_layers`). Command A+ (`cohere2_moe`) puts experts
    in that block after its dense layers: its shared experts (`mlp.shared_experts`) are read as the shared expert,
    their down projection times `shared_expert_scale` (its "average" of routed and shared output). Cohere Compass
    (`cohere_compass_text`; `cohere_compass`, whose text model is read and vision tower not) turns halves
    (`ModelConfig.rope_halves`: its q/k rows read as they are), a rope per layer type or none (`nope_layers`)."""

    checkpoint_renames = ((".mlp.shared_experts.", ".mlp.shared_expert."),)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The shared experts' down projection scaled (where `shared_expert_scale` is not 1); q/k rows in halves
        (Cohere Compass's already are); a multimodal checkpoint's text model."""
        return super().checkpoint_weights(self._shared_scaled(text_model_weights(weights, _VISION)), replaced)

    def _shared_scaled(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        scale = self.config.shared_expert_scale
        for name, tensor in weights:
            if scale != 1.0 and name.endswith(_SHARED_DOWN):
                yield name, reordered_tensor(tensor, lambda whole: whole * scale)
            else:
                yield name, tensor
