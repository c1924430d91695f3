"""Families served in GLM-4.5's layout (`glm4_moe`: DeepSeek-V3's experts and router under grouped-query attention,
`models.glm4_moe`) whose configs are read first here: BharatGen's Param2 (`param2moe`: GLM-4.5's model, rope over
whole heads, under its original configs' names and its own defaults) and OpenBMB's MiniCPM5-MoE (`minicpm5_moe`:
Llama's attention, no q/k norms, each query dim's output gated by the sigmoid of its own `q_gate_proj` row)."""

from __future__ import annotations

from typing import Any

from engine_server.config import Architecture

GLM4_MOE_KIN: dict[str, Architecture] = {"param2moe": "glm4_moe", "minicpm5_moe": "glm4_moe"}
# Param2's original configs' names for GLM-4.5's keys (transformers' `attribute_map` for them).
_PARAM2_NAMES = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts",
                 "use_qkv_bias": "attention_bias", "num_mtp_layers": "num_nextn_predict_layers"}  # fmt: skip
# What transformers fills in where a config leaves a key out, for the keys whose absence the reader would read
# otherwise (its GLM-4.5 defaults: untied, no q/k norms, no shared experts, scaling 1, base 10,000, no dense layer,
# no end-of-sequence token).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "param2moe": {"tie_word_embeddings": True, "use_qk_norm": True, "n_shared_experts": 2, "routed_scaling_factor": 2.5,
                  "first_k_dense_replace": 1, "rope_theta": 500_000.0, "eos_token_id": 3},
    "minicpm5_moe": {"n_shared_experts": 1, "routed_scaling_factor": 3.66, "first_k_dense_replace": 1,
                     "rope_theta": 5_000_000.0, "bos_token_id": 0, "eos_token_id": [1, 130073]},
}  # fmt: skip


def glm4_moe_kin_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` as the reader takes a GLM-4.5 config (the same dict for another `model_type`): Param2's original names
    read as GLM-4.5's, and each family's transformers defaults where its config leaves a key out (the rope base only
    where neither `rope_theta` nor `rope_parameters` states one). ValueError for a MiniCPM5-MoE without its gated
    attention (`use_gated_attention` false: transformers refuses it too)."""
    if model_type not in GLM4_MOE_KIN:
        return cfg
    if model_type == "minicpm5_moe" and cfg.get("use_gated_attention") is False:
        raise ValueError("minicpm5_moe with use_gated_attention false is not supported (its attention is gated)")
    renamed = {_PARAM2_NAMES.get(key, key) if model_type == "param2moe" else key: value for key, value in cfg.items()}
    defaults = dict(_DEFAULTS[model_type])
    if renamed.get("rope_parameters"):
        defaults.pop("rope_theta")
    return {**defaults, **renamed}


def glm4_moe_kin_fields(model_type: str) -> dict[str, Any]:
    """The `ModelConfig` fields these families add to GLM-4.5's ({} for any other): MiniCPM5-MoE's output gate
    (`attention_output_gate`: its `q_gate_proj` holds each head's query rows, then its gate's, as the layer's
    `q_proj` holds them)."""
    return {"attention_output_gate": True} if model_type == "minicpm5_moe" else {}
