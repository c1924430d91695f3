"""State space language models without attention: Mamba (`mamba`: the state-spaces mamba-*-hf releases), Falcon
Mamba (`falcon_mamba`: Falcon Mamba 7B, Falcon3-Mamba) and Mamba-2 (`mamba2`: Mamba-Codestral 7B, the mamba2-*
releases). Each layer is `h += mixer(norm(h))`, its mixer Mamba-1 (`layers.mamba1`) or Mamba-2 (`layers.mamba2`),
with no MLP and no attention: `mamba_config` gives the rest of the reader the keys a Llama config has (heads that no
layer reads, no MLP width, the norms' epsilon), `mamba_fields` the mixers' shape."""

from __future__ import annotations

import math
from typing import Any

from engine_server.config import Architecture, Mamba1, Mamba2
from engine_server.hf_classic import json_float

# Each state space `model_type` and the family that serves it (`models.mamba`).
MAMBA_ARCHITECTURES: dict[str, Architecture] = {"mamba": "mamba", "falcon_mamba": "mamba", "mamba2": "mamba"}
# The longest sequence served where a config names none: these models have no positions, so no limit of their own;
# Mamba-Codestral's tested context (256k tokens). `--max-model-len` lowers it.
MAX_POSITIONS = 262_144


def mamba_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with the keys the reader takes from a Llama config (the same dict for another `model_type`): one
    attention head 2 wide that no layer reads (the rope table it sizes stays small), no MLP, the norms' epsilon from
    `layer_norm_epsilon`, `MAX_POSITIONS` where no `max_position_embeddings` is given; the mixer's width kept as
    `mamba_inner` (Mamba-1's `intermediate_size`, else `expand * hidden_size`, as transformers reads it), Mamba-2's
    `num_heads` and `head_dim` as `mamba_num_heads` and `mamba_head_dim` (`mamba_fields`); embeddings tied where the
    config does not say (Mamba's and Falcon Mamba's default: the mamba-*-hf files leave it out). ValueError for what the
    layers do not build: biases on the mixer's projections (`use_bias`), another activation than SiLU, Mamba-2's time
    step clamped to a range, or an inner width other than its heads' (transformers refuses that too)."""
    if model_type not in MAMBA_ARCHITECTURES:
        return cfg
    if cfg.get("use_bias"):
        raise ValueError(f"{model_type} with use_bias (biases on in_proj and out_proj) is not supported")
    if (cfg.get("hidden_act") or "silu") != "silu":
        raise ValueError(f"{model_type} hidden_act {cfg['hidden_act']!r} is not supported (silu is)")
    limit = [json_float(bound) for bound in cfg.get("time_step_limit") or (0.0, math.inf)]
    if model_type == "mamba2" and limit != [0.0, math.inf]:
        raise ValueError(f"mamba2 with time_step_limit {limit} is not supported")
    hidden, expand = int(cfg["hidden_size"]), int(cfg.get("expand") or 2)
    mixer: dict[str, int] = {"mamba_inner": int(cfg.get("intermediate_size") or expand * hidden)}
    if model_type == "mamba2":
        heads, head_dim = int(cfg.get("num_heads") or 128), int(cfg.get("head_dim") or 64)
        if expand * hidden != heads * head_dim:
            raise ValueError(f"mamba2 of {heads} heads {head_dim} wide is not expand * hidden_size ({expand} * "
                             f"{hidden}) wide")  # fmt: skip
        mixer = {"mamba_num_heads": heads, "mamba_head_dim": head_dim}
    return {
        **cfg,
        **mixer,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 2,
        "intermediate_size": 0,
        "rms_norm_eps": float(cfg.get("layer_norm_epsilon") or 1e-5),
        "max_position_embeddings": int(cfg.get("max_position_embeddings") or MAX_POSITIONS),
        "rope_theta": 10000.0,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", model_type != "mamba2")),
    }


def mamba_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` fields of a state space model's layers (`cfg` as `mamba_config` gives it; {} for other
    families): every layer a Mamba-1 (`mamba1`: `mamba_inner` channels, a time-step rank of `time_step_rank`,
    "auto" being hidden / 16 rounded up; Falcon Mamba's time step, B and C RMS-normalised without a weight at
    `mixer_rms_eps`) or a Mamba-2 mixer (`mamba2`: `num_heads` heads `head_dim` wide, `n_groups` groups of
    `state_size`, its output RMS-normalised per group with a weight) and none an MLP. (Mamba's mixer has no norms:
    its `inner_norm_eps` is `Mamba1`'s default, whatever the config says.)"""
    if model_type not in MAMBA_ARCHITECTURES:
        return {}
    layers = tuple(range(int(cfg["num_hidden_layers"])))
    hidden = int(cfg["hidden_size"])
    kernel, conv_bias = int(cfg.get("conv_kernel") or 4), bool(cfg.get("use_conv_bias", True))
    if model_type == "mamba2":
        mixer: dict[str, Mamba1 | Mamba2] = {"mamba2": Mamba2(
            num_heads=int(cfg["mamba_num_heads"]), head_dim=int(cfg["mamba_head_dim"]),
            state_dim=int(cfg.get("state_size") or 128), groups=int(cfg.get("n_groups") or 8), conv_kernel=kernel,
            conv_bias=conv_bias, layers=layers,
        )}  # fmt: skip
    else:
        rank = cfg.get("time_step_rank") or "auto"
        falcon = model_type == "falcon_mamba"
        mixer = {"mamba1": Mamba1(
            inner=int(cfg["mamba_inner"]), state_dim=int(cfg.get("state_size") or 16),
            dt_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank), layers=layers,
            inner_norms="weightless" if falcon else "none",
            inner_norm_eps=float(cfg.get("mixer_rms_eps") or 1e-6) if falcon else Mamba1.inner_norm_eps,
            conv_kernel=kernel, conv_bias=conv_bias,
        )}  # fmt: skip
    return {**mixer, "mlp_free_layers": layers}
