"""Zamba2's `config.json` (`model_type` zamba2: Zyphra's Zamba2 1.2B, 2.7B, 7B and their instruct models): Mamba-2
layers, before some of which ("hybrid" in `layers_block_type`) one of `num_mem_blocks` shared attention + MLP blocks
runs over the hidden state beside the token's embedding (`2 * hidden_size` wide, heads `2 * hidden_size /
num_attention_heads` wide), with low-rank adapters of that use. `zamba2_config` gives the rest of the reader a
Llama config's keys for its unrolled layers (each use of a shared block a layer of K/V, each Mamba-2 a layer of
states: `config.SharedBlocks`); `zamba2_fields` the fields of its own."""

from __future__ import annotations

import math
from typing import Any

from engine_server.config import Architecture, Mamba1, Mamba2, SharedBlocks

ZAMBA2_ARCHITECTURES: dict[str, Architecture] = {"zamba2": "zamba2", "zamba": "zamba2"}
# Its layers where a config names none (`Zamba2Config`'s, Zamba2 2.7B's 54).
_DEFAULT_BLOCKS = (["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3
                   + ["hybrid"] + ["mamba"] * 2)  # fmt: skip
# Its MLP's activation: transformers' names and ours.
_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "silu": "silu"}


def _block_kinds(cfg: dict[str, Any]) -> list[str]:
    """Each checkpoint layer's kind, "mamba" or "hybrid" (transformers 5's "linear_attention" read as "mamba");
    ValueError for another."""
    given = cfg.get("layers_block_type") or _DEFAULT_BLOCKS
    kinds = ["mamba" if kind == "linear_attention" else kind for kind in given]
    if set(kinds) - {"mamba", "hybrid"}:
        raise ValueError(f"zamba2 layers_block_type must name each layer mamba or hybrid; got {kinds!r}")
    return kinds


