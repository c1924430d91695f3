"""OLMo 2 (OLMo-2-1124-7B/13B, OLMo-2-0325-32B): norms after the attention and the MLP, q/k norms over the whole
projection."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class Olmo2ForCausalLM(CausalLM):
    """OLMo 2: Llama's projections under the post-norm block (`layers.decoder.PostNormDecoderLayer`: its
    `post_attention_layernorm` normalises the attention's output, not the MLP's input) and q and k each normalised
    over all their heads at once (`qk_norm_whole`, so tensor parallelism is refused as for OLMoE)."""
