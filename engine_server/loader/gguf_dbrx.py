"""DBRX's GGUF files as llama.cpp's converter writes them (`dbrx`): its metadata becomes DBRX's own nested
`config.json` (`dbrx_gguf_config`), so transformers loads the converted folder as DBRX; its tensors keep the
checkpoint's names (`DBRX_GLOBAL_NAMES`, `DBRX_LAYER_NAMES` under `transformer.blocks.`), its experts one tensor per
expert and projection as `gguf_convert` names every family's (which `models.dbrx` loads as they are), joined into the
checkpoint's one tensor a projection only for transformers (`dbrx_checkpoint_banks`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from engine_server.hf_dbrx import LAYER_NORM_EPS

DBRX_GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {"dbrx": ("dbrx", "DbrxForCausalLM")}
# The checkpoint's names of llama.cpp's tensors (by the model_type the file converts to): its `attn_output_norm` is
# DBRX's `norm_2`, the norm before the experts.
DBRX_GLOBAL_NAMES = {"dbrx": {
    "token_embd.weight": "transformer.wte.weight", "output_norm.weight": "transformer.norm_f.weight",
    "output.weight": "lm_head.weight",
}}  # fmt: skip
DBRX_LAYER_NAMES = {"dbrx": {
    "attn_norm": "norm_attn_norm.norm_1", "attn_qkv": "norm_attn_norm.attn.Wqkv",
    "attn_output": "norm_attn_norm.attn.out_proj", "attn_output_norm": "norm_attn_norm.norm_2",
    "ffn_gate_inp": "ffn.router.layer",
}}  # fmt: skip
DBRX_LAYERS_PREFIX = {"dbrx": "transformer.blocks."}
# One expert's projection as `gguf_convert.iter_hf_tensors` names it in a DBRX file.
_EXPERT = re.compile(
    r"transformer\.blocks\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight"
)
# The checkpoint's tensor of each projection, all experts' rows in one (`models.dbrx`).
_CHECKPOINT_BANKS = {"gate_proj": "w1", "up_proj": "v1", "down_proj": "w2"}
# The keys of the generic reading (a Llama config's) that DBRX's config names otherwise or not at all.
_LLAMA_ONLY_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
                    "max_position_embeddings", "attention_bias")  # fmt: skip


def dbrx_gguf_config(
    config: dict[str, Any], experts: int, read: Callable[[str, Any], Any], spec: str
) -> dict[str, Any]:
    """The whole `config.json` of a `dbrx` file: `config` (the generic keys read so far) under DBRX's own names,
    `attn_config` (the KV heads, `attention.clamp_kqv` as `clip_qkv`: none where the file has none, the rope base)
    and `ffn_config` (`expert_count` experts of `feed_forward_length`, `expert_used_count` of them chosen and
    renormalised, as llama.cpp always routes a `dbrx` file), the rope base again as transformers 5 reads it
    (`rope_parameters`). `read(key, default)` reads a metadata value. ValueError for a file without experts, or with
    tied embeddings (llama.cpp reads neither; DBRX has none)."""
    used = int(read("dbrx.expert_used_count", 0) or 0)
    if not 1 <= used <= experts:
        raise ValueError(f"model {spec!r}: a dbrx file of {experts} experts, {used} used per token")
    if config["tie_word_embeddings"]:
        raise ValueError(f"model {spec!r}: a dbrx file without an output tensor (DBRX's embeddings are untied)")
    if config["rms_norm_eps"] != LAYER_NORM_EPS:
        raise ValueError(f"model {spec!r}: a dbrx file's LayerNorm epsilon {config['rms_norm_eps']} (DBRX's is 1e-5)")
    clip = read("dbrx.attention.clamp_kqv", None)
    theta = config["rope_theta"]
    attention = {"kv_n_heads": config["num_key_value_heads"], "clip_qkv": None if clip is None else float(clip),
                 "rope_theta": theta}  # fmt: skip
    ffn = {"ffn_hidden_size": config["intermediate_size"], "moe_num_experts": experts, "moe_top_k": used,
           "moe_normalize_expert_weights": 1.0}  # fmt: skip
    return {
        **{key: value for key, value in config.items() if key not in _LLAMA_ONLY_KEYS},
        "d_model": config["hidden_size"],
        "n_heads": config["num_attention_heads"],
        "n_layers": config["num_hidden_layers"],
        "max_seq_len": config["max_position_embeddings"],
        "attn_config": attention,
        "ffn_config": ffn,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
    }


def dbrx_checkpoint_banks(
    weights: Iterable[tuple[str, torch.Tensor]], experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` (a DBRX file's, one tensor per expert and projection) as its checkpoint holds them: each layer's
    `ffn.experts.mlp.w1` (gate), `v1` (up) and `w2` (down, each expert's block the transpose of its `down_proj`),
    `[experts * ffn_hidden_size, d_model]`, yielded once all of the layer's experts are in; every other tensor as it
    comes. ValueError where a layer's experts are missing at the end."""
    pending: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    for name, tensor in weights:
        match = _EXPERT.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        layer = pending.setdefault(match["layer"], {})
        layer[match["proj"], int(match["expert"])] = tensor.T if match["proj"] == "down_proj" else tensor
        if len(layer) < len(_CHECKPOINT_BANKS) * experts:
            continue
        del pending[match["layer"]]
        for proj, bank in _CHECKPOINT_BANKS.items():
            rows = torch.cat([layer[proj, expert] for expert in range(experts)])
            yield f"transformer.blocks.{match['layer']}.ffn.experts.mlp.{bank}", rows.contiguous()
    if pending:
        raise ValueError(f"dbrx layers {sorted(pending)} have experts missing")
