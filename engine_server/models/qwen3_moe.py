"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms) over many small experts."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE: top-k of `num_experts` experts of `moe_intermediate_size`, renormalised with `norm_topk_prob`
    (set by the released checkpoints); no shared expert; `mlp_only_layers` stay dense. Mellum's checkpoints'
    multi-token-prediction layer (`mtp.`) is not read, as transformers reads none."""

    ignored_prefixes = ("mtp.",)

