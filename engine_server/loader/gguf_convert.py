"""Convert a GGUF file, once, into a cached Hugging Face folder of its metadata (config.json, tokenizer, the tensor
index), and read its weights from the file itself in Hugging Face form (`iter_hf_tensors`).

The folder holds no weights: a quantized engine serves the file's blocks (`gguf_quant`), and every other reader
dequantizes the file's tensors as it loads them (fp32, gguf's values: transformers' GGUF loader's; the engine's own
block decoding computes them where it has one, `gguf_blocks`). A float copy was
~7x the file (fp32 of 4.5-bit blocks: 517 MB for the embedded model's 90 MB, ~28 GB for a 7B Q4_K_M), written at
the first start. `write_float_checkpoint` writes one where a whole checkpoint is wanted (transformers' oracle).

The cache entry is keyed by the file's name, size and mtime plus `CONVERTER_VERSION`, and is written into a
temporary sibling folder that is renamed into place only when complete, so a crash never leaves a half folder
and a concurrent converter of the same file simply loses the rename race.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, overload

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quant_shape_from_byte_shape
from safetensors.torch import save_file

from engine_server.hf_classic import falcon_kv_heads
from engine_server.loader.gguf_blocks import dequantize_blocks
from engine_server.loader.gguf_classic import (
    CLASSIC_GLOBAL_NAMES,
    CLASSIC_LAYER_NAMES,
    CLASSIC_LAYERS_PREFIX,
    CONV1D_WEIGHTS,
    HEADWISE_NORMS,
    classic_checkpoint_name,
    headwise_norms,
    kv_grouped_qkv_rows,
)
from engine_server.loader.gguf_dbrx import (
    DBRX_GLOBAL_NAMES,
    DBRX_LAYER_NAMES,
    DBRX_LAYERS_PREFIX,
    dbrx_checkpoint_banks,
)
from engine_server.loader.gguf_gemma3n import GEMMA3N_BARE_NAMES, GEMMA3N_LAYER_NAMES, GEMMA3N_STACKS
from engine_server.loader.gguf_hybrid import BARE_NAMES as HYBRID_BARE_NAMES
from engine_server.loader.gguf_hybrid import LAYER_NAMES as HYBRID_LAYER_NAMES
from engine_server.loader.gguf_hybrid import TILED_VALUE_HEADS, CheckpointForm, HybridShape
from engine_server.loader.gguf_metadata import GgufFile, gguf_pooling, hf_config_from_gguf, transformers_metadata
from engine_server.loader.gguf_state_space import (
    STATE_SPACE_BARE_NAMES,
    STATE_SPACE_GLOBAL_NAMES,
    STATE_SPACE_LAYER_NAMES,
)
from engine_server.loader.lazy_tensor import ComputedSlice, LazyTensor
from engine_server.pooling.params import write_sentence_transformers_pooling
from ladle_kernels.reference import unpermute_rope_rows

# Bump when the converted layout changes so stale cache entries are not reused.
# 3: the tensor index (TENSOR_INDEX); 4: Gemma 2 and 3; 5: the Gated DeltaNet hybrids; 6: Gemma 4; 7: no float copy
CONVERTER_VERSION = 7
# In the converted folder: where each tensor of the GGUF file lies in it (name, type, data offset and size), so a
# quantized engine maps its blocks without parsing the file's metadata again (gguf's reader builds an array per
# vocabulary string: ~6 s of CPU for the embedded model's 49,152 tokens and 48,900 merges, at every start).
TENSOR_INDEX = "gguf_tensors.json"
SHARD_BYTES = 2 * 1024**3  # bounds peak memory while a float checkpoint is written: one shard is held at a time
_FLATTENED_GATE = ".shared_expert_gate.weight"  # Qwen2-MoE's [1, H] shared-expert gate, stored as [H]
_SQUEEZED_CONVOLUTION = ".linear_attn.conv1d.weight"  # a hybrid's [channels, 1, kernel], stored as [channels, kernel]
_LFM2_CONVOLUTION = ".conv.conv.weight"  # LFM2's [channels, 1, taps], stored as [channels, taps] (`_restore`)
# Granite 4.0's, Nemotron-H's, Falcon-H1's and Mamba-2's Mamba-2 tensors (`mamba.`, `mixer.`) that llama.cpp stores
# reshaped (`_restore`): the convolution squeezed, `A_log` as `-exp(A_log)` and `D` each `[heads, 1]`, the gated
# norm's weight `[groups, inner / groups]`; Jamba's, Mamba's and Falcon Mamba's Mamba-1 tensors, the convolution
# squeezed and `A_log` as `-exp(A_log)`, `[inner, N]` (`_MAMBA1_TYPES`).
_MAMBA1_TYPES = ("jamba", "mamba", "falcon_mamba")
_MAMBA_TYPES = ("granitemoehybrid", "nemotron_h", "falcon_h1", "mamba2", *_MAMBA1_TYPES)
_MAMBA_CONVOLUTION = (".mamba.conv1d.weight", ".mixer.conv1d.weight")
_MAMBA_A_LOG = (".mamba.A_log", ".mixer.A_log")
_MAMBA_FLATTENED = (*_MAMBA_A_LOG, ".mamba.D", ".mixer.D", ".mamba.norm.weight", ".mixer.norm.weight")
_GRANITE_TYPES = ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid")
# numpy's type of the tensors gguf stores as plain arrays; every other type is blocks of bytes.
_ARRAY_TYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}  # fmt: skip

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "output_norm.bias": "model.norm.bias",  # a final LayerNorm's (StableLM's, StarCoder2's, Nemotron's)
    "output.bias": "lm_head.bias",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k and v in one tensor, as its checkpoints hold them
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # A mixture of experts (Qwen2-MoE, Qwen3-MoE): the router, and Qwen2-MoE's shared expert with its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Where an architecture's llama.cpp names mean something else (keyed by the HF model_type the file converts to):
# Phi-3's `ffn_up` is its fused gate_up_proj; Gemma's `ffn_norm` is the norm before its MLP, beside the norms after
# the attention and the MLP.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma 4: Gemma's norm names, its per-layer inputs (`inp_gate`, `proj`, `post_norm`), its router and the norms
# around its experts; tensors llama.cpp names apart from the checkpoint's parameter names are `_GEMMA4_BARE`.
_GEMMA4_LAYER_NAMES = {
    **_GEMMA_LAYER_NAMES,
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "ffn_gate_inp": "router.proj",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}
_GEMMA4_BARE = {
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",  # the bank whole, [experts, 2 * width, hidden]
    "ffn_down_exps.weight": "experts.down_proj",
}
_GEMMA4_GLOBAL = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
# Llama 4: its MLP is `feed_forward` (dense, or a router, experts and a shared expert, `_EXPERT_NAMES`).
_LLAMA4_LAYER_NAMES = {
    **{kind: name for kind, name in _LAYER_NAMES.items() if not kind.startswith("ffn_")},
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
    "ffn_gate_inp": "feed_forward.router",
    "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
    "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
    "ffn_down_shexp": "feed_forward.shared_expert.down_proj",
}
# gpt-oss: the norm before its MLP is `post_attention_norm`, its router `mlp.router` (with a bias), its attention
# sinks a bare parameter (`_BARE_LAYER_NAMES`); its experts have biases too (`hf_expert_slices`).
_GPT_OSS_LAYER_NAMES = {
    **{kind: name for kind, name in _LAYER_NAMES.items() if not kind.startswith("ffn_")},
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.router",
}
# GLM-4.5: the norm before its MLP is `post_attention_norm`; its shared experts are DeepSeek-V3's, `shared_experts`.
_DEEPSEEK_SHARED_EXPERTS = {f"ffn_{part}_shexp": f"mlp.shared_experts.{part}_proj" for part in ("gate", "up", "down")}
_GLM4_MOE_LAYER_NAMES = {
    **{kind: name for kind, name in _LAYER_NAMES.items() if kind != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    **_DEEPSEEK_SHARED_EXPERTS,
}
# DeepSeek-V2/V3 (llama.cpp's `deepseek2`): latent attention's projections and norms, DeepSeek's shared experts. A
# newer converter splits `kv_b_proj` into `attn_k_b` and `attn_v_b` (`LatentExpansionParts` joins them again).
_DEEPSEEK_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    **_DEEPSEEK_SHARED_EXPERTS,
}
_DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v2", "glm_moe_dsa")
# GLM-5 (llama.cpp's `glm-dsa`): DeepSeek-V3's layer with DeepSeek Sparse Attention's indexer.
_INDEXER_BARE = {f"indexer.{kind}.{part}": f"self_attn.indexer.{name}.{part}"
                 for kind, name, part in (("k_norm", "k_norm", "weight"), ("k_norm", "k_norm", "bias"),
                                          ("proj", "weights_proj", "weight"), ("attn_k", "wk", "weight"),
                                          ("attn_q_b", "wq_b", "weight"))}  # fmt: skip
# Seed-OSS: the norm before its MLP is `post_attention_norm`, as gpt-oss's.
_SEED_OSS_LAYER_NAMES = {
    **{kind: name for kind, name in _LAYER_NAMES.items() if kind != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
}
# EXAONE 4 and OLMo 2 / 3: norms after the attention and the MLP, none before them.
_EXAONE4_LAYER_NAMES = {
    **{kind: name for kind, name in _LAYER_NAMES.items() if kind not in ("attn_norm", "ffn_norm")},
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# ERNIE 4.5's experts (its routing bias on `moe_statics`) and dots.llm1's (Qwen3's names, its norm before the MLP
# `ffn_norm`): DeepSeek's shared experts' names.
_SHARED_EXPERTS_LAYER_NAMES = {**_LAYER_NAMES, **_DEEPSEEK_SHARED_EXPERTS}
_SPLIT_EXPANSION = re.compile(r"blk\.(\d+)\.attn_([kv])_b\.weight")
# GLM-4: Gemma's four norms under its checkpoint's names (`models.glm4` reads them as Gemma's), its `ffn_up` the fused
# gate_up_proj.
_GLM4_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_self_attn_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
    "ffn_up": "mlp.gate_up_proj",
}
# LFM2: its own names for the attention's output and q/k norms, the block's norms and the MLP; the convolution's
# tensors (`_BARE_LAYER_NAMES`), and the final norm its checkpoints call `embedding_norm` (`_LFM2_GLOBAL`).
_LFM2_LAYER_NAMES = {
    "attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
}
_LFM2_MOE_LAYER_NAMES = {**_LFM2_LAYER_NAMES, "ffn_gate_inp": "feed_forward.gate"}  # its router
_LFM2_GLOBAL = {"token_embd_norm.weight": "model.embedding_norm.weight",
                "output_norm.weight": "model.embedding_norm.weight"}  # fmt: skip
_LFM2_BARE = {f"shortconv.{part}.weight": f"conv.{part}.weight" for part in ("conv", "in_proj", "out_proj")}
# Granite MoE: the router as its checkpoints name it, the shared MLP (gate, up and down apart in the file; joined
# into the checkpoint's `shared_mlp.input_linear` only for transformers, `transformers_banks`) under the names ladle
# loads. Granite 4.0's Mamba-2 tensors (`_MAMBA_*`).
_GRANITE_MOE_LAYER_NAMES = {
    **_LAYER_NAMES, "ffn_gate_inp": "block_sparse_moe.router.layer",
    **{f"ffn_{part}_shexp": f"mlp.shared_expert.{part}_proj" for part in ("gate", "up", "down")},
}  # fmt: skip
_MAMBA_BARE = {
    "ssm_in.weight": "mamba.in_proj.weight", "ssm_conv1d.weight": "mamba.conv1d.weight",
    "ssm_conv1d.bias": "mamba.conv1d.bias", "ssm_dt.bias": "mamba.dt_bias", "ssm_a": "mamba.A_log", "ssm_d": "mamba.D",
    "ssm_norm.weight": "mamba.norm.weight", "ssm_out.weight": "mamba.out_proj.weight",
}  # fmt: skip
# Nemotron-H: every block's one norm and one mixer (Mamba-2's, attention's or the MLP's projections), as its
# checkpoints name them, under `backbone.` (`models.nemotron_h` pairs them into layers).
_NEMOTRON_H_LAYER_NAMES = {
    "attn_norm": "norm", "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj", "attn_v": "mixer.v_proj",
    "attn_output": "mixer.o_proj", "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj",
    # Nemotron 3's experts blocks: the router and the shared expert (the experts' banks: `_EXPERT_NAMES`).
    "ffn_gate_inp": "mixer.gate", "ffn_up_shexp": "mixer.shared_experts.up_proj",
    "ffn_down_shexp": "mixer.shared_experts.down_proj",
}  # fmt: skip
_NEMOTRON_H_BARE = {
    **{gguf: ours.replace("mamba.", "mixer.", 1) for gguf, ours in _MAMBA_BARE.items()},
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
}  # fmt: skip
_NEMOTRON_H_GLOBAL = {"token_embd.weight": "backbone.embeddings.weight", "output_norm.weight": "backbone.norm_f.weight"}
# Falcon-H1: its MLP (`feed_forward`), the norm before it and the final norm as its checkpoints name them; Mamba-2's
# tensors as Granite 4.0's (`_MAMBA_BARE`), the attention's as Llama's.
_FALCON_H1_LAYER_NAMES = {
    **_LAYER_NAMES, "ffn_norm": "pre_ff_layernorm",
    **{f"ffn_{part}": f"feed_forward.{part}_proj" for part in ("gate", "up", "down")},
}  # fmt: skip
_FALCON_H1_GLOBAL = {"output_norm.weight": "model.final_layernorm.weight"}
# Jamba: its norms (`pre_ff_layernorm`, `final_layernorm`), MLP and router (`feed_forward`), and Mamba-1's tensors
# (`ssm_x` its x_proj, `ssm_dt` its dt_proj, the time step's, B's and C's norms; `ssm_a` is `-exp(A_log)` `[inner, N]`).
_JAMBA_LAYER_NAMES = {
    **_FALCON_H1_LAYER_NAMES, "ffn_gate_inp": "feed_forward.router", "ssm_in": "mamba.in_proj",
    "ssm_x": "mamba.x_proj", "ssm_dt": "mamba.dt_proj", "ssm_dt_norm": "mamba.dt_layernorm",
    "ssm_b_norm": "mamba.b_layernorm", "ssm_c_norm": "mamba.c_layernorm", "ssm_out": "mamba.out_proj",
    "ssm_conv1d": "mamba.conv1d",
}  # fmt: skip
_JAMBA_BARE = {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D"}
# Where a family's checkpoints hold their layers other than under `model.layers.`.
_LAYERS_PREFIX = {
    "nemotron_h": "backbone.layers.", **CLASSIC_LAYERS_PREFIX,
    **{model_type: "backbone.layers." for model_type in STATE_SPACE_LAYER_NAMES}, **DBRX_LAYERS_PREFIX,
}  # fmt: skip
# Per architecture (HF model_type), a layer's tensors llama.cpp names apart from the checkpoint's
# `<module>.weight` / `.bias`: the rest of their GGUF name after `blk.N.` -> the checkpoint's after `model.layers.N.`.
_BARE_LAYER_NAMES = {
    "gemma4_text": _GEMMA4_BARE,
    "gemma3n_text": GEMMA3N_BARE_NAMES,
    "gpt_oss": {"attn_sinks.weight": "self_attn.sinks"},
    "glm4_moe": {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},  # the router's load-balancing bias
    "dots1": {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
    **{model_type: {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"} for model_type in _DEEPSEEK_TYPES},
    "glm_moe_dsa": {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias", **_INDEXER_BARE},
    "ernie4_5_moe": {"exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias"},
    "minimax_m2": {"exp_probs_b.bias": "block_sparse_moe.e_score_correction_bias"},  # (on its block)
    **{model_type: HYBRID_BARE_NAMES for model_type in TILED_VALUE_HEADS},
    "lfm2": _LFM2_BARE,
    "lfm2_moe": {**_LFM2_BARE, "exp_probs_b.bias": "feed_forward.expert_bias"},  # the routing bias, [experts]
    "granitemoehybrid": _MAMBA_BARE,
    "nemotron_h": _NEMOTRON_H_BARE,
    "falcon_h1": {**_MAMBA_BARE, "ffn_norm": "pre_ff_layernorm.weight"},  # (its converter writes no `.weight`)
    "jamba": _JAMBA_BARE,
    **STATE_SPACE_BARE_NAMES,
}
# Families whose checkpoints name the embeddings, the final norm and the LM head their own way.
_OWN_GLOBAL_NAMES = {**STATE_SPACE_GLOBAL_NAMES, **DBRX_GLOBAL_NAMES}
_LAYER_PARAMETER = re.compile(r"blk\.(\d+)\.(.+)")
# Hunyuan: its q/k norms' own names (applied after rope).
_HUNYUAN_LAYER_NAMES = {
    **_LAYER_NAMES, "attn_q_norm": "self_attn.query_layernorm", "attn_k_norm": "self_attn.key_layernorm"
}  # fmt: skip
_ARCHITECTURE_LAYER_NAMES = {
    "gemma4_text": _GEMMA4_LAYER_NAMES,
    "gemma3n_text": {**_GEMMA4_LAYER_NAMES, **GEMMA3N_LAYER_NAMES},
    "phi3": {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"},
    "mixtral": {**_LAYER_NAMES, "ffn_gate_inp": "block_sparse_moe.gate"},
    "minimax_m2": {**_LAYER_NAMES, "ffn_gate_inp": "block_sparse_moe.gate"},
    "gemma2": _GEMMA_LAYER_NAMES,
    "gemma3_text": _GEMMA_LAYER_NAMES,
    "llama4_text": _LLAMA4_LAYER_NAMES,
    "gpt_oss": _GPT_OSS_LAYER_NAMES,
    "glm4_moe": _GLM4_MOE_LAYER_NAMES,
    "dots1": _SHARED_EXPERTS_LAYER_NAMES,
    "glm4": _GLM4_LAYER_NAMES,
    **{model_type: _DEEPSEEK_LAYER_NAMES for model_type in _DEEPSEEK_TYPES},
    "ernie4_5_moe": _SHARED_EXPERTS_LAYER_NAMES,
    "seed_oss": _SEED_OSS_LAYER_NAMES,
    "exaone4": _EXAONE4_LAYER_NAMES,
    "olmo2": _EXAONE4_LAYER_NAMES,
    "olmo3": _EXAONE4_LAYER_NAMES,
    "lfm2": _LFM2_LAYER_NAMES,
    "lfm2_moe": _LFM2_MOE_LAYER_NAMES,
    **{model_type: _GRANITE_MOE_LAYER_NAMES for model_type in ("granitemoe", "granitemoeshared", "granitemoehybrid")},
    **{model_type: {**_LAYER_NAMES, **HYBRID_LAYER_NAMES} for model_type in TILED_VALUE_HEADS},
    "nemotron_h": _NEMOTRON_H_LAYER_NAMES,
    "falcon_h1": _FALCON_H1_LAYER_NAMES,
    "jamba": _JAMBA_LAYER_NAMES,
    **STATE_SPACE_LAYER_NAMES,
    **DBRX_LAYER_NAMES,
    "hunyuan_v1_dense": _HUNYUAN_LAYER_NAMES,
    **CLASSIC_LAYER_NAMES,
    "apertus": {**_LAYER_NAMES, "attn_norm": "attention_layernorm", "ffn_norm": "feedforward_layernorm"},
}
# A mixture of experts' 3-D tensors, `[experts, rows, columns]`: every expert's gate, up or down projection, which
# checkpoints store one tensor per expert (Mixtral as w1 / w3 / w2 under `block_sparse_moe.`). Llama 4's come so
# too, as ladle loads them; its checkpoints hold each layer's as two banks (`transformers_banks`). llama.cpp's
# converter run with `--fuse-gate-up-exps` writes a layer's gate and up banks as one, `ffn_gate_up_exps`
# `[experts, 2 * width, columns]`: each expert's gate rows, then its up rows (gpt-oss's bias `[experts, 2 * width]`
# likewise), for any architecture with experts. Each tensor's projections, in the order its rows hold them:
_EXPERT_BANKS = {
    "ffn_gate_exps": ("gate",), "ffn_up_exps": ("up",), "ffn_down_exps": ("down",), "ffn_gate_up_exps": ("gate", "up"),
}  # fmt: skip
_PROJECTIONS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.experts.{expert}.{proj}", {"gate": "w1", "up": "w3", "down": "w2"}),
    "minimax_m2": ("block_sparse_moe.experts.{expert}.{proj}", {"gate": "w1", "up": "w3", "down": "w2"}),
    "llama4_text": ("feed_forward.experts.{expert}.{proj}", _PROJECTIONS),
    "lfm2_moe": ("feed_forward.experts.{expert}.{proj}", {"gate": "w1", "up": "w3", "down": "w2"}),
    "nemotron_h": ("mixer.experts.{expert}.{proj}", _PROJECTIONS),  # (up and down alone: ungated)
    "jamba": ("feed_forward.experts.{expert}.{proj}", _PROJECTIONS),
}
_QWEN_EXPERT_NAMES = ("mlp.experts.{expert}.{proj}", _PROJECTIONS)
# One expert's projection as `iter_hf_tensors` names it (a weight, or gpt-oss's bias), in the families whose
# checkpoints hold them as banks (`transformers_banks`).
_BANKED_EXPERT = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.(?P<block>feed_forward|mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<param>weight|bias)"
)
# Granite MoE's shared MLP (and Granite 4.0's dense MLP) as `iter_hf_tensors` names it (`_granite_checkpoint`).
_GRANITE_MLP = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.mlp\.(?:shared_expert\.)?(?P<proj>gate_proj|up_proj|down_proj)\.weight"
)
# The families whose llama.cpp files hold each head's q/k rows with its rope pairs interleaved (llama.cpp's turning):
# those of its `llama` architecture, whose converter permutes the checkpoint's halves (restored here), and Llama 4's
# and GLM-4's (the turned half of each head), ERNIE 4.5's and Cohere's, whose checkpoints hold them interleaved too
# (the model reorders them at load, `models.llama4`, `models.interleaved_rope`).
_ROPE_PERMUTED = ("llama", "mixtral", "ministral3", "arcee", *_GRANITE_TYPES, "nemotron_h", "olmo")  # (Nemotron-H's
# converter is Granite 4.0's; Ministral 3's, Arcee's and OLMo's, Llama's)
_ROPE_INTERLEAVED = (*_ROPE_PERMUTED, "llama4_text", "glm4", "ernie4_5", "ernie4_5_moe", "cohere", "cohere2")
# Families whose norms apply (1 + w), Gemma's RMSNorms and Nemotron-4's LayerNorm1P: llama.cpp's converter stores
# their norm weights as 1 + w.
_NORM_SHIFTED = ("gemma2", "gemma3_text", "nemotron")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Folded into config.json's rope_scaling: llama3's divisors, LongRoPE's factors.
_CONSUMED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}  # Gemma 4's rope_freqs:
# its proportional rope's turning angles (`gguf_metadata`)


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The HF parameter name of a GGUF tensor of a file of `architecture` (its `general.architecture`); None if
    unknown or already folded into the config."""
    if architecture in ("lfm2", "lfm2_moe") and gguf_name in _LFM2_GLOBAL:
        return _LFM2_GLOBAL[gguf_name]
    if architecture == "nemotron_h" and gguf_name in _NEMOTRON_H_GLOBAL:
        return _NEMOTRON_H_GLOBAL[gguf_name]
    if architecture in ("falcon_h1", "jamba") and gguf_name in _FALCON_H1_GLOBAL:
        return _FALCON_H1_GLOBAL[gguf_name]
    if gguf_name in CLASSIC_GLOBAL_NAMES.get(architecture, {}):
        return CLASSIC_GLOBAL_NAMES[architecture][gguf_name]
    if gguf_name in _OWN_GLOBAL_NAMES.get(architecture, {}):
        return _OWN_GLOBAL_NAMES[architecture][gguf_name]
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if architecture in ("gemma4_text", "gemma3n_text") and gguf_name in _GEMMA4_GLOBAL:
        return _GEMMA4_GLOBAL[gguf_name]
    bare_names = _BARE_LAYER_NAMES.get(architecture, {})
    layers = _LAYERS_PREFIX.get(architecture, "model.layers.")
    parameter = _LAYER_PARAMETER.fullmatch(gguf_name)
    if parameter is not None and parameter.group(2) in bare_names:
        return f"{layers}{parameter.group(1)}.{bare_names[parameter.group(2)]}"
    names = _ARCHITECTURE_LAYER_NAMES.get(architecture, _LAYER_NAMES)
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        return None
    layer, kind, param = match.groups()
    return f"{layers}{layer}.{names[kind]}.{param}"


