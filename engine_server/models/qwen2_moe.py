"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention, experts plus a sigmoid-gated shared expert."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class Qwen2MoeForCausalLM(CausalLM):
    """Qwen2-MoE: q/k/v biases (`qkv_bias`), top-k routing without renormalisation unless `norm_topk_prob`, a
    shared expert of `shared_expert_intermediate_size` in every sparse layer; `mlp_only_layers` stay dense."""

