"""RWKV-4's `config.json` (`model_type` rwkv): `num_hidden_layers` blocks of a time mix and a channel mix, no attention
(`layers.rwkv`). `rwkv_config` gives the rest of the reader the keys a Llama config has; `rwkv_fields` the blocks'
shape."""

from __future__ import annotations

from typing import Any

from engine_server.config import Architecture, Rwkv

RWKV_ARCHITECTURES: dict[str, Architecture] = {"rwkv": "rwkv"}


def rwkv_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with the keys the reader takes from a Llama config (the same dict for another `model_type`): one
    attention head 2 wide that no layer reads, the channel mix's width (`intermediate_size`, else 4 x hidden), the
    norms' epsilon from `layer_norm_epsilon`, positions from `context_length`, embeddings untied (its `head`)."""
    if model_type not in RWKV_ARCHITECTURES:
        return cfg
    hidden = int(cfg.get("hidden_size") or 4096)
    return {
        **cfg, "hidden_size": hidden, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 2,
        "intermediate_size": int(cfg.get("intermediate_size") or 4 * hidden),
        "rms_norm_eps": float(cfg.get("layer_norm_epsilon") or 1e-5),
        "max_position_embeddings": int(cfg.get("context_length") or 1024), "rope_theta": 10000.0,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }  # fmt: skip


def rwkv_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """RWKV-4's `ModelConfig` fields (`cfg` as `rwkv_config` gives it; {} for other families): every layer a block of
    `attention_hidden_size` WKV channels (else hidden), halved every `rescale_every` blocks."""
    if model_type not in RWKV_ARCHITECTURES:
        return {}
    hidden = int(cfg["hidden_size"])
    spec = Rwkv(hidden=hidden, attention_hidden=int(cfg.get("attention_hidden_size") or hidden),
                layers=tuple(range(int(cfg["num_hidden_layers"]))),
                rescale_every=int(cfg.get("rescale_every", 6) or 0))  # fmt: skip
    return {"rwkv": spec}