@dataclass(frozen=True)
class ExpertSlice:
    """One expert's projection in a GGUF expert tensor: HF parameter `name`, held by rows `rows` of the tensor's
    expert `expert` (all of them, or a half of a fused gate/up bank's)."""

    name: str
    expert: int
    rows: slice

    def of(self, data: np.ndarray) -> np.ndarray:
        """This projection's part of `data`, the tensor's array or its blocks' bytes (`[experts, rows, ...]`): a
        view."""
        return data[self.expert, self.rows]


def prediction_layer_tensor(gguf_name: str, config: dict[str, Any]) -> bool:
    """Whether `gguf_name` is a tensor of a multi-token-prediction layer, which a file of `config` (its converted
    config.json) holds after its decoder layers (`blk.<n>` for n from `num_hidden_layers` on, as many as
    `num_nextn_predict_layers`: GLM-4.5's, with their `nextn.*` tensors): never read, as the checkpoint's are not."""
    if not config.get("num_nextn_predict_layers"):  # (DBRX's config names its layer count `n_layers`)
        return False
    match = _LAYER_PARAMETER.fullmatch(gguf_name)
    return match is not None and int(match.group(1)) >= int(config["num_hidden_layers"])


def hf_expert_slices(gguf_name: str, shape: tuple[int, ...], architecture: str) -> list[ExpertSlice] | None:
    """Each expert's projections in a GGUF expert tensor (`blk.N.ffn_gate_exps.weight`, a fused
    `ffn_gate_up_exps`, ...; gpt-oss's `.bias` too, `[experts, rows]`) of `shape` (`[experts, rows, ...]`) in a file
    of `architecture` (as `hf_tensor_name`), by expert and then by row; None when `gguf_name` is not one. Gemma 3n's
    stacked projections of its streams (`GEMMA3N_STACKS`) come as slices too, one a projection. ValueError for a
    fused bank whose rows do not split in halves."""
    if architecture == "gemma3n_text" and gguf_name in GEMMA3N_STACKS:  # Gemma 3n's streams' projections
        return [ExpertSlice(GEMMA3N_STACKS[gguf_name].format(i), i, slice(None)) for i in range(int(shape[0]))]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _EXPERT_BANKS:
        return None
    if architecture == "gemma4_text" or (match.group(3) == "bias" and architecture != "gpt_oss"):
        return None  # Gemma 4's banks load whole (`_GEMMA4_BARE`), as transformers holds them
    pattern, projections = _EXPERT_NAMES.get(architecture, _QWEN_EXPERT_NAMES)
    layer, param = match.group(1), match.group(3)
    layers = _LAYERS_PREFIX.get(architecture, "model.layers.")

    def name_of(expert: int, part: str) -> str:
        return f"{layers}{layer}.{pattern.format(expert=expert, proj=projections[part])}.{param}"

    return bank_slices(gguf_name, shape, _EXPERT_BANKS[match.group(2)], name_of)


