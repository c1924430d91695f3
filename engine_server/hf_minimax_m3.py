"""MiniMax-M3's `config.json` (`model_type` minimax_m3_vl_text; a multimodal `minimax_m3_vl` checkpoint's text model,
its vision tower not read): grouped-query attention with Gemma's q/k norms, block-sparse on the layers `layer_types`
names `minimax_m3_sparse` (or the released `sparse_attention_config.sparse_attention_freq`), over a dense MLP or
experts per layer (`mlp_layer_types`, or the released `moe_layer_freq`) routed by sigmoid scores with a bias for the
choice beside a shared expert, every MLP gpt-oss's clamped SwiGLU with gate and up in halves, every norm Gemma's
`1 + w`. `minimax_m3_config` gives the rest of the reader its text config with the dense MLP's width as
`intermediate_size`; `minimax_m3_fields` the attention's and the experts' fields."""

from __future__ import annotations

from typing import Any

from engine_server.config import Architecture, BlockSparse

MINIMAX_M3_ARCHITECTURES: dict[str, Architecture] = {"minimax_m3_vl_text": "minimax_m3", "minimax_m3_vl": "minimax_m3"}
# The released `sparse_attention_config`'s names of the indexer's fields, and transformers' (its config's defaults).
_INDEXER_KEYS = {
    "index_n_heads": ("sparse_num_index_heads", 4),
    "index_head_dim": ("sparse_index_dim", 128),
    "index_block_size": ("sparse_block_size", 128),
    "index_topk_blocks": ("sparse_topk_blocks", 16),
    "index_local_blocks": ("sparse_local_block", 1),
}
_SPARSE = "minimax_m3_sparse"


def minimax_m3_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The text config of a MiniMax-M3 `cfg` (the same dict for another `model_type`), read as transformers'
    `MiniMaxM3VLTextConfig` reads it: the indexer's fields flat, `layer_types` and `mlp_layer_types` per layer, the
    experts' width as `moe_intermediate_size` and the dense MLP's (`dense_intermediate_size`) as
    `intermediate_size`; rope's share of each head from `partial_rotary_factor`, else a `rotary_dim` narrower than a
    head (MiniMax's meaning of it; transformers reads the factor alone). ValueError for what it does not build."""
    if model_type not in MINIMAX_M3_ARCHITECTURES:
        return cfg
    if model_type == "minimax_m3_vl":
        cfg = cfg.get("text_config") or {}
    layers = int(cfg.get("num_hidden_layers", 60))
    sparse = cfg.get("sparse_attention_config") or {}
    flat = {key: cfg.get(key, sparse.get(released, default)) for key, (released, default) in _INDEXER_KEYS.items()}
    kinds = cfg.get("layer_types")
    if kinds is None and "sparse_attention_freq" in sparse:
        kinds = [_SPARSE if flag else "full_attention" for flag in sparse["sparse_attention_freq"]]
    kinds = kinds or ["full_attention"] * layers
    mlps = cfg.get("mlp_layer_types")
    if mlps is None and cfg.get("moe_layer_freq") is not None:
        mlps = ["sparse" if flag else "dense" for flag in cfg["moe_layer_freq"]]
    mlps = mlps or ["sparse"] * layers
    if len(kinds) != layers or set(kinds) - {"full_attention", _SPARSE}:
        raise ValueError(f"minimax_m3 layer_types must name each of its {layers} layers full_attention or {_SPARSE}")
    if len(mlps) != layers or set(mlps) - {"dense", "sparse"}:
        raise ValueError(f"minimax_m3 mlp_layer_types must name each of its {layers} layers dense or sparse")
    heads = int(cfg.get("num_attention_heads", 64))
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 6144)) // heads)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    share = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor")
    rotary = int(cfg.get("rotary_dim") or head_dim)
    if share is None and rotary < head_dim:
        share = rotary / head_dim
    text = {key: value for key, value in cfg.items() if key not in ("rotary_dim", "partial_rotary_factor")}
    return {
        **text, **flat, "layer_types": list(kinds), "mlp_layer_types": list(mlps), "head_dim": head_dim,
        "partial_rotary_factor": float(share or 1.0), "hidden_act": "silu",
        "moe_intermediate_size": int(cfg.get("intermediate_size", 3072)),
        "intermediate_size": int(cfg.get("dense_intermediate_size", 12288)),
        "rope_theta": float(cfg.get("rope_theta") or rope.get("rope_theta") or 5_000_000.0),
    }  # fmt: skip


def minimax_m3_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """MiniMax-M3's `ModelConfig` fields from `minimax_m3_config`'s dict: its block-sparse layers (`BlockSparse`),
    Gemma's norms, its experts (DeepSeek-V3's router in one group) and every MLP's clamped SwiGLU; {} for other
    families. ValueError where the indexer's shape does not fit the attention's."""
    if model_type not in MINIMAX_M3_ARCHITECTURES:
        return {}
    heads, head_dim = int(cfg["num_attention_heads"]), int(cfg["head_dim"])
    spec = BlockSparse(
        layers=tuple(i for i, kind in enumerate(cfg["layer_types"]) if kind == _SPARSE),
        index_heads=int(cfg["index_n_heads"]),
        index_head_dim=int(cfg["index_head_dim"]),
        block_size=int(cfg["index_block_size"]),
        topk_blocks=int(cfg["index_topk_blocks"]),
        local_blocks=int(cfg["index_local_blocks"]),
    )
    rotated = int(cfg["partial_rotary_factor"] * head_dim)
    if spec.layers and (heads % spec.index_heads or not rotated <= spec.index_head_dim <= head_dim):
        raise ValueError(f"minimax_m3: {spec.index_heads} index heads of {spec.index_head_dim} dims need to divide "
                         f"its {heads} heads and lie between rope's {rotated} dims and a head's {head_dim}")
    if spec.layers and min(spec.block_size, spec.topk_blocks) < 1:
        raise ValueError("minimax_m3: index_block_size and index_topk_blocks must be positive")
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 128)
    limit = float(cfg.get("swiglu_limit", 7.0))
    if limit <= 0:
        raise ValueError(f"minimax_m3: swiglu_limit {limit} is not served (its MLPs clamp at a positive limit)")
    return {
        "block_sparse": spec if spec.layers else None,
        "norm_offset": 1.0,
        "num_experts": experts,
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 4)),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": True,
        "shared_expert_intermediate_size": int(cfg.get("shared_intermediate_size", 3072)),
        "shared_expert_gated": False,
        "dense_layers": tuple(i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind == "dense"),
        "grouped_router": True,
        "moe_scoring": "sigmoid",
        "router_score_bias": True,
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 2.0)),
        "swiglu_limit": limit,
        "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
        "swiglu_up_offset": 1.0,
        "clamped_mlps": True,
    }
