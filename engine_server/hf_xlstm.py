"""xLSTM's `config.json` (`model_type` xlstm: NX-AI's xLSTM 7B): `num_blocks` blocks, each `h += mlstm(norm(h))` then
`h += ffn(norm(h))` (`layers.mlstm`; a SwiGLU MLP `ffn_proj_factor * hidden_size` wide rounded up to
`ffn_round_up_to_multiple_of`), no attention, logits soft-capped at `output_logit_soft_cap`. `xlstm_config` gives the
rest of the reader the keys a Llama config has; `xlstm_fields` the mLSTM's shape."""

from __future__ import annotations

import math
from typing import Any

from engine_server.config import Architecture, MLstm
from engine_server.hf_mamba import MAX_POSITIONS

XLSTM_ARCHITECTURES: dict[str, Architecture] = {"xlstm": "xlstm"}


def _blocks(cfg: dict[str, Any]) -> int:
    return int(cfg.get("num_blocks") or cfg.get("num_hidden_layers") or 32)


def xlstm_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with the keys the reader takes from a Llama config (the same dict for another `model_type`): its blocks
    as layers, one attention head 2 wide that no layer reads, the MLP's width as transformers rounds it, the norms'
    epsilon from `norm_eps`. ValueError for what the layers do not build: biases (`use_bias`), no final norm
    (`add_out_norm` false), a `weight_mode` other than single or fused (`models.xlstm` splits the fused ones)."""
    if model_type not in XLSTM_ARCHITECTURES:
        return cfg
    if cfg.get("use_bias"):
        raise ValueError("xlstm with use_bias (biases on its projections and norms) is not supported")
    if cfg.get("add_out_norm") is False:
        raise ValueError("xlstm without add_out_norm is not supported")
    if (cfg.get("weight_mode") or "single") not in ("single", "fused"):
        raise ValueError(f"xlstm with weight_mode {cfg['weight_mode']!r} is not supported (single and fused are)")
    hidden = int(cfg.get("hidden_size") or cfg.get("embedding_dim") or 4096)
    multiple = int(cfg.get("ffn_round_up_to_multiple_of") or 64)
    width = math.ceil(hidden * float(cfg.get("ffn_proj_factor") or 2.667) / multiple) * multiple
    return {
        **cfg, "hidden_size": hidden, "num_hidden_layers": _blocks(cfg), "num_attention_heads": 1,
        "num_key_value_heads": 1, "head_dim": 2, "intermediate_size": width, "hidden_act": "silu",
        "rms_norm_eps": float(cfg.get("norm_eps") or 1e-6),
        "max_position_embeddings": int(cfg.get("max_position_embeddings") or MAX_POSITIONS), "rope_theta": 10000.0,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }  # fmt: skip


def xlstm_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """xLSTM's `ModelConfig` fields (`cfg` as `xlstm_config` gives it; {} for other families): every layer an mLSTM
    of `num_heads` heads, q/k `qk_dim_factor * hidden_size` wide and v `v_dim_factor * hidden_size`, its gates
    capped at `gate_soft_cap`; the logits' cap. ValueError where the widths do not split over the heads."""
    if model_type not in XLSTM_ARCHITECTURES:
        return {}
    hidden, heads = int(cfg["hidden_size"]), int(cfg.get("num_heads") or 8)
    qk, v = int(hidden * float(cfg.get("qk_dim_factor") or 0.5)), int(hidden * float(cfg.get("v_dim_factor") or 1.0))
    if qk % heads or v % heads:
        raise ValueError(f"xlstm: q/k {qk} and v {v} wide do not split over {heads} heads")
    cap = cfg.get("gate_soft_cap")
    spec = MLstm(heads=heads, qk_head_dim=qk // heads, v_head_dim=v // heads,
                 layers=tuple(range(int(cfg["num_hidden_layers"]))), gate_soft_cap=float(15.0 if cap is None else cap),
                 eps=float(cfg.get("eps") or 1e-6))  # fmt: skip
    if spec.gate_soft_cap <= 0:
        raise ValueError("xlstm: gate_soft_cap must be positive")
    logit_cap = cfg.get("output_logit_soft_cap", 30.0)
    return {"mlstm": spec, "final_logit_softcap": float(logit_cap or 0.0)}
