"""JetMoE's `config.json` (`model_type` jetmoe: JetMoE-8B): a mixture of attention experts and one of MLP experts in
every layer (`layers.mixture_of_attention`, `layers.moe`), each routed by softmax over its `num_experts_per_tok` best
logits, each mixture's output biased. `jetmoe_config` gives the rest of the reader its keys as transformers reads
them; `jetmoe_fields` the fields of its own."""

from __future__ import annotations

from typing import Any

from engine_server.config import Architecture

JETMOE_ARCHITECTURES: dict[str, Architecture] = {"jetmoe": "jetmoe"}


def jetmoe_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` as transformers' `JetMoeConfig` reads it (the same dict for another `model_type`): heads `kv_channels`
    wide, `num_key_value_heads * num_experts_per_tok` query heads (each chosen expert's queries over every KV head),
    its norms' epsilon 1e-6 whatever `rms_norm_eps` says (its modeling file's `JetMoeRMSNorm` default). ValueError for
    an activation other than SiLU."""
    if model_type not in JETMOE_ARCHITECTURES:
        return cfg
    activation = cfg.get("activation_function") or cfg.get("hidden_act") or "silu"
    if activation != "silu":
        raise ValueError(f"jetmoe activation_function {activation!r} is not supported (silu is)")
    kv_heads, top_k = int(cfg.get("num_key_value_heads", 16)), int(cfg.get("num_experts_per_tok", 2))
    return {**cfg, "head_dim": int(cfg.get("kv_channels", 128)), "num_attention_heads": kv_heads * top_k,
            "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-6, "hidden_act": "silu"}  # fmt: skip


def jetmoe_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """JetMoE's `ModelConfig` fields from `jetmoe_config`'s dict ({} for other families)."""
    if model_type not in JETMOE_ARCHITECTURES:
        return {}
    experts, top_k = int(cfg.get("num_local_experts", 8)), int(cfg.get("num_experts_per_tok", 2))
    if not 1 <= top_k <= experts:
        raise ValueError(f"jetmoe: num_experts_per_tok {top_k} must be in [1, num_local_experts {experts}]")
    return {
        "mixture_of_attention": True,
        "moe_output_bias": True,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(cfg.get("intermediate_size", 5632)),
        "norm_topk_prob": True,
    }
