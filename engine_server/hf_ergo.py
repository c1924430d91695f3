"""Ergo's `config.json` (`model_type` ergo: Amazon's Ergo): Gemma's sandwich norms with gated residual adds,
grouped-query attention from one fused projection with per-head q/k norms, windowed layers with rope over interleaved
pairs and every `global_attention_every_n_layers`-th layer full without rope (its scores scaled where
`global_attention_scale` says), a first dense relu² MLP, then relu² experts chosen by sigmoid scores plus a bias, each
expert's output normalised with a weight of its own, beside a normalised shared relu² expert. `ergo_config` fills in
what transformers' `ErgoConfig` fills in; `ergo_fields` gives the fields of its own."""

from __future__ import annotations

from typing import Any

from engine_server.config import Architecture

ERGO_ARCHITECTURES: dict[str, Architecture] = {"ergo": "ergo"}


def ergo_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` as transformers' `ErgoConfig` reads it (the same dict for another `model_type`): its released window
    key (`local_attention_window`), layer kinds and MLP kinds filled in, its flat rope parameters the windowed
    layers' (the full ones none), heads `hidden_size / num_attention_heads` wide, the first dense MLP's width as
    `intermediate_size`. ValueError for an MLP kind other than dense or sparse."""
    if model_type not in ERGO_ARCHITECTURES:
        return cfg
    layers = int(cfg.get("num_hidden_layers", 64))
    every = int(cfg.get("global_attention_every_n_layers", 4))
    kinds = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
    ]
    dense = int(cfg.get("num_dense_blocks", 1))
    mlps = cfg.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(layers)]
    if len(mlps) != layers or set(mlps) - {"dense", "sparse"}:
        raise ValueError(f"ergo mlp_layer_types must name each of its {layers} layers dense or sparse")
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
    if "rope_type" in rope:  # flat: the windowed layers'
        rope = {"sliding_attention": rope, "full_attention": None}
    heads = int(cfg.get("num_attention_heads", 64))
    return {
        **cfg, "layer_types": list(kinds), "mlp_layer_types": list(mlps), "rope_parameters": rope,
        "sliding_window": cfg.get("sliding_window", cfg.get("local_attention_window", 512)),
        "head_dim": int(cfg.get("hidden_size", 8192)) // heads,
        "intermediate_size": int(cfg.get("first_dense_intermediate_size", 32768)),
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-12),
    }  # fmt: skip


def ergo_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Ergo's `ModelConfig` fields from `ergo_config`'s dict ({} for other families)."""
    if model_type not in ERGO_ARCHITECTURES:
        return {}
    experts, top_k = int(cfg.get("num_experts", 256)), int(cfg.get("num_experts_per_tok", 8))
    if not 1 <= top_k <= experts:
        raise ValueError(f"ergo: num_experts_per_tok {top_k} must be in [1, num_experts {experts}]")
    scale = cfg.get("global_attention_scale")
    return {
        "sandwich_norms": True,
        "residual_gates": True,
        "expert_output_norms": True,
        "full_attention_scale": 1.0 if scale is None else float(scale),
        "hidden_act": "relu2",  # (ungated: `ModelConfig.ungated_mlp`)
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size", 4096)),
        "norm_topk_prob": True,
        "shared_expert_intermediate_size": int(cfg.get("shared_intermediate_size", 8192)),
        "shared_expert_gated": False,
        "dense_layers": tuple(i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind == "dense"),
        "grouped_router": True,
        "moe_scoring": "sigmoid",
        "router_score_bias": True,
        "routed_scaling_factor": float(cfg.get("moe_routed_scaling_factor", 8**0.5)),
    }
