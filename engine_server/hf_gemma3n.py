"""Gemma 3n's text model config (`gemma3n_text`, or a multimodal `gemma3n` checkpoint's `text_config`): Gemma 4's
layers (per-layer inputs, K/V shared by the last layers, q/k/v norms, unscaled scores, windows) under AltUp's
streams, with LAuReL and sparse MLPs (`config.AltUp`). `gemma3n_config` gives the rest of the reader the keys a
Gemma 4 config has, as transformers fills them in where a file leaves them out; `gemma3n_fields` the AltUp part."""

from __future__ import annotations

from typing import Any

from engine_server.config import AltUp
from engine_server.hf_classic import json_float

# transformers' defaults for the keys a Gemma 3n config may leave out (`Gemma3nTextConfig`).
_DEFAULTS: dict[str, Any] = {
    "sliding_window": 512, "num_kv_shared_layers": 15, "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262_144, "final_logit_softcapping": 30.0, "head_dim": 256,
}  # fmt: skip
_FULL_ROPE_THETA, _LOCAL_ROPE_THETA = 1_000_000.0, 10_000.0
_FULL_EVERY = 5  # without `layer_types`, every fifth layer attends to all, the others within the window
_SPARSE_LAYERS, _SPARSITY = 10, 0.95  # without a pattern, the first ten layers' MLPs keep 5% of their gates


def gemma3n_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` (a Gemma 3n text config) as a Gemma 4 one: one MLP width (`intermediate_size` may list one per layer,
    all equal), every layer of one head shape (`global_head_dim` the heads' own), `layer_types` (every fifth layer
    full by default), rope per layer type (default rope, bases 1,000,000 and 10,000 unless given: transformers 5's
    `rope_parameters` by type, or the earlier `rope_theta` and `rope_local_base_freq`) and transformers' defaults
    where a key is left out. ValueError for MLP widths that differ between layers."""
    layers = int(cfg["num_hidden_layers"])
    widths = cfg.get("intermediate_size") or 16_384
    widths = [int(w) for w in widths] if isinstance(widths, list) else [int(widths)] * layers
    if len(set(widths)) != 1 or len(widths) != layers:
        raise ValueError(f"gemma3n intermediate_size {cfg['intermediate_size']!r}: one width for every layer is "
                         "supported")  # fmt: skip
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention") or {"rope_type": "default",
                                          "rope_theta": json_float(cfg.get("rope_theta") or _FULL_ROPE_THETA)}
    local = rope.get("sliding_attention") or {
        "rope_type": "default", "rope_theta": json_float(cfg.get("rope_local_base_freq") or _LOCAL_ROPE_THETA)}
    filled = {**_DEFAULTS, **{key: value for key, value in cfg.items() if value is not None}}
    types = filled.get("layer_types") or [
        "full_attention" if (i + 1) % _FULL_EVERY == 0 else "sliding_attention" for i in range(layers)
    ]
    return {
        **filled,
        "intermediate_size": widths[0],
        "layer_types": types,
        "global_head_dim": filled["head_dim"],
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
    }


def gemma3n_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig.altup` of a Gemma 3n text config (as `gemma3n_config` gives it): its streams
    (`altup_num_inputs`, 4), the active one (`altup_active_idx`, 0), `altup_correct_scale`, `laurel_rank` (64) and
    each layer's `activation_sparsity_pattern` (0.95 on the first ten layers by default). ValueError for another
    active stream than the first (transformers adds each layer's per-layer input to the streams after the first)."""
    layers = int(cfg["num_hidden_layers"])
    active = int(cfg.get("altup_active_idx") or 0)
    if active != 0:
        raise ValueError(f"gemma3n altup_active_idx {active} is not supported (0 is)")
    sparsity = cfg.get("activation_sparsity_pattern")
    if sparsity is None:
        sparse = _SPARSE_LAYERS if layers > _SPARSE_LAYERS else 0
        sparsity = [_SPARSITY] * sparse + [0.0] * (layers - sparse)
    elif not isinstance(sparsity, list):
        sparsity = [sparsity] * layers
    if len(sparsity) != layers:
        raise ValueError(f"gemma3n activation_sparsity_pattern must give each of the {layers} layers a value")
    altup = AltUp(
        streams=int(cfg.get("altup_num_inputs") or 4),
        active=active,
        correct_scale=bool(cfg.get("altup_correct_scale", True)),
        laurel_rank=int(cfg.get("laurel_rank") or 64),
        sparsity=tuple(json_float(value) for value in sparsity),
    )
    return {"altup": altup}
