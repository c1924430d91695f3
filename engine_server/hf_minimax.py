"""MiniMax-01's `config.json` (`model_type` minimax: MiniMax-Text-01, MiniMax-M1): lightning attention on most
layers and grouped-query softmax attention on the rest (`layer_types`, or the released `attn_type_list`: 1 for
softmax attention), Mixtral's experts on every layer, and its blocks' normalised, scaled residuals (transformers'
`*_alpha_factor` / `*_beta_factor`, or the released `layernorm_*_alpha` / `_beta`). `minimax_config` gives the rest
of the reader a Mixtral config's keys; `minimax_fields` the lightning layers and the residuals' scales."""

from __future__ import annotations

from typing import Any

from engine_server.config import Architecture, Lightning, NormedResiduals

MINIMAX_ARCHITECTURES: dict[str, Architecture] = {"minimax": "minimax"}
# The blocks' scales: (transformers' key, the released one), alpha then beta of each sublayer.
_SCALES = {
    "full": (("full_attn_alpha_factor", "layernorm_full_attention_alpha"),
             ("full_attn_beta_factor", "layernorm_full_attention_beta")),
    "linear": (("linear_attn_alpha_factor", "layernorm_linear_attention_alpha"),
               ("linear_attn_beta_factor", "layernorm_linear_attention_beta")),
    "mlp": (("mlp_alpha_factor", "layernorm_mlp_alpha"), ("mlp_beta_factor", "layernorm_mlp_beta")),
}  # fmt: skip


def minimax_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with its layer kinds as `layer_types` (the same dict for another `model_type`); ValueError for what
    this engine does not build: an activation other than SiLU, a sliding window, a block without its normalised
    residuals (`postnorm` false)."""
    if model_type not in MINIMAX_ARCHITECTURES:
        return cfg
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"minimax hidden_act {cfg['hidden_act']!r} is not supported (silu is)")
    if cfg.get("sliding_window") is not None:
        raise ValueError("minimax with a sliding_window is not supported")
    if cfg.get("postnorm") is False:
        raise ValueError("minimax with postnorm false is not supported (its blocks' residuals are normalised)")
    layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if kinds is None and cfg.get("attn_type_list") is not None:
        kinds = ["full_attention" if int(kind) else "linear_attention" for kind in cfg["attn_type_list"]]
    if kinds is None:  # transformers' default: softmax attention on the even layers
        kinds = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {"full_attention", "linear_attention"}:
        raise ValueError(f"minimax layer_types must name each of its {layers} layers full_attention or "
                         "linear_attention")  # fmt: skip
    return {**cfg, "layer_types": list(kinds)}


def minimax_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """MiniMax-01's lightning layers (`Lightning`), the scales of its blocks' residuals (`NormedResiduals`) and its
    Mixtral experts (top-k of the softmax, renormalised); {} for other families."""
    if model_type not in MINIMAX_ARCHITECTURES:
        return {}
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)

    def scale(key: str, released: str) -> float:
        value = cfg.get(key, cfg.get(released))
        return 1.0 if value is None else float(value)

    residuals = NormedResiduals(**{part: (scale(*alpha), scale(*beta)) for part, (alpha, beta) in _SCALES.items()})
    linear = tuple(i for i, kind in enumerate(cfg["layer_types"]) if kind == "linear_attention")
    return {
        "lightning": Lightning(heads=heads, head_dim=head_dim, layers=linear, total_layers=layers,
                               block_size=int(cfg.get("block_size") or 256)) if linear else None,
        "normed_residuals": residuals,
        "num_experts": int(cfg.get("num_local_experts") or cfg.get("num_experts") or 8),
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 2),
        "moe_intermediate_size": int(cfg["intermediate_size"]),
        "norm_topk_prob": True,
    }
