"""Hunyuan (Tencent's 0.5B-7B dense models and Hunyuan-A13B): Llama's block with per-head q/k norms after rope and
rope's base stretched by NTK's alpha; the MoE's experts beside an ungated shared MLP."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class HunYuanForCausalLM(CausalLM):
    """Hunyuan dense (`hunyuan_v1_dense`) and MoE (`hunyuan_v1_moe`): its quirks are `ModelConfig`'s
    (`qk_norm_after_rope`, the rope base, the experts). Checkpoint names read as the shared layers': the q/k norms
    `query_layernorm` / `key_layernorm`, the router `mlp.gate.wg`, the shared MLP `mlp.shared_mlp`."""

    checkpoint_renames = (
        (".self_attn.query_layernorm.", ".self_attn.q_norm."),
        (".self_attn.key_layernorm.", ".self_attn.k_norm."),
        (".mlp.gate.wg.", ".mlp.gate."),
        (".mlp.shared_mlp.", ".mlp.shared_expert."),
    )
