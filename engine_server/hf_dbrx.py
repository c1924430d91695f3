"""DBRX's `config.json` (`model_type` dbrx: Databricks' DBRX Base and Instruct): its shape under names of its own
(`d_model`, `n_heads`, `n_layers`, `max_seq_len`) and two nested parts, `attn_config` (`kv_n_heads`, `clip_qkv`,
`rope_theta`) and `ffn_config` (the experts). `dbrx_config` gives the rest of the reader the keys a Mixtral config
has, with what DBRX's layers change (`models.dbrx`)."""

from __future__ import annotations

from typing import Any

from engine_server.config import Architecture
from engine_server.hf_classic import json_float

DBRX_ARCHITECTURES: dict[str, Architecture] = {"dbrx": "dbrx"}
# DBRX's LayerNorms take torch's default epsilon (its config names none).
LAYER_NORM_EPS = 1e-5


def dbrx_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with the keys the reader takes from a Mixtral config (the same dict for another `model_type`): the
    width, heads, layers and context from DBRX's names, the KV heads and `clip_qkv` from `attn_config`, the experts
    from `ffn_config` (`moe_num_experts` of `ffn_hidden_size`, `moe_top_k` of them chosen), `norm_topk_prob` where
    `moe_normalize_expert_weights` is 1 (the chosen softmax weights over their sum: an L1 norm, the released models')
    and not where it is null, LayerNorms at 1e-5.

    The rope base is `attn_config`'s `rope_theta`, as the released configs state it (500,000) and DBRX's own code,
    vLLM and llama.cpp's converter read it; only where it has none, `rope_parameters`'. (transformers 5 reads
    `rope_parameters` alone, so it runs a released config at its default base, 10,000.) ValueError for what the layers
    do not build: another activation than SiLU, a p-norm other than 1, tied embeddings."""
    if model_type not in DBRX_ARCHITECTURES:
        return cfg
    attention, ffn = cfg.get("attn_config") or {}, cfg.get("ffn_config") or {}
    activation = ffn.get("ffn_act_fn") or {"name": "silu"}
    if activation != {"name": "silu"}:
        raise ValueError(f"dbrx ffn_act_fn {activation!r} is not supported ({{'name': 'silu'}} is)")
    norm = ffn.get("moe_normalize_expert_weights", 1.0)
    if norm is not None and json_float(norm) != 1.0:
        raise ValueError(f"dbrx moe_normalize_expert_weights {norm!r} is not supported (1 and null are)")
    if cfg.get("tie_word_embeddings"):
        raise ValueError("dbrx with tie_word_embeddings is not supported (its checkpoints hold an lm_head)")
    rope = cfg.get("rope_parameters") or {}
    theta = attention.get("rope_theta") or rope.get("rope_theta") or 10000.0
    return {
        **cfg,
        "hidden_size": int(cfg.get("d_model") or 2048),
        "num_attention_heads": int(cfg.get("n_heads") or 16),
        "num_key_value_heads": int(attention.get("kv_n_heads") or 1),
        "num_hidden_layers": int(cfg.get("n_layers") or 24),
        "max_position_embeddings": int(cfg.get("max_seq_len") or 2048),
        "rope_theta": json_float(theta),
        "rope_parameters": {**rope, "rope_theta": json_float(theta)},
        "rms_norm_eps": LAYER_NORM_EPS,
        "clip_qkv": attention.get("clip_qkv"),
        "intermediate_size": int(ffn.get("ffn_hidden_size") or 3584),
        "num_local_experts": int(ffn.get("moe_num_experts") or 4),
        "num_experts_per_tok": int(ffn.get("moe_top_k") or 1),
        "norm_topk_prob": norm is not None,
        "hidden_act": "silu",
    }


def dbrx_fields(model_type: str) -> dict[str, Any]:
    """DBRX's `ModelConfig` fields beyond a Mixtral's ({} for other families): mean-centred LayerNorms with a weight and
    no bias (`layer_norm`)."""
    return {"layer_norm": True} if model_type in DBRX_ARCHITECTURES else {}
