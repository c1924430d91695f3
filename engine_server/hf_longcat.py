"""LongCat-Flash's `config.json` (`model_type` longcat_flash: Meituan's LongCat-Flash-Chat, -Thinking, -Lite):
each of its `num_layers` layers is two blocks of DeepSeek-V3's latent attention and a dense MLP with one mixture of
experts beside them (its shortcut, ScMoE), whose router also picks "zero-computation" experts that pass their input
through. `longcat_config` gives the rest of the reader a DeepSeek-V3 config's keys, one of this engine's layers per
block (`num_hidden_layers` twice `num_layers`); `longcat_fields` the experts (`models.longcat_flash`)."""

from __future__ import annotations

from typing import Any

from engine_server.config import Architecture

LONGCAT_ARCHITECTURES: dict[str, Architecture] = {"longcat_flash": "longcat_flash"}


def longcat_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with DeepSeek-V3's keys for LongCat-Flash's shape (the same dict for another `model_type`): a layer per
    block, the blocks' dense width (`ffn_hidden_size`), the experts' (`expert_ffn_hidden_size`), `moe_topk` of them a
    token, rope dims in interleaved pairs; ValueError for an activation other than SiLU, a biased router, latents
    without their LoRA scales or zero-computation experts other than the identity."""
    if model_type not in LONGCAT_ARCHITECTURES:
        return cfg
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"longcat_flash hidden_act {cfg['hidden_act']!r} is not supported (silu is)")
    if cfg.get("router_bias"):
        raise ValueError("longcat_flash with router_bias is not supported")
    # (the released configs' flags of what transformers always does: the latents' LoRA scales, identity experts)
    for flag in ("mla_scale_q_lora", "mla_scale_kv_lora"):
        if cfg.get(flag) is False:
            raise ValueError(f"longcat_flash with {flag} false is not supported")
    if cfg.get("zero_expert_type", "identity") != "identity":
        raise ValueError(f"longcat_flash zero_expert_type {cfg['zero_expert_type']!r} is not supported (identity is)")
    # (transformers' `num_hidden_layers` sets `num_layers` to its half, after it: it wins where both are given)
    blocks = cfg.get("num_hidden_layers")
    layers = int(blocks) // 2 if blocks is not None else int(cfg.get("num_layers", 28))
    # (transformers reads `intermediate_size`, `moe_intermediate_size`, `num_experts_per_tok` and
    # `num_local_experts` as other names of its own keys, and before them)
    return {
        **cfg,
        "num_hidden_layers": 2 * layers,
        "intermediate_size": int(_either(cfg, "intermediate_size", "ffn_hidden_size", 12288)),
        "moe_intermediate_size": int(_either(cfg, "moe_intermediate_size", "expert_ffn_hidden_size", 2048)),
        "num_experts_per_tok": int(_either(cfg, "num_experts_per_tok", "moe_topk", 12)),
        "n_routed_experts": int(_either(cfg, "num_local_experts", "n_routed_experts", 512)),
        "rope_interleave": True,
    }


def _either(cfg: dict[str, Any], alias: str, key: str, default: int) -> Any:
    """`cfg[alias]` where given, else `cfg[key]`, else `default` (transformers' `attribute_map` order)."""
    return cfg[alias] if cfg.get(alias) is not None else cfg.get(key, default)


def longcat_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """LongCat-Flash's experts (after `longcat_config`): `n_routed_experts` beside `zero_expert_num` that pass their
    input through, chosen by softmax score (over both kinds) plus a bias, weighted by their scores (not
    renormalised) times `routed_scaling_factor`, no shared expert, run beside each pair of blocks
    (`shortcut_experts`); {} for other families."""
    if model_type not in LONGCAT_ARCHITECTURES:
        return {}
    return {
        "num_experts": int(cfg["n_routed_experts"]),
        "zero_experts": int(cfg.get("zero_expert_num") or 0),
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": False,
        "grouped_router": True,
        "moe_scoring": "softmax",
        "router_score_bias": True,
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 6.0)),
        "shortcut_experts": True,
    }
