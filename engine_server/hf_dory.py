"""Dory's `config.json` (`model_type` dory: NVIDIA's Nemotron-Labs Dory, a looped nGPT): grouped-query attention with
its windowed layers every three of four (a rope base per kind of layer), a gated SiLU MLP, every hidden state on the
unit sphere, and a middle section of its layers run `n_recurrent_loops` times. transformers writes its config with
each layer counted twice (an attention block and an MLP block: `layer_types` names "mlp" between them) and reads it
halved; `dory_config` reads it so too and gives the layers unrolled, each pass of the middle section's its own
(`config.LoopedNGpt`); `dory_fields` gives the fields of its own."""

from __future__ import annotations

from typing import Any

from engine_server.config import Architecture, LoopedNGpt

DORY_ARCHITECTURES: dict[str, Architecture] = {"dory": "dory"}
# Its rope base per kind of layer where its config names none (`DoryConfig.__post_init__`).
_ROPE_THETAS = {"sliding_attention": 10_000.0, "full_attention": 10_000_000.0}
_COUNTS = ("num_hidden_layers", "n_input_layers", "n_recurrent_layers", "n_output_layers")


def dory_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` as transformers' `DoryConfig` reads it (the same dict for another `model_type`), its layers unrolled:
    `num_hidden_layers` and `layer_types` count each pass of the recurrent section (the checkpoint's layers are
    `dory_fields`' `LoopedNGpt.layer_of` them), its rope per kind of layer and its window filled in. ValueError for
    sections that do not add up to its layers, fewer than one pass, or `recurrent_kv_cache_mode` "last_loop" (its
    earlier passes reading the last one's cache without writing: not served)."""
    if model_type not in DORY_ARCHITECTURES:
        return cfg
    cfg = dict(cfg)
    kinds = cfg.get("layer_types")
    if kinds is not None and "mlp" in kinds:  # as transformers writes it: each layer twice, an MLP block after
        kinds = kinds[::2]
        for key in _COUNTS:
            if cfg.get(key) is not None:
                cfg[key] = int(cfg[key]) // 2
    layers = int(cfg.get("num_hidden_layers", 36))
    kinds = list(kinds or ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)])
    first, last = int(cfg.get("n_input_layers", 8)), int(cfg.get("n_output_layers", 8))
    middle = int(cfg["n_recurrent_layers"]) if cfg.get("n_recurrent_layers") is not None else layers - first - last
    loops = int(cfg.get("n_recurrent_loops", 2))
    if first + middle + last != layers or len(kinds) != layers or min(first, middle, last) < 0:
        raise ValueError(f"dory n_input_layers {first} + n_recurrent_layers {middle} + n_output_layers {last} must "
                         f"equal its {layers} layers, each named in layer_types")  # fmt: skip
    if loops < 1:
        raise ValueError(f"dory n_recurrent_loops must be at least 1, got {loops}")
    mode = cfg.get("recurrent_kv_cache_mode", "per_loop")
    if mode != "per_loop":
        raise ValueError(f"dory recurrent_kv_cache_mode {mode!r} is not supported (per_loop is)")
    rope = cfg.get("rope_parameters") or {
        kind: {"rope_type": "default", "rope_theta": _ROPE_THETAS[kind]} for kind in set(kinds)
    }
    unrolled = kinds[:first] + kinds[first : first + middle] * loops + kinds[first + middle :]
    return {
        **cfg, "num_hidden_layers": len(unrolled), "layer_types": unrolled, "rope_parameters": rope,
        "sliding_window": cfg.get("sliding_window", 1024), "n_input_layers": first, "n_recurrent_layers": middle,
        "n_output_layers": last, "n_recurrent_loops": loops,
    }  # fmt: skip


def dory_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Dory's `ModelConfig` fields from `dory_config`'s dict ({} for other families): its loops and learned scales'
    constants (`LoopedNGpt`), its MLP's biases. ValueError for an MLP activation other than SiLU."""
    if model_type not in DORY_ARCHITECTURES:
        return {}
    activation = cfg.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"dory hidden_act {activation!r} is not supported (silu)")
    loops = LoopedNGpt(
        input_layers=int(cfg["n_input_layers"]), recurrent_layers=int(cfg["n_recurrent_layers"]),
        loops=int(cfg["n_recurrent_loops"]), initializer_range=float(cfg.get("initializer_range", 0.0177)),
        alpha_init=float(cfg.get("ngpt_alpha_init", 0.05)),
    )  # fmt: skip
    return {"looped_ngpt": loops, "mlp_bias": bool(cfg.get("mlp_bias"))}
