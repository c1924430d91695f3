"""Qwen4-Exp's `config.json` (`model_type` qwen4_exp_text; a multimodal `qwen4_exp` checkpoint's text model, its
vision tower not read): Qwen3.5-MoE's hybrid of Gated DeltaNet and gated attention over experts beside a gated
shared expert, its attention layers (`indexed_attention`, or `full_attention` as released) QSA-indexed, its residual
stream `hc_count` hyper-connected streams, some linear layers with per-layer n-gram embeddings
(`ple_layer_ids`, one-based). `qwen4_exp_config` gives the rest of the reader Qwen3.5's view of it;
`qwen4_exp_fields` adds the `config.Qwen4Exp` parts."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine_server.config import Architecture, LinearAttention, Qwen4Exp

QWEN4_EXP_ARCHITECTURES: dict[str, Architecture] = {"qwen4_exp_text": "qwen4_exp", "qwen4_exp": "qwen4_exp"}
_ID_LIMIT = 1 << 24  # token ids a float32 state value holds exactly (each sequence's n-gram context)


def qwen4_exp_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The text config of a Qwen4-Exp `cfg` (the same dict for another `model_type`), its attention layers named
    `full_attention` as Qwen3.5's reader names them and rope over whole heads unless a `partial_rotary_factor`
    says otherwise (Qwen3.5's default is a quarter)."""
    if model_type not in QWEN4_EXP_ARCHITECTURES:
        return cfg
    if model_type == "qwen4_exp":
        cfg = {**(cfg.get("text_config") or {}), "model_type": "qwen4_exp_text"}
    layers = int(cfg.get("num_hidden_layers", 40))
    kinds = cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % int(cfg.get("full_attention_interval") or 4) else "indexed_attention"
        for i in range(layers)
    ]
    kinds = ["full_attention" if kind == "indexed_attention" else kind for kind in kinds]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    share = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    return {**cfg, "layer_types": kinds, "partial_rotary_factor": float(share)}


def qwen4_exp_fields(cfg: dict[str, Any], hybrid: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's hybrid fields `hybrid` with Qwen4-Exp's parts (`config.Qwen4Exp`): the linear layers' states
    grown by the n-gram embeddings' where the model has them. ValueError for what is not served."""
    gate = cfg.get("output_gate_type") or cfg.get("hidden_act", "silu")
    if gate != "silu":
        raise ValueError(f"qwen4_exp: linear attention's output gate {gate!r} is not served (silu is)")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    linear: LinearAttention = hybrid["linear_attention"]
    attention = tuple(i for i in range(int(cfg["num_hidden_layers"])) if i not in linear.layers)
    fields = {key: cfg.get(key) for key in ("indexer_n_heads", "indexer_head_dim", "indexer_budget",
                                            "indexer_compress_ratio")}  # fmt: skip
    if any(value is None for value in fields.values()) or int(cfg.get("indexer_kv_heads") or 1) != 1:
        raise ValueError(f"qwen4_exp: QSA needs indexer_n_heads, indexer_head_dim, indexer_budget and "
                         f"indexer_compress_ratio, and one indexer key head; got {fields}")  # fmt: skip
    ratio, budget = int(cfg["indexer_compress_ratio"]), int(cfg["indexer_budget"])
    index_dim = int(cfg["indexer_head_dim"])
    rotated = int(float(cfg["partial_rotary_factor"]) * head_dim)
    if min(ratio, budget) < 1 or budget % ratio or not rotated <= index_dim <= head_dim:
        raise ValueError(f"qwen4_exp: QSA's budget {budget} must be a positive multiple of its compress ratio "
                         f"{ratio}, and its index heads of {index_dim} dims lie between rope's {rotated} and a "
                         f"head's {head_dim}")  # fmt: skip
    ngram_layers = tuple(sorted({int(i) - 1 for i in cfg.get("ple_layer_ids") or ()}))
    if any(i not in linear.layers for i in ngram_layers):
        raise ValueError(f"qwen4_exp: n-gram embeddings on layers {ngram_layers} (zero-based) need linear attention")
    ngram_size, per_ngram = int(cfg.get("ngram_size", 3)), int(cfg.get("heads_per_ngram", 8))
    embed_dim = int(cfg.get("ple_embed_dim") or hidden)
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if ngram_layers and (ngram_size < 2 or embed_dim % ((ngram_size - 1) * per_ngram) or eos is None):
        raise ValueError("qwen4_exp: n-gram embeddings need ngram_size >= 2, ple_embed_dim divisible by their "
                         "heads and an eos_token_id")  # fmt: skip
    if ngram_layers and int(cfg["vocab_size"]) > _ID_LIMIT:
        raise ValueError(f"qwen4_exp: a vocabulary of {cfg['vocab_size']} ids is past what its n-gram state holds")
    spec = Qwen4Exp(
        streams=int(cfg.get("hc_count", 4)), rank=int(cfg.get("hc_lowrank", 320)), qsa_layers=attention,
        index_heads=int(cfg["indexer_n_heads"]), index_head_dim=index_dim, budget=budget, compress_ratio=ratio,
        ngram_layers=ngram_layers, ngram_embed_dim=embed_dim, ngram_conv_kernel=int(cfg.get("ple_conv_kernel_size", 4)),
        ngram_size=ngram_size, heads_per_ngram=per_ngram,
        ngram_vocab_base=int(cfg.get("ngram_vocab_size_base", 20_000_000)),
        ngram_vocab_divisor=int(cfg.get("make_ngram_vocab_size_divisible_by", 128)),
        ngram_seed=int(cfg.get("seed", 1234)), ngram_parts=int(cfg.get("split_ngram_parts", 512)),
        eos_token_id=int(eos or 0),
    )  # fmt: skip
    if spec.streams < 2:
        raise ValueError(f"qwen4_exp: hc_count {spec.streams} (it needs 2 or more streams)")
    extra = spec.ngram_state_size(hidden)
    return {**hybrid, "linear_attention": replace(linear, extra_state=extra), "qwen4_exp": spec}
