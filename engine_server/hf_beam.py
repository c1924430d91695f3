"""Beam's `config.json` (`model_type` beam: Reflection's Beam-1.0): Gemma's sandwich norms with residual adds scaled
by depth, grouped-query attention with per-head q/k norms and a sigmoid gate on each head's output, windowed layers
with rope and full ones without (their queries scaled by position), a few dense MLPs then DeepSeek-V3's grouped,
bias-chosen sigmoid routing without shared experts, soft-capped logits. `beam_config` fills in what transformers'
`BeamConfig` fills in (layer kinds, MLP kinds, rope per layer kind); `beam_fields` gives the fields of its own."""

from __future__ import annotations

from typing import Any

from engine_server.config import Architecture

BEAM_ARCHITECTURES: dict[str, Architecture] = {"beam": "beam"}
# transformers' scalable-softmax query scale on its NoPE layers, `(1 + (p + 1) / 2048) ** 0.1` (fixed, not config)
_NOPE_QUERY_POWER, _NOPE_QUERY_POSITIONS = 0.1, 2048


def beam_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with transformers' defaults filled in (the same dict for another `model_type`): every sixth layer and
    the last full attention, the others windowed; three dense MLPs, then experts; rope (base 10,000) on the windowed
    layers alone. ValueError for an MLP kind other than dense or sparse."""
    if model_type not in BEAM_ARCHITECTURES:
        return cfg
    layers = int(cfg.get("num_hidden_layers", 52))
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
        kinds[-1] = "full_attention"
    mlps = cfg.get("mlp_layer_types")
    if mlps is None:
        dense = min(3, layers)
        mlps = ["dense"] * dense + ["sparse"] * (layers - dense)
    if len(mlps) != layers or set(mlps) - {"dense", "sparse"}:
        raise ValueError(f"beam mlp_layer_types must name each of its {layers} layers dense or sparse")
    rope = cfg.get("rope_parameters")
    if rope is None:
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": None}
    return {**cfg, "layer_types": list(kinds), "mlp_layer_types": list(mlps), "rope_parameters": rope,
            "sliding_window": cfg.get("sliding_window", 512)}  # fmt: skip


def beam_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Beam's `ModelConfig` fields from `beam_config`'s dict ({} for other families): its blocks, gate, query scale,
    logits' cap and experts. ValueError for experts that do not split into its groups."""
    if model_type not in BEAM_ARCHITECTURES:
        return {}
    experts, top_k = int(cfg.get("num_experts", 256)), int(cfg.get("num_experts_per_tok", 8))
    groups, top_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if experts % groups or not 1 <= top_groups <= groups or not 1 <= top_k <= experts:
        raise ValueError(f"beam: {top_k} of {experts} experts in {groups} groups, {top_groups} of them chosen")
    return {
        "sandwich_norms": True,
        "depth_scaled_residuals": True,
        "attention_sigmoid_gate": True,
        "nope_query_power": _NOPE_QUERY_POWER,
        "nope_query_positions": _NOPE_QUERY_POSITIONS,
        "final_logit_softcap": float(cfg.get("final_logit_softcapping") or 0.0),
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size", 2560)),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "dense_layers": tuple(i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind == "dense"),
        "grouped_router": True,
        "moe_scoring": "sigmoid",
        "router_score_bias": True,
        "moe_groups": groups,
        "moe_topk_groups": top_groups,
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 2.5)),
    }
