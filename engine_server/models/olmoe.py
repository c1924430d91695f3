"""OLMoE (OLMoE-1B-7B): Llama's block with q/k norms over the whole projection, over many small experts."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class OlmoeForCausalLM(CausalLM):
    """OLMoE: top-k of `num_experts` experts of `intermediate_size`, renormalised only with `norm_topk_prob` (the
    released checkpoints: not); q and k each normalised over all their heads at once (`qk_norm_whole`), then q, k
    and v clamped with `clip_qkv` when set; no shared expert, no dense layers. FlexOlmo (`flex_olmo`) is this under
    OLMo 2's post-norm block (`ModelConfig.post_norms`)."""
