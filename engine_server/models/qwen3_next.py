"""Qwen3-Next and Qwen3.5 (dense and mixture of experts): hybrids of Gated DeltaNet linear attention
(`layers.gated_deltanet`, three layers in four) and gated full attention, with zero-centred norms."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

from engine_server.layers.gated_deltanet import split_fused_in_proj, split_grouped_projections, split_qkv
from engine_server.models.base import CausalLM, text_model_weights
from engine_server.parallel.layers import CheckpointTensor

# What a checkpoint holds beside the text model, not read: Qwen3.5's vision tower (its multimodal checkpoints) and
# the multi-token-prediction layers both families ship.
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next (`qwen3_next`) and Qwen3.5 (`qwen3_5`, `qwen3_5_moe` and their `_text` models): a layer's token
    mixer is `GatedDeltaNet` where `ModelConfig.linear_attention` says (checkpoint `linear_attn`, read as
    `self_attn`), else attention with q/k norms, partial rope and an output gate; its MLP is dense (Qwen3.5) or a
    mixture of experts beside a sigmoid-gated shared expert (Qwen2-MoE's). A multimodal Qwen3.5 checkpoint's text
    model is served (`model.language_model.` read as `model.`); its vision tower and every checkpoint's
    multi-token-prediction layers are not read. Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba` are split into
    Qwen3.5's projections as they load, and `in_proj_qkv` into its q, k and v rows (parts that tensor parallelism
    splits by heads). Lara Mini (`lara_mini`): Qwen3's attention (no output gate, plain norms; windowed layers with
    rope, full ones without) between such layers, whose one fused `in_proj` is split into all six parts and whose
    gated norm its files call `out_norm`."""

    checkpoint_renames = ((".linear_attn.out_norm.", ".self_attn.norm."), (".linear_attn.", ".self_attn."))

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The text model's weights, Qwen3-Next's grouped projections split."""
        return super().checkpoint_weights(self._text_weights(weights), replaced)

    def _text_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        shape = self.config.linear_attention
        for name, tensor in text_model_weights(weights, _SKIPPED_PREFIXES):
            if shape is not None and name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")):
                yield from split_grouped_projections(name, tensor, shape)
            elif shape is not None and name.endswith("in_proj_qkv.weight"):
                yield from split_qkv(name, tensor, shape)
            elif shape is not None and name.endswith(".linear_attn.in_proj.weight"):  # Lara Mini's, all six parts
                yield from split_fused_in_proj(name, tensor, shape)
            else:
                yield name, tensor