def bank_slices(
    gguf_name: str, shape: tuple[int, ...], parts: tuple[str, ...], name_of: Callable[[int, str], str]
) -> list[ExpertSlice]:
    """Each expert's projections `parts` (`gate`, `up`, `down`; in the order its rows hold them) in GGUF tensor
    `gguf_name` of `shape` (`[experts, rows, ...]`), each named `name_of(expert, part)`, by expert and then by row.
    ValueError when the rows do not split evenly into the parts (a fused gate/up bank's into halves)."""
    width, rest = divmod(int(shape[1]), len(parts))
    if rest:
        raise ValueError(f"GGUF tensor {gguf_name!r}: {shape[1]} rows do not split into {' and '.join(parts)} halves")
    return [
        ExpertSlice(name_of(expert, part), expert, slice(i * width, (i + 1) * width))
        for expert in range(int(shape[0]))
        for i, part in enumerate(parts)
    ]


def rope_permuted(architecture: str) -> bool:
    """Whether a GGUF file of `architecture` (as `hf_tensor_name`) holds its q/k rows permuted from the checkpoint's
    (`unpermute_rope_rows` restores them)."""
    return architecture in _ROPE_PERMUTED


def rotated_projection(name: str) -> str | None:
    """"q" or "k" where HF tensor `name` is a layer's query or key projection (`self_attn.q_proj`; Nemotron-H's
    `mixer.q_proj`), whose rows a permuted file holds in another order; None for any other tensor."""
    for part in ("q", "k"):
        if f".self_attn.{part}_proj." in name or f".mixer.{part}_proj." in name:
            return part
    return None


