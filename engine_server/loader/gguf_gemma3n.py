"""Gemma 3n's GGUF files as llama.cpp's converter writes them (`gemma3n`): their metadata becomes a Gemma 3n text
`config.json` (`gemma3n_gguf_config`), so transformers loads the converted folder as Gemma 3n; their tensors take
Gemma 4's names (per-layer inputs, norms) and Gemma 3n's own for AltUp and LAuReL (`GEMMA3N_LAYER_NAMES`,
`GEMMA3N_BARE_NAMES`), the streams' stacked projections split into one tensor each (`GEMMA3N_STACKS`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

GEMMA3N_GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {"gemma3n": ("gemma3n_text", "Gemma3nForCausalLM")}
# A layer's AltUp and LAuReL tensors (the rest of their GGUF name after `blk.N.`, without `.weight`) and the
# checkpoint's names for them; the AltUp output scale, which its converter names with `.weight` added.
GEMMA3N_LAYER_NAMES = {
    "altup_correct_coef": "altup.correction_coefs", "altup_predict_coef": "altup.prediction_coefs",
    "altup_router": "altup.modality_router", "altup_router_norm": "altup.router_norm",
    "laurel_l": "laurel.linear_left", "laurel_r": "laurel.linear_right", "laurel_post_norm": "laurel.post_laurel_norm",
}  # fmt: skip
GEMMA3N_BARE_NAMES = {"altup_correct_scale.weight": "altup.correct_output_scale"}
# The streams' projections, each stack `[streams - 1, hidden, hidden]` in the file: the checkpoint's one tensor each.
GEMMA3N_STACKS = {"altup_proj.weight": "model.altup_projections.{}.weight",
                  "altup_unembd_proj.weight": "model.altup_unembed_projections.{}.weight"}  # fmt: skip
# What llama.cpp fixes where a file says nothing (the released E2B's and E4B's): every fifth layer attends to all,
# the windowed layers turn at 10,000; the first ten MLPs sparse at 0.95; K/V of their own on the first 20 layers.
_FULL_EVERY = 5
_LOCAL_ROPE_THETA = 10_000.0
_SPARSE_LAYERS, _SPARSITY = 10, 0.95
_KV_LAYERS = 20
# The keys of the generic reading (a Llama config's) that a Gemma 3n text config has too.
_GENERIC_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                 "eos_token_id", "pad_token_id", "torch_dtype")  # fmt: skip


def gemma3n_gguf_config(
    config: dict[str, Any], tensors: dict[str, Any], read: Callable[[str, Any], Any], spec: str
) -> dict[str, Any]:
    """The whole `config.json` of a `gemma3n` file: `config` (the generic keys read so far) with Gemma 3n's own: each
    layer's MLP width (one for all), the window and its pattern (`attention.sliding_window_pattern`), rope per layer
    type (the full layers' base from the file, the windowed ones' llama.cpp's 10,000), AltUp's streams and active one,
    LAuReL's rank (its tensors' width), the per-layer inputs (the width from the file, the table its tensor's rows),
    the shared K/V layers and each MLP's sparsity (the normal CDF of the file's quantile: none for -inf), where a key
    is absent llama.cpp's fixed values. `read(key, default)` reads a metadata value. ValueError for MLP widths that
    differ between layers, or a file without per-layer inputs."""

    def field(key: str, default: Any = None) -> Any:
        return read(f"gemma3n.{key}", default)

    layers = int(config["num_hidden_layers"])
    widths = {int(w) for w in np.atleast_1d(field("feed_forward_length"))}
    if len(widths) != 1:
        raise ValueError(f"model {spec!r}: a gemma3n file's MLP widths {sorted(widths)} differ between layers")
    pattern = field("attention.sliding_window_pattern")
    windowed = [bool(w) for w in pattern] if pattern is not None else [
        (i + 1) % _FULL_EVERY != 0 for i in range(layers)]  # fmt: skip
    quantiles = field("activation_sparsity_scale")
    sparsity = [_sparsity(float(q)) for q in quantiles] if quantiles is not None else [
        _SPARSITY if i < _SPARSE_LAYERS else 0.0 for i in range(layers)]  # fmt: skip
    width = int(field("embedding_length_per_layer_input", 0) or 0)
    if not width or "per_layer_token_embd.weight" not in tensors:
        raise ValueError(f"model {spec!r}: a gemma3n file without its per-layer inputs")
    laurel = tensors.get("blk.0.laurel_l.weight")
    return {
        **{key: config[key] for key in _GENERIC_KEYS if key in config},
        "architectures": [GEMMA3N_GGUF_ARCHITECTURES["gemma3n"][1]],
        "model_type": "gemma3n_text",
        "intermediate_size": widths.pop(),
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
        "sliding_window": int(field("attention.sliding_window")),
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": config["rope_theta"]},
                            "sliding_attention": {"rope_type": "default", "rope_theta": _LOCAL_ROPE_THETA}},
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": field("final_logit_softcapping"),
        "altup_num_inputs": int(field("altup.num_inputs", 4)),
        "altup_active_idx": int(field("altup.active_idx", 0)),
        "laurel_rank": int(laurel.shape[-1]) if laurel is not None else 64,
        "hidden_size_per_layer_input": width,
        "vocab_size_per_layer_input": int(tensors["per_layer_token_embd.weight"].shape[-1]),
        "num_kv_shared_layers": int(field("attention.shared_kv_layers", layers - _KV_LAYERS)),
        "activation_sparsity_pattern": sparsity,
    }


def _sparsity(quantile: float) -> float:
    """The share of gates a sparse MLP cuts, from the standard normal quantile its cutoff takes (its converter's
    `icdf(sparsity)`, in float32): 0 for -inf, else the CDF rounded to 6 places (the released 0.95 back exactly)."""
    if math.isinf(quantile) and quantile < 0:
        return 0.0
    return round(0.5 * math.erfc(-quantile / math.sqrt(2.0)), 6)
