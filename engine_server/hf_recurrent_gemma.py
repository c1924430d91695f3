"""RecurrentGemma's `config.json` (`model_type` recurrent_gemma: RecurrentGemma 2B and 9B, Griffin): blocks of
`block_types` repeated over the layers, "recurrent" ones Griffin's recurrent block (`layers.rg_lru`) and "attention"
ones local multi-query attention (within `attention_window_size`, rope over half of each head, `o_proj` biased);
Gemma's norms (`1 + w`) and embeddings times sqrt(hidden_size) (rounded to bfloat16, as transformers rounds it), a
gated GELU (tanh) MLP `intermediate_size / 2` wide with biases, soft-capped logits. `recurrent_gemma_config` gives
the rest of the reader its keys as transformers reads them; `recurrent_gemma_fields` the fields of its own."""

from __future__ import annotations

import math
from typing import Any

import torch

from engine_server.config import RGLRU, Architecture

RECURRENT_GEMMA_ARCHITECTURES: dict[str, Architecture] = {"recurrent_gemma": "recurrent_gemma"}


def recurrent_gemma_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` as transformers' `RecurrentGemmaConfig` reads it (the same dict for another `model_type`): heads
    `hidden_size / num_attention_heads` wide, as many KV heads as query heads unless given, rope over half of each head
    unless `partial_rotary_factor` says otherwise, the attention layers windowed (`layer_types`: the recurrent ones
    read as full attention layers, which have no attention), the MLP's width `intermediate_size / 2`. ValueError for
    a block kind other than recurrent or attention."""
    if model_type not in RECURRENT_GEMMA_ARCHITECTURES:
        return cfg
    layers = int(cfg.get("num_hidden_layers", 26))
    kinds = list(cfg.get("block_types") or ("recurrent", "recurrent", "attention"))
    if set(kinds) - {"recurrent", "attention"}:
        raise ValueError(f"recurrent_gemma block_types {kinds!r}: each must be recurrent or attention")
    blocks = (kinds * layers)[:layers]
    heads = int(cfg.get("num_attention_heads", 10))
    return {
        **cfg, "block_types": blocks, "head_dim": int(cfg.get("hidden_size", 2560)) // heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "partial_rotary_factor": cfg.get("partial_rotary_factor", 0.5),
        "sliding_window": int(cfg.get("attention_window_size", 2048)),
        "layer_types": ["sliding_attention" if kind == "attention" else "full_attention" for kind in blocks],
        "intermediate_size": int(cfg.get("intermediate_size", 3 * 2560)) // 2,
        "tie_word_embeddings": cfg.get("tie_word_embeddings", True), "attention_out_bias": True,
    }  # fmt: skip


def recurrent_gemma_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """RecurrentGemma's `ModelConfig` fields from `recurrent_gemma_config`'s dict ({} for other families): its
    recurrent blocks (`RGLRU`), Gemma's norms and embedding scale, the MLP's activation and biases, the logits' cap.
    ValueError for recurrent blocks whose channels do not split into the heads' blocks."""
    if model_type not in RECURRENT_GEMMA_ARCHITECTURES:
        return {}
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    width = int(cfg.get("lru_width") or hidden)
    if width % heads:
        raise ValueError(f"recurrent_gemma: lru_width {width} must split into {heads} blocks")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"recurrent_gemma hidden_activation {cfg['hidden_activation']!r} is not supported")
    recurrent = tuple(i for i, kind in enumerate(cfg["block_types"]) if kind == "recurrent")
    return {
        "rg_lru": RGLRU(width=width, heads=heads, conv_width=int(cfg.get("conv1d_width", 4)), layers=recurrent)
        if recurrent else None,
        "norm_offset": 1.0,
        "embedding_multiplier": float(torch.tensor(math.sqrt(hidden), dtype=torch.bfloat16)),
        "final_logit_softcap": float(cfg.get("logits_soft_cap") or 0.0),
        "hidden_act": "gelu_tanh",
        "mlp_bias": True,
    }
