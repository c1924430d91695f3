"""OLMo 2 (OLMo-2-1124-7B/13B, OLMo-2-0325-32B) and OLMo 3: norms after the attention and the MLP, q/k norms over
the whole projection; OLMo 3 adds windowed layers (its `layer_types`) with a rope of their own. EXAONE 4.0 is this
block with per-head q/k norms and no rope on its global layers, and EXAONE 4.5's text model EXAONE 4.0's."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from engine_server.models.base import CausalLM, text_model_weights
from engine_server.parallel.layers import CheckpointTensor

# What a multimodal EXAONE 4.5 checkpoint holds beside its text model, not read: its vision tower and merger.
_VISION = ("model.visual.", "visual.")


class Olmo2ForCausalLM(CausalLM):
    """OLMo 2: Llama's projections under the post-norm block (`layers.decoder.PostNormDecoderLayer`: its
    `post_attention_layernorm` normalises the attention's output, not the MLP's input) and q and k each normalised
    over all their heads at once (`qk_norm_whole`, so tensor parallelism is refused as for OLMoE). OLMo 3
    (`olmo3`) is this class too: its windows and its rope per layer type (the full-attention layers' YaRN, the
    windowed ones' plain base, `ModelConfig.local_rope_theta`) are read from its config. EXAONE 4 (`exaone4`) is
    this class too, its q/k norms per head (`qk_norm`, not `qk_norm_whole`) and its global layers NoPE
    (`nope_layers`); EXAONE 4.5's multimodal checkpoint is read as its EXAONE 4.0 text model's (`text_model_weights`),
    its vision tower left out."""

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The text model's weights."""
        return super().checkpoint_weights(text_model_weights(weights, _VISION), replaced)