def zamba2_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` as transformers' `Zamba2Config` fills it in (the same dict for another `model_type`), its layers
    unrolled (`num_hidden_layers` counts each use of a shared block and each Mamba-2 layer), its attention heads
    `2 * hidden_size / num_attention_heads` wide, its MLP `4 * hidden_size` wide unless given, 16,384 positions with
    `use_long_context`, no rope unless `use_mem_rope`. ValueError for biases on its projections (`add_bias_linear`,
    which no release sets) and for attention adapters with fewer KV heads than heads (transformers' adapters give
    every head's K/V, as the releases have)."""
    if model_type not in ZAMBA2_ARCHITECTURES:
        return cfg
    if cfg.get("add_bias_linear") or cfg.get("mamba_proj_bias"):
        raise ValueError(f"{model_type} with biases on its projections (add_bias_linear, mamba_proj_bias) is not "
                         "supported")  # fmt: skip
    kinds = _block_kinds(cfg)
    hidden, heads = int(cfg.get("hidden_size", 2560)), int(cfg.get("num_attention_heads", 32))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if cfg.get("use_shared_attention_adapter") and kv_heads != heads:  # its adapters give k and v 2 * hidden wide
        raise ValueError(f"zamba2 with use_shared_attention_adapter and {kv_heads} KV heads for {heads} heads is not "
                         "supported (transformers' adapters need every head's K/V)")  # fmt: skip
    positions = 16384 if cfg.get("use_long_context") else int(cfg.get("max_position_embeddings", 4096))
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
    return {
        **cfg, "layers_block_type": kinds, "num_hidden_layers": len(kinds) + kinds.count("hybrid"),
        "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": int(cfg.get("attention_head_dim") or 2 * hidden // heads),
        "intermediate_size": int(cfg.get("intermediate_size") or 4 * hidden), "max_position_embeddings": positions,
        "rope_parameters": rope, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5),
        "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
    }  # fmt: skip


def zamba2_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Zamba2's `ModelConfig` fields from `zamba2_config`'s dict ({} for other families): its Mamba-2 layers'
    shape (`n_mamba_heads` heads of `mamba_expand * hidden_size / n_mamba_heads`) on their unrolled indices, its
    shared blocks and their uses (`SharedBlocks`: `num_mem_blocks` of them; a block for each use where the config
    unties the embeddings, as transformers then unties the blocks too), its MLP's activation. Its time step is not
    floored at `time_step_min`: transformers floors it in its chunked (prefill) form alone, its one-token form, vLLM
    and llama.cpp do not (as for Nemotron-H). ValueError for another activation."""
    if model_type not in ZAMBA2_ARCHITECTURES:
        return {}
    if model_type == "zamba":
        return _zamba_fields(cfg)
    kinds = cfg["layers_block_type"]
    hybrid = tuple(layer for layer, kind in enumerate(kinds) if kind == "hybrid")
    # transformers shares the blocks as it ties the embeddings: with them untied, each use has a block of its own
    count = int(cfg.get("num_mem_blocks", 1)) if cfg.get("tie_word_embeddings", True) else max(len(hybrid), 1)
    blocks = SharedBlocks(
        hybrid_layers=hybrid, blocks=count, adapter_rank=int(cfg.get("adapter_rank", 128)),
        attention_adapters=bool(cfg.get("use_shared_attention_adapter")),
    )  # fmt: skip
    unrolled = blocks.layers(len(kinds))
    hidden, heads = int(cfg["hidden_size"]), int(cfg.get("n_mamba_heads", 8))
    inner = int(float(cfg.get("mamba_expand", 2)) * hidden)
    mamba = Mamba2(
        num_heads=heads, head_dim=inner // heads, state_dim=int(cfg.get("mamba_d_state", 64)),
        groups=int(cfg.get("mamba_ngroups", 1)), conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        conv_bias=bool(cfg.get("use_conv_bias", True)),
        layers=tuple(index for index, (_, use) in enumerate(unrolled) if not use),
    )  # fmt: skip
    activation = cfg.get("hidden_act") or "gelu"
    if activation not in _ACTIVATIONS:
        raise ValueError(f"zamba2 hidden_act {activation!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return {"mamba2": mamba, "shared_blocks": blocks, "hidden_act": _ACTIVATIONS[activation]}


def _zamba_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Zamba's (the first: Zamba 7B) `ModelConfig` fields from `zamba2_config`'s dict: multi-head Mamba-1 layers
    (`n_mamba_heads` heads, each an `x_proj` and a `dt_proj` of its own; no norms inside; `mamba_d_state`,
    `mamba_d_conv`, `mamba_dt_rank`, "auto" being hidden / 16 rounded up) on their unrolled indices, one shared block
    without adapters or rope (its own per use where the embeddings are untied, as for Zamba2), its MLP's activation."""
    kinds = cfg["layers_block_type"]
    hybrid = tuple(layer for layer, kind in enumerate(kinds) if kind == "hybrid")
    count = 1 if cfg.get("tie_word_embeddings", True) else max(len(hybrid), 1)
    blocks = SharedBlocks(hybrid_layers=hybrid, blocks=count, adapter_rank=0, attention_adapters=False)
    unrolled = blocks.layers(len(kinds))
    hidden, heads = int(cfg["hidden_size"]), int(cfg.get("n_mamba_heads", 2))
    inner = int(float(cfg.get("mamba_expand", 2)) * hidden)
    rank = cfg.get("mamba_dt_rank", "auto")
    mamba = Mamba1(
        inner=inner, state_dim=int(cfg.get("mamba_d_state", 16)), conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        dt_rank=math.ceil(hidden / 16) if rank in (None, "auto") else int(rank),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        layers=tuple(index for index, (_, use) in enumerate(unrolled) if not use), inner_norms="none", heads=heads,
    )  # fmt: skip
    if inner % heads:
        raise ValueError(f"zamba: {inner} Mamba channels do not split over {heads} heads")
    activation = cfg.get("hidden_act") or "gelu"
    if activation not in _ACTIVATIONS:
        raise ValueError(f"zamba hidden_act {activation!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return {"mamba1": mamba, "shared_blocks": blocks, "hidden_act": _ACTIVATIONS[activation]}