def rope_interleaved(architecture: str) -> bool:
    """Whether a GGUF file of `architecture` (as `hf_tensor_name`) holds each head's q/k rows with its rope pairs
    interleaved, where ladle's layers take them as halves (`unpermute_rope_rows`): its permuted files' and Llama
    4's."""
    return architecture in _ROPE_INTERLEAVED


def transformers_banks(
    weights: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` (a GGUF file's, `iter_hf_tensors`) as transformers loads them, for the families whose checkpoints
    hold each layer's experts as banks, where they come one tensor per expert and projection (each bank yielded once
    all of a layer's experts are in); every other tensor as it comes:
    - Llama 4: `gate_up_proj` `[E, H, 2I]` (the gates' columns first) and `down_proj` `[E, I, H]`;
    - gpt-oss: `gate_up_proj` `[E, H, 2I]` and its bias `[E, 2I]` with gate and up columns alternating, `down_proj`
      `[E, I, H]` and its bias `[E, H]`;
    - Granite MoE and Granite 4.0 (`_granite_checkpoint`): `block_sparse_moe.input_linear` `[E, 2I, H]` (each
      expert's gate rows, then its up rows) and `output_linear` `[E, H, I]`; the shared MLP's gate and up rows joined
      into `shared_mlp.input_linear`, its down projection `shared_mlp.output_linear`;
    - DBRX (`gguf_dbrx.dbrx_checkpoint_banks`): `ffn.experts.mlp.w1`, `v1`, `w2`, `[E * I, H]` each."""
    model_type = config["model_type"]
    if model_type == "dbrx":  # (`gguf_dbrx.dbrx_checkpoint_banks`)
        yield from dbrx_checkpoint_banks(weights, int(config["ffn_config"]["moe_num_experts"]))
        return
    if model_type in _GRANITE_TYPES[1:]:
        yield from _granite_checkpoint(weights, int(config.get("num_local_experts") or 0))
        return
    if model_type not in ("llama4_text", "gpt_oss"):
        yield from weights
        return
    experts = int(config["num_local_experts"])
    params = ("weight", "bias") if model_type == "gpt_oss" else ("weight",)
    pending: dict[str, dict[tuple[str, str, int], torch.Tensor]] = {}
    for name, tensor in weights:
        match = _BANKED_EXPERT.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        layer = pending.setdefault(match["layer"], {})
        layer[match["param"], match["proj"], int(match["expert"])] = tensor
        if len(layer) < 3 * experts * len(params):
            continue
        del pending[match["layer"]]
        bank = f"model.layers.{match['layer']}.{match['block']}.experts"
        for param in params:
            suffix = "_bias" if param == "bias" else ""
            gate, up = _stacked(layer, param, "gate_proj", experts), _stacked(layer, param, "up_proj", experts)
            alternating = model_type == "gpt_oss"
            joined = torch.stack((gate, up), dim=-1).flatten(-2) if alternating else torch.cat((gate, up), dim=-1)
            yield f"{bank}.gate_up_proj{suffix}", joined.contiguous()
            yield f"{bank}.down_proj{suffix}", _stacked(layer, param, "down_proj", experts).contiguous()
    if pending:
        raise ValueError(f"layers {sorted(pending)} have experts missing")


def _granite_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """`transformers_banks` for Granite MoE and Granite 4.0 (`experts` per layer; 0: Granite 4.0's dense MLP, which
    its checkpoints hold as the shared MLP): each layer's banks and shared MLP once all of their parts are in."""
    banks: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    shared: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        expert, mlp = _BANKED_EXPERT.fullmatch(name), _GRANITE_MLP.fullmatch(name)
        if expert is not None:
            layer, parts = expert["layer"], banks.setdefault(expert["layer"], {})
            parts[expert["proj"], int(expert["expert"])] = tensor
            if len(parts) == 3 * experts:
                del banks[layer]
                prefix = f"model.layers.{layer}.block_sparse_moe."
                gate_up = [torch.cat((parts["gate_proj", e], parts["up_proj", e])) for e in range(experts)]
                yield f"{prefix}input_linear.weight", torch.stack(gate_up)
                yield f"{prefix}output_linear.weight", torch.stack([parts["down_proj", e] for e in range(experts)])
        elif mlp is not None:
            layer, projections = mlp["layer"], shared.setdefault(mlp["layer"], {})
            projections[mlp["proj"]] = tensor
            if len(projections) == 3:
                del shared[layer]
                prefix = f"model.layers.{layer}.shared_mlp."
                yield f"{prefix}input_linear.weight", torch.cat((projections["gate_proj"], projections["up_proj"]))
                yield f"{prefix}output_linear.weight", projections["down_proj"]
        else:
            yield name, tensor
    if banks or shared:
        raise ValueError(f"layers {sorted({*banks, *shared}, key=int)} have experts or shared MLP parts missing")


def _stacked(layer: dict[tuple[str, str, int], torch.Tensor], param: str, proj: str, experts: int) -> torch.Tensor:
    """Projection `proj`'s `param` of each of a layer's `experts` (`layer`: by (param, proj, expert)), stacked as a
    bank holds them: `[E, in, out]` for weights (each `[out, in]` transposed), `[E, out]` for biases."""
    parts = [layer[param, proj, expert] for expert in range(experts)]
    return torch.stack([part.T if param == "weight" else part for part in parts])


class GgufTensor(Protocol):
    """One tensor of a GGUF file as gguf's `ReaderTensor` gives it: `data` is its array (plain types) or its blocks'
    bytes `[rows..., bytes a row]` (quantized types), in numpy order."""

    @property
    def name(self) -> str: ...

    @property
    def tensor_type(self) -> GGMLQuantizationType: ...

    @property
    def data(self) -> np.ndarray: ...


@dataclass(frozen=True)
class IndexedTensor:
    """A `GgufTensor` found through a converted folder's `TENSOR_INDEX`: `data` views the mapped file."""

    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray


def indexed_tensors(gguf_path: Path, converted: Path | None = None) -> list[IndexedTensor]:
    """Every tensor of `gguf_path`, mapped and not read: located by `converted`'s `TENSOR_INDEX` when it has one
    (no parse of the file's metadata), else by gguf's reader."""
    index = None if converted is None else converted / TENSOR_INDEX
    if index is None or not index.is_file():
        return [IndexedTensor(t.name, t.tensor_type, t.data) for t in GgufFile(gguf_path).tensors]
    mapped = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    tensors = []
    for entry in json.loads(index.read_text(encoding="utf-8")):
        kind = GGMLQuantizationType(entry["type"])
        raw = mapped[entry["offset"] : entry["offset"] + entry["bytes"]].view(_ARRAY_TYPES.get(kind, np.uint8))
        tensors.append(IndexedTensor(entry["name"], kind, raw.reshape(entry["shape"])))
    return tensors


@overload
def iter_hf_tensors(
    tensors: Iterable[GgufTensor], config: dict[str, Any], spec: str, lazy: Literal[False] = False
) -> Iterator[tuple[str, torch.Tensor]]: ...


@overload
def iter_hf_tensors(
    tensors: Iterable[GgufTensor], config: dict[str, Any], spec: str, lazy: bool
) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]: ...


def iter_hf_tensors(
    tensors: Iterable[GgufTensor], config: dict[str, Any], spec: str, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Every tensor of a GGUF file as fp32 under its HF name (`config` is the converted config.json), with llama q/k
    rows restored, Gemma's norms back to the w of its (1 + w) (exact for 1 + w >= 0.5: the subtraction of 1 then
    rounds nothing), a mixture of experts' 3-D tensors as one tensor per expert (as checkpoints store them), and a
    Gated DeltaNet hybrid's tensors as its checkpoint holds them (`gguf_hybrid.CheckpointForm`).

    `lazy`: each comes unread (`LazyTensor`), its bytes dequantized only if loading reads it (what a quantized
    engine serves from the blocks is never dequantized); Qwen3-Next's q/k/v and z, joined again from two of the
    file's tensors, are read at once. ValueError names `spec` for a tensor of no known name or type."""
    model_type = config["model_type"]
    hybrid = CheckpointForm(HybridShape.from_config(config, model_type), model_type) \
        if model_type in TILED_VALUE_HEADS else None
    expansions: dict[str, dict[str, np.ndarray]] = {}  # a deepseek2 layer's attn_k_b / attn_v_b, until both are in
    for tensor in tensors:
        if tensor.name in _CONSUMED or prediction_layer_tensor(tensor.name, config):
            continue
        split = _SPLIT_EXPANSION.fullmatch(tensor.name) if model_type in _DEEPSEEK_TYPES else None
        if split is not None:
            parts = expansions.setdefault(split[1], {})
            parts[split[2]] = _dequantized(tensor, spec)
            if len(parts) == 2:
                del expansions[split[1]]
                try:
                    joined = joined_expansion(**parts)
                except ValueError as exc:
                    raise ValueError(f"model {spec!r}: layer {split[1]}: {exc}") from exc
                yield f"model.layers.{split[1]}.self_attn.kv_b_proj.weight", _float32(joined)
            continue
        try:
            experts = hf_expert_slices(tensor.name, tensor.data.shape, model_type)
        except ValueError as exc:
            raise ValueError(f"model {spec!r}: {exc}") from exc
        name = hf_tensor_name(tensor.name, model_type)
        if name is not None:
            name = classic_checkpoint_name(name, config)
        if name is None and experts is None:
            raise ValueError(f"model {spec!r}: unexpected GGUF tensor {tensor.name!r}")
        if experts is not None:
            for part in experts:
                yield part.name, _hf_weight(tensor, spec, part.name, lambda array: array, lazy, part.of(tensor.data))
            continue
        assert name is not None
        restore = _restore(name, config)
        if model_type == "stablelm" and name.endswith(HEADWISE_NORMS):  # one tensor a head in its checkpoints
            for checkpoint_name, row in headwise_norms(name, restore(_dequantized(tensor, spec))):
                yield checkpoint_name, _float32(row)
            continue
        if hybrid is not None and hybrid.holds_back(name):
            for checkpoint_name, array in hybrid.take(name, restore(_dequantized(tensor, spec))):
                yield checkpoint_name, _float32(array)
            continue
        if hybrid is not None and hybrid.changes(name):
            restore = _taken(hybrid, name, restore)
        yield name, _hf_weight(tensor, spec, name, restore, lazy, transposed=_conv1d(name, model_type))
    if hybrid is not None:
        hybrid.finish()
    yield from _xielu_tensors(config)
    if expansions:
        raise ValueError(f"model {spec!r}: layers {sorted(expansions, key=int)} have one of attn_k_b and attn_v_b")


def _xielu_tensors(config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Apertus's xIELU scalars, which its files hold as metadata (`xielu_parameters` in the converted config), as
    each layer's checkpoint tensors: `alpha_p` and `alpha_n` of shape [1], `beta` and `eps` 0-D (none for other
    models)."""
    for name, values in config.get("xielu_parameters", {}).items():
        shape = (1,) if name.startswith("alpha") else ()
        for layer, value in enumerate(values):
            yield f"model.layers.{layer}.mlp.act_fn.{name}", torch.tensor(value, dtype=torch.float32).reshape(shape)


def joined_expansion(k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """A latent attention layer's `kv_b_proj` `[heads * (nope + value), kv_lora_rank]` (each head's key rows, then
    its value rows), from the halves a `deepseek2` file holds apart: `attn_k_b` `k` `[heads, kv_lora_rank, nope]`
    (each head's key rows, transposed) and `attn_v_b` `v` `[heads, value, kv_lora_rank]`."""
    heads, rank = v.shape[0], v.shape[2]
    if k.shape[:2] != (heads, rank):
        raise ValueError(f"attn_k_b {k.shape} and attn_v_b {v.shape} are not one layer's halves")
    return np.concatenate((k.transpose(0, 2, 1), v), axis=1).reshape(-1, rank)


def check_tensor_types(tensors: Iterable[GgufTensor], spec: str) -> None:
    """ValueError naming `spec` for a tensor of a type gguf cannot dequantize (dequantizing one row of each)."""
    for tensor in tensors:
        rows = tensor.data.reshape(-1, tensor.data.shape[-1]) if tensor.data.ndim else tensor.data.reshape(1, 1)
        _dequantized(tensor, spec, rows[:1])


def _restore(name: str, config: dict[str, Any]) -> Callable[[np.ndarray], np.ndarray]:
    """What turns tensor `name`'s dequantized file values back into the checkpoint's (the identity for most)."""
    model_type = config["model_type"]
    if name.endswith(_FLATTENED_GATE):  # llama.cpp stores the [1, H] gate as [H]
        return lambda array: array.reshape(1, -1)
    if model_type in ("lfm2", "lfm2_moe") and name.endswith(_LFM2_CONVOLUTION):
        return lambda array: array.reshape(array.shape[0], 1, array.shape[-1])
    if model_type in _MAMBA_TYPES and name.endswith(_MAMBA_CONVOLUTION):
        return lambda array: array.reshape(array.shape[0], 1, array.shape[-1])
    if model_type in _MAMBA1_TYPES and name.endswith(_MAMBA_A_LOG):  # Mamba-1's: stored as -exp(A_log), [inner, N]
        return lambda array: np.log(-np.asarray(array, dtype=np.float32))
    if model_type in _MAMBA_TYPES and name.endswith(_MAMBA_A_LOG):  # stored as -exp(A_log)
        return lambda array: np.log(-np.asarray(array, dtype=np.float32)).reshape(-1)
    if model_type in _MAMBA_TYPES and name.endswith(_MAMBA_FLATTENED):
        return lambda array: array.reshape(-1)
    rotated = rotated_projection(name) if rope_permuted(model_type) else None
    if rotated is not None:
        heads = config["num_attention_heads"] if rotated == "q" else config["num_key_value_heads"]
        return lambda array: unpermute_rope_rows(array, heads)
    if _conv1d(name, model_type):  # GPT-2's, `[in, out]` in its checkpoints
        return lambda array: np.ascontiguousarray(np.asarray(array).T)
    if model_type in ("gpt_neox", "falcon", "bloom") and name.endswith(("query_key_value.weight",
                                                                         "query_key_value.bias")):
        heads = config["num_attention_heads"]  # their converters' cat(q, k, v), grouped by KV head again
        kv_heads = falcon_kv_heads(config) if model_type == "falcon" else heads
        return lambda array: kv_grouped_qkv_rows(array, heads, kv_heads)
    if model_type in _NORM_SHIFTED and name.endswith("norm.weight"):
        return lambda array: np.asarray(array, dtype=np.float32) - np.float32(1.0)
    return lambda array: array


def _conv1d(name: str, model_type: str) -> bool:
    """Whether HF tensor `name` of a `model_type` model is a Conv1D weight, `[in, out]` (GPT-2's)."""
    return model_type == "gpt2" and name.endswith(CONV1D_WEIGHTS)


def _taken(
    hybrid: CheckpointForm, name: str, restore: Callable[[np.ndarray], np.ndarray]
) -> Callable[[np.ndarray], np.ndarray]:
    """`restore`, then what `hybrid` changes in tensor `name` (one it gives back at once, alone)."""

    def restored(array: np.ndarray) -> np.ndarray:
        ((_, taken),) = hybrid.take(name, restore(array))
        return taken

    return restored


def _hf_weight(
    tensor: GgufTensor, spec: str, name: str, restore: Callable[[np.ndarray], np.ndarray], lazy: bool,
    data: np.ndarray | None = None, transposed: bool = False,
) -> torch.Tensor | LazyTensor:
    """`tensor` (or `data`, a part of its array: an expert's projection), HF tensor `name`, dequantized and
    restored, now or (`lazy`) when read; `transposed`: `restore` transposes it (GPT-2's Conv1D weights)."""
    data = tensor.data if data is None else data

    def read() -> torch.Tensor:
        return _float32(restore(_dequantized(tensor, spec, data)))

    if not lazy:
        return read()
    plain = tensor.tensor_type in _ARRAY_TYPES
    shape = tuple(data.shape) if plain else quant_shape_from_byte_shape(data.shape, tensor.tensor_type)
    if name.endswith(_FLATTENED_GATE):
        shape = (1, int(np.prod(shape)))
    elif name.endswith((_SQUEEZED_CONVOLUTION, _LFM2_CONVOLUTION, *_MAMBA_CONVOLUTION)):
        shape = (shape[0], 1, *shape[1:])
    elif name.endswith(_MAMBA_FLATTENED) and not (name.endswith(_MAMBA_A_LOG) and len(shape) == 2 and shape[1] > 1):
        shape = (int(np.prod(shape)),)  # (Mamba-1's A_log, `[inner, N]`, keeps its rows)
    elif transposed:
        shape = tuple(reversed(shape))
    return LazyTensor(ComputedSlice(shape, read))


def _dequantized(tensor: GgufTensor, spec: str, data: np.ndarray | None = None) -> np.ndarray:
    """`data` (default: all of `tensor`) dequantized to fp32: a matrix of the types ladle serves from their blocks
    by `gguf_blocks` (gguf's values, 2-3x faster), anything else by gguf; ValueError naming `spec` for a type gguf
    lacks."""
    data = tensor.data if data is None else data
    values = dequantize_blocks(data, tensor.tensor_type)
    if values is not None:
        return values.numpy()
    try:
        return dequantize(data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(
            f"model {spec!r}: tensor {tensor.name!r} has unsupported quantization {tensor.tensor_type.name}"
        ) from exc


def _float32(array: np.ndarray) -> torch.Tensor:
    """`array` as a writable, contiguous fp32 tensor (F32 tensors come as read-only views of the file: copied)."""
    return torch.from_numpy(np.require(array, np.float32, ["C", "W"]))


def write_sharded_safetensors(tensors: Iterable[tuple[str, torch.Tensor]], folder: Path) -> None:
    """Write `model.safetensors`, or HF-style numbered shards plus an index when over `SHARD_BYTES`."""
    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        save_file(pending, str(folder / f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
        shards.append(list(pending))
        pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        pending[name] = tensor
        pending_bytes += tensor.numel() * tensor.element_size()
        if pending_bytes >= SHARD_BYTES:
            flush()
    if pending or not shards:
        flush()
    if len(shards) == 1:
        os.replace(folder / "shard-0.tmp", folder / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(folder / f"shard-{i}.tmp", folder / file_name)
        weight_map.update(dict.fromkeys(names, file_name))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")


# Held while transformers parses a file with `GgufFile` in gguf's reader's place (`_gguf_parsed_fast`).
_READER_SWAP = threading.Lock()


@contextlib.contextmanager
def _gguf_parsed_fast(path: Path, parsed: GgufFile | None = None) -> Iterator[None]:
    """transformers parses the file again for the config beside its tokenizer: transformers 4 with gguf's reader (2 s
    for the embedded model's vocabulary), 5 with a reader of its own that walks the strings in Python (0.45 s, twice).
    Inside this block gguf's reader is `GgufFile`, which reads every field the same, ~20x faster, and `path`, when it
    is already `parsed`, is not parsed again (transformers only reads a reader's fields and tensors); transformers 5's
    reader answers from `parsed` (`transformers_metadata`). One block at a time (threads wait on `_READER_SWAP`), the
    readers back after it."""
    import gguf

    def reader(file: str | os.PathLike[str], mode: Literal["r", "r+", "c"] = "r") -> GgufFile:
        if parsed is not None and mode == "r" and Path(file).resolve() == path.resolve():
            return parsed
        return GgufFile(file, mode)

    swaps: list[tuple[Any, str, Any]] = [(gguf, "GGUFReader", reader)]
    try:
        from transformers.integrations import gguf as transformers_gguf
        from transformers.integrations.gguf import reader as transformers_reader
    except ImportError:  # transformers 4
        pass
    else:
        own = transformers_reader.read_gguf_metadata

        def metadata(file: str, string_arrays: Container[str] = ()) -> tuple[dict[str, Any], tuple[str, ...]]:
            if parsed is not None and Path(file).resolve() == path.resolve():
                read = transformers_metadata(parsed, string_arrays)
                if read is not None:
                    return read
            return own(file, string_arrays)

        swaps.append((transformers_reader, "read_gguf_metadata", metadata))
        swaps.append((transformers_gguf, "read_gguf_metadata", metadata))  # the name its config reader imports
    with _READER_SWAP:
        originals = [(module, name, getattr(module, name)) for module, name, _ in swaps]
        for module, name, replacement in swaps:
            setattr(module, name, replacement)
        try:
            yield
        finally:
            for module, name, original in originals:
                setattr(module, name, original)


def save_gguf_tokenizer(
    gguf_path: Path, folder: Path, config: dict[str, Any], spec: str, parsed: GgufFile | None = None
) -> None:
    """Build the tokenizer (and chat template) from GGUF metadata with transformers and save it; `parsed`: the file
    as `GgufFile` has read it already (else transformers' reads parse it anew)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # heavy import, only on the cold path

    try:
        with _gguf_parsed_fast(gguf_path, parsed):
            try:
                tokenizer = AutoTokenizer.from_pretrained(
                    str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
                )
            except Exception:  # transformers raises many types for a config it cannot read
                # transformers reads no config from this file (qwen3next's architecture; Gemma 4's per-layer MLP
                # widths): the tokenizer is built from the file's tokenizer.ggml.* keys alone, as AutoTokenizer's is.
                tokenizer = PreTrainedTokenizerFast.from_pretrained(
                    str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
                )
    except Exception as exc:  # transformers raises many types for a missing or odd vocabulary
        raise ValueError(f"model {spec!r}: cannot build a tokenizer from the GGUF metadata: {exc}") from exc
    tokenizer.model_max_length = config.get("max_position_embeddings") or config["max_seq_len"]  # (DBRX's name)
    tokenizer.save_pretrained(str(folder))


def write_tensor_index(reader: GGUFReader, folder: Path) -> None:
    """`TENSOR_INDEX` of `reader`'s file into `folder`: per tensor its GGUF name, type, shape (numpy order, as
    `ReaderTensor.data` has it), absolute data offset and size in bytes."""
    entries = [
        {"name": t.name, "type": int(t.tensor_type), "shape": list(t.data.shape), "offset": int(t.data_offset),
         "bytes": int(t.n_bytes)}
        for t in reader.tensors
    ]  # fmt: skip
    (folder / TENSOR_INDEX).write_text(json.dumps(entries), encoding="utf-8")


def convert_gguf(gguf_path: Path, folder: Path, spec: str) -> None:
    """Write the HF form of `gguf_path`'s metadata into the existing empty `folder`: config.json, the tokenizer, an
    embedding model's pooling as a sentence-transformers configuration (`engine_server.pooling`) and the file's
    `TENSOR_INDEX`; no weights (module docstring). ValueError naming `spec` for a tensor whose name or type could
    not be read, found now rather than at a load."""
    reader = GgufFile(gguf_path)
    config = hf_config_from_gguf(reader, spec)
    check_tensor_types(reader.tensors, spec)
    for _ in iter_hf_tensors(reader.tensors, config, spec, lazy=True):  # every tensor's name known, none read
        pass
    write_tensor_index(reader, folder)
    save_gguf_tokenizer(gguf_path, folder, config, spec, parsed=reader)
    pooling = gguf_pooling(reader)
    if pooling is not None:  # normalized, as llama.cpp's server returns embeddings
        write_sentence_transformers_pooling(folder, pooling, normalize=True, dimension=config["hidden_size"])
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def cache_key(gguf_path: Path) -> str:
    """A short digest of the file's identity (name, size, mtime) and the converter version."""
    stat = gguf_path.stat()
    identity = f"{CONVERTER_VERSION}\0{gguf_path.name}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def cached_gguf_folder(gguf_path: Path, cache_dir: Path) -> Path:
    """Where `gguf_path`'s conversion lives (or would live) under `cache_dir`."""
    return cache_dir / "gguf" / f"{gguf_path.stem}-{cache_key(gguf_path)}"


def drop_float_copies(entries: Path) -> list[Path]:
    """Remove, and return, the entries under `entries` (a cache's `gguf` folder) that hold safetensors: float copies
    that converters before version 7 wrote (~7x their file), which no later version reads (the version is in every
    entry's key). Entries of this version hold none; a conversion in progress (a hidden staging folder) is left."""
    dropped = [
        entry for entry in entries.iterdir()
        if entry.is_dir() and not entry.name.startswith(".") and any(entry.glob("*.safetensors"))
    ]  # fmt: skip
    for entry in dropped:
        shutil.rmtree(entry, ignore_errors=True)
    return dropped


def ensure_converted(gguf_path: Path, cache_dir: Path, spec: str) -> Path:
    """Return the cached HF folder of `gguf_path`, converting it first if no complete entry exists; a conversion
    also removes the cache's float copies (`drop_float_copies`)."""
    final = cached_gguf_folder(gguf_path, cache_dir)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    drop_float_copies(final.parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared between users
        convert_gguf(gguf_path, staging, spec)
        try:
            staging.rename(final)
        except OSError:
            if not final.is_dir():  # a concurrent conversion winning the race is fine; anything else is not
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
