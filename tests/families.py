"""Tiny random models of each decoder family, saved by transformers into a folder as a real checkpoint is (nothing
fetched), and transformers' own greedy decoding on them: the oracle the engine's float path must equal token for
token.

A folder holds the family's safetensors and config.json, and the embedded model's tokenizer (every id it emits fits
the 49,152-token vocabulary). Weights are drawn wider than transformers' init (std 0.02 leaves every logit near
every other), and routers wider still (though not so wide that one expert takes all the weight, which would hide
how the others' weights are combined), so that neither the next token nor an expert choice is a near-tie that
float rounding could flip.
"""

from __future__ import annotations

import contextlib
import math
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import write_gpt2_tokenizer
from engine_server.hf_classic import falcon_kv_heads
from ladle_kernels.reference import grouped_qkv_rows
from tests.unit.pooling.embedding_models import copy_tokenizer

VOCAB_SIZE = 49152
_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
# Phi-3 (LongRoPE): rope over 12 of each head's 16 dims, short factors up to 32 tokens, long ones past that (the
# tests' prompts are either side of it, and some cross it while they decode).
PHI3_ROTARY_PAIRS = 6
PHI3_LONGROPE = {
    "rope_type": "longrope", "original_max_position_embeddings": 32,
    "short_factor": [1.0 + 0.25 * i for i in range(PHI3_ROTARY_PAIRS)],
    "long_factor": [3.0 + 2.0 * i for i in range(PHI3_ROTARY_PAIRS)],
}  # fmt: skip
# DBRX's config under its own names (transformers' `hidden_size` alias alone leaves the experts 2,048 wide).
DBRX: dict[str, Any] = {
    "d_model": 64, "n_heads": 4, "n_layers": 4, "max_seq_len": 1024,
    "attn_config": {"kv_n_heads": 2, "clip_qkv": 1.0, "rope_theta": 500_000.0},
    "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0},
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
# Sliding windows: 20 positions, more than a 16-token block and less than two, so a window starts mid-block and
# spans blocks; the tests' prompts are shorter and longer than that.
WINDOW = 20
# Each family's transformers config class and what sets its quirks apart. Phi-3: fused qkv_proj and gate_up_proj
# checkpoints, and in the second partial rotary with LongRoPE. MoE: Mixtral's top-2 of 4 renormalised; Qwen3-MoE's
# top-3 of 8 small experts renormalised, one dense layer; Qwen2-MoE's top-2 of 4 not renormalised, beside a
# sigmoid-gated shared expert, with q/k/v biases. Sliding windows: Mistral's on every layer; Qwen2's on the layers
# from `max_window_layers` on (so full and windowed layers alternate in one model); Phi-3's with its fused
# projections. Gemma 3: one global layer in four (linear rope scaling, base 1e6) among windowed ones (base 1e4), q/k
# norms, sandwich norms stored as (1 + w), scaled tied embeddings, GeGLU, a query scale of 24 ** -0.5, not 16's.
# Gemma: Llama's pre-norm block with Gemma's (1 + w) norms, scaled tied embeddings and GeGLU.
# Gemma 2: Gemma's block without q/k norms, windows on alternate layers, and soft-capping tight enough to bend these
# small models' attention scores (a real model's cap of 50 would leave them as they are).
# gpt-oss: attention sinks, biases on q/k/v/o, the router and the experts, windows on the even layers, YaRN (over a
# 64-token original context: every position's rope differs from plain rope's), top-2 of 4 experts with the clamped
# SwiGLU (a limit of 1 clamps many of these activations; the released 7 would clamp few).
# SmolLM3: Llama's block with no rope on every second layer (every fourth in the released model).
# Granite: Llama's block with Granite 3.x's multipliers (embeddings x12, scores x1/64, residuals x0.22, logits /8).
# DeepSeek-V3: latent attention (rank-48 queries, a rank-32 latent, 16 nope + 8 interleaved rope dims per key, 16
# per value) under YaRN with mscale; one dense layer, then 8 experts in 4 groups (2 chosen), 2 per token, sigmoid
# scores with a load-balancing bias, scaled by 2.5, beside a shared expert.
# MiniMax-M2: q/k norms over the whole projection, rope over half of each head (its legacy `rotary_dim`), top-2 of 8
# experts in every layer by sigmoid scores with a load-balancing bias, renormalised.
# GLM-4: Gemma's sandwich norms under its own names with plain weights, fused gate/up, q/k/v biases, rope over the
# first half of each 24-wide head with its pairs interleaved.
# GLM-4.5: grouped-query attention with q/k/v biases, per-head q/k norms and rope over half of each head (its
# default), then DeepSeek-V3's experts: one dense layer, 8 experts in 2 groups (1 chosen, as GLM-4.5's one group
# would not exercise), 2 per token, sigmoid scores with a load-balancing bias, scaled by 2.5, beside a shared expert.
# GLM-4.7-Flash: DeepSeek-V3's latent attention and experts (top-2 of 8 in one group, scaled by 1.8), dense and
# sparse layers alternating as `mlp_layer_types` names them.
# DeepSeek-V2: that attention with its complex rope, softmax routing within the best 2 of 4 groups (each scored by
# its best expert), weights scaled, not renormalised.
# OLMo 2: norms after the attention and the MLP only, q/k norms over the whole projection. OLMo 3: that block with
# windows on three layers in four, YaRN on the full-attention ones only.
# Llama 4: NoPE on alternate layers (every fourth in the released models) with a temperature steep enough to move
# these short prompts' queries (floor 4, scale 0.5; the released 8192 and 0.1 would not), weightless q/k norms on
# the rope layers, interleaved rope pairs under Llama 3 scaling; top-1 of 4 experts on alternate layers (Maverick's
# interleaving), each chosen expert's input scaled by its sigmoid score, beside a shared expert; dense layers wider.
# Hunyuan-A13B's form: per-head q/k norms after rope, rope's base stretched by NTK's alpha, top-2 of 4 experts by
# softmax beside an ungated shared MLP (its counts per layer, as Hunyuan-A13B's config.json gives them).
# Arcee AFM: Llama's block with an ungated relu² MLP, under YaRN (AFM-4.5B's 64K context).
# Jais 2: Llama with biased LayerNorms, q/k/v/o biases and an ungated relu² MLP with biases.
# CWM: Llama under its Llama 3 rope scaling, windows on three layers in four (its default pattern).
# Apertus: per-head q/k norms before rope, an ungated MLP with xIELU (its scalars drawn per layer), Apertus 8B's Llama 3
# rope scaling (factor 8 over 8,192: with its base of 12M most of these 16-wide heads' frequencies are scaled).
# PhiMoE: Mixtral's layout with biased LayerNorms, q/k/v/o and LM head biases, LongRoPE with its mscale (the prompts
# stay short of its original context: transformers' PhiMoE keeps the short factors past it), top-2 of 4 experts by
# its sparsemixer, its reach widened to 0.1 (the released 0.01 weighs most chosen experts 1).
# Solar Open: GLM-4.5's experts (top-2 of 8 by sigmoid scores and a correction bias, a shared one) on every layer
# under Llama's attention. AFMoE (Arcee Trinity): gated attention, q/k norms, rope on its windowed layers alone (three
# in four), sandwich norms; top-2 of 8 experts by sigmoid scores and a routing bias beside a shared one, after a
# dense first layer. Hy3: GLM-4.5's layout under Apertus's attention, its routing scaled by 2.5. FlexOlmo: OLMoE's
# experts (top-2 of 4) and q/k norms under OLMo 2's post-norm block. K-EXAONE: GLM-4.5's experts after a dense first
# layer under EXAONE 4's attention (per-head q/k norms, windows on three layers in four, the fourth without rope) in
# a pre-norm block.
# GPT-NeoX: head-by-head fused q/k/v, rope over a quarter of each head, the attention and an exact-GELU MLP in
# parallel off LayerNorms of their own. GPT-2: learned positions, Conv1D weights, tied embeddings; GPT-BigCode: learned
# positions, one KV head. GPT-J: the parallel block off one LayerNorm, rope over half of each head with its pairs
# interleaved, an LM head bias. Falcon 7B: one KV head, the parallel block off one LayerNorm; Falcon 40B: two
# KV heads (q/k/v grouped by KV head), the parallel block off two norms, biases. Phi-2: one LayerNorm feeding both,
# rope over 0.4 of each head, an LM head bias.
# StableLM 2 12B: a LayerNorm of each head's own over q and k, Phi's parallel block over a SwiGLU MLP. StarCoder2:
# biases everywhere, a GELU (tanh) MLP, every layer windowed.
# Ministral 3: Mistral under YaRN with Llama 4's query temperature on every layer, over a 32-token original context
# (these prompts reach five of its steps) and steeper (beta 0.5; the released 0.1 over 16,384 tokens).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3": ("Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "phi3-longrope": (
        "Phi3Config",
        {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "partial_rotary_factor": 0.75,
         "original_max_position_embeddings": 32, "rope_scaling": PHI3_LONGROPE},
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Laguna: windowed and full layers in turn (each kind its rope base, the full ones' rope over half of each head),
    # 4, 8, 4 and 2 query heads over 2 KV heads, per-head q/k norms, each head's output times softplus of its gate; a
    # dense first layer, then top-2 of 8 experts by sigmoid scores and a correction bias, renormalised, scaled, beside
    # a shared expert.
    "laguna": (
        "LagunaConfig",
        {"head_dim": 16, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"] * 2,
         "num_attention_heads_per_layer": [4, 8, 4, 2], "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "moe_routed_scaling_factor": 2.5,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Kolibri-1: per-head q/k norms, three windowed layers and a full one without rope, GLM-4's sandwich norms, top-2
    # of 8 experts chosen by logit plus bias (their sigmoid scores renormalised) beside a shared expert on every layer.
    "kolibri1": (
        "Kolibri1Config",
        {"head_dim": 16, "sliding_window": WINDOW, "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
         "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 96, "norm_topk_prob": True, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    # DiffLlama: Llama's blocks with differential attention (4 heads in two halves over 2 KV heads whose values split
    # in two, a learned lambda per layer).
    "diffllama": ("DiffLlamaConfig", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Kolibri-1.1: Kolibri-1's layers, windowed ones with rope (0, 3) beside indexed ones without (1, 2, 4: the last
    # two over layer 1's K/V, layers 1 and 4 picking pools of 8 blocks of 4 keys past 32 keys), each indexed layer
    # keeping the best 8 keys of its pool beside 2 sinks and the last 4 (past 14 keys), scored by 2 query heads; a
    # dense first MLP.
    "kolibri1.1": (
        "Kolibri1_1Config",
        {"num_hidden_layers": 5, "head_dim": 16, "sliding_window": WINDOW,
         "layer_types": ["sliding_attention", "indexed_attention", "indexed_attention", "sliding_attention",
                         "indexed_attention"],
         "index_layers": [1, 4], "kv_source_layers": [0, 1, 1, 3, 1], "index_topk": 8, "index_pool_size": 32,
         "index_compression": 4, "index_num_heads": 2, "index_num_local_tokens": 4, "index_num_sink_tokens": 2,
         "mlp_only_layers": [0], "mlp_only_intermediate_size": 96, "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 96, "norm_topk_prob": True,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Flint: per-head q/k norms, a sink per head, full attention without rope on the first two layers and the last
    # (its default pattern), a window with rope on the third; dense first two MLPs (its default), then top-2 of 8
    # experts by sigmoid score beside an ungated shared expert.
    "flint": (
        "FlintConfig",
        {"head_dim": 16, "sliding_window": WINDOW, "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    # NanoChat: weightless RMSNorms (the embeddings' too), q/k norms after its reversed rope, relu², capped logits.
    "nanochat": ("NanoChatConfig", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "phimoe": (
        "PhimoeConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "attention_bias": True, "lm_head_bias": True,
         "router_jitter_noise": 0.1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         "original_max_position_embeddings": 512,
         "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 512,
                             "short_factor": [1.0 + 0.25 * i for i in range(8)], "long_factor": [4.0] * 8,
                             "short_mscale": 1.2, "long_mscale": 1.2}},
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": True,
         "mlp_only_layers": [1], "head_dim": 16},
    ),
    "olmoe": (
        "OlmoeConfig",
        {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "clip_qkv": 1.5},
    ),
    # Sarvam 30B and Param2: GLM-4.5's model saved under the Ling models' names (`query_key_value`, `dense`,
    # `query_layernorm`, `word_embeddings`), as their checkpoints hold it.
    "sarvam-moe": (
        "SarvamMoEConfig",
        {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "num_shared_experts": 1, "first_k_dense_replace": 1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "param2moe": (
        "Param2MoeConfig",
        {"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # OPT (125M to 66B's form): learned positions, biased LayerNorms and projections, a ReLU MLP, tied embeddings.
    "opt": ("OPTConfig", {"ffn_dim": 96, "word_embed_proj_dim": 64, "pad_token_id": 0, "bos_token_id": 1,
                          "eos_token_id": 2}),
    # GPT-Neo (125M to 2.7B's form, the TinyStories models'): learned positions, global and local layers in turn (a
    # 20-position window), unscaled scores, a GELU (tanh) MLP, tied embeddings.
    "gpt-neo": ("GPTNeoConfig", {"attention_types": [[["global", "local"], 2]], "window_size": WINDOW,
                                 "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # MiniCPM5-MoE: a dense first layer, then top-2 of 8 experts by sigmoid score and a routing bias beside a shared
    # expert (DeepSeek-V3's router), under Llama's attention with each query dim's output gated by a sigmoid.
    "minicpm5-moe": (
        "MiniCPM5MoeConfig",
        {"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # DBRX: top-2 of 4 experts (each layer's stored as one tensor a projection), bias-free LayerNorms, q/k/v in one
    # projection clamped to 1.0, 500,000 as the rope base in both places a config states it (transformers 5 builds
    # the rope from `rope_parameters` and needs `attn_config`'s too; ladle reads `attn_config`'s, the released one).
    "dbrx": ("DbrxConfig", DBRX),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 64},
    ),
    "mistral-window": ("MistralConfig", {"sliding_window": WINDOW, "head_dim": 16}),
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}),
    "phi3-window": ("Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": WINDOW}),
    "gemma3": (
        "Gemma3TextConfig",
        {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW, "tie_word_embeddings": True,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}},
    ),
    # Gemma 4: six layers, two of them full attention with heads of their own (32 wide, one KV head, values from the
    # keys' projection, proportional rope turning a quarter of the angles); the last two attend over layers 2's and
    # 3's K/V (the layers before them end on a full-attention one, as llama.cpp assumes) and have MLPs twice as
    # wide; per-layer inputs 16 wide; final logits soft-capped.
    "gemma4": (
        "Gemma4TextConfig",
        {"head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
         "sliding_window": WINDOW, "num_hidden_layers": 6, "tie_word_embeddings": True,
         "layer_types": ["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"],
         "num_kv_shared_layers": 2,
         "use_double_wide_mlp": True, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB_SIZE,
         "final_logit_softcapping": 30.0},
    ),
    # Gemma 4 Unified (Gemma 4 12B's text model): Gemma 4's layers without per-layer inputs or experts, the
    # full-attention ones 32 wide with proportional rope.
    "gemma4-unified": (
        "Gemma4UnifiedTextConfig",
        {"head_dim": 16, "sliding_window": WINDOW,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
         "per_layer_config": {"1": {"head_dim": 32}, "3": {"head_dim": 32}}, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    # Gemma 3n: AltUp's four streams, LAuReL, the first two layers' MLPs sparse, windows on four layers in six, the
    # last two attending over the third's and fourth's K/V, per-layer inputs 16 wide, logits soft-capped.
    "gemma3n": (
        "Gemma3nTextConfig",
        {"num_hidden_layers": 6, "head_dim": 16, "sliding_window": WINDOW, "num_kv_shared_layers": 2,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
         "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB_SIZE - 1000, "laurel_rank": 8,
         "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0, 0.0, 0.0], "final_logit_softcapping": 30.0,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Gemma 4's mixture of experts (26B A4B's block): top-2 of 4 GELU experts beside each layer's dense MLP, no
    # per-layer inputs or shared K/V.
    "gemma4-moe": (
        "Gemma4TextConfig",
        {"head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
         "sliding_window": WINDOW, "tie_word_embeddings": True,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
         "hidden_size_per_layer_input": 0, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
         "moe_intermediate_size": 32, "final_logit_softcapping": 30.0},
    ),
    "gemma": ("GemmaConfig", {"head_dim": 16, "tie_word_embeddings": True}),
    "gemma2": (
        "Gemma2Config",
        {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW, "attn_logit_softcapping": 1.0,
         "final_logit_softcapping": 3.0},
    ),
    # VaultGemma: Gemma 2's windows and soft-caps in a pre-norm block.
    "vaultgemma": (
        "VaultGemmaConfig",
        {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW, "attn_logit_softcapping": 1.0,
         "final_logit_softcapping": 3.0},
    ),
    # HyperCLOVA X SEED: Granite's multipliers (the logits multiplied) with a norm after each sub-layer's output.
    "hyperclovax": (
        "HyperCLOVAXConfig",
        {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 1.5, "attention_multiplier": None,
         "pad_token_id": 0},
    ),
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2, "pad_token_id": 0}),
    "deepseek-v3": (
        "DeepseekV3Config",
        {"num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 32,
         "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}},
    ),
    # DeepSeek-V3.2: DeepSeek-V3's layout with a lightning indexer on every layer choosing 16 positions per query
    # (the prompts reach 140), 8 index heads 16 wide; GLM-5: the same with the indexer's rope pairs interleaved and
    # layer 2 reusing layer 1's choice.
    "deepseek-v32": (
        "DeepseekV32Config",
        {"num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 16,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 32,
         "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2},
    ),
    "glm-moe-dsa": (
        "GlmMoeDsaConfig",
        {"num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 16,
         "index_topk_pattern": "FFSF", "n_routed_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "routed_scaling_factor": 2.5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # HY-V4: DeepSeek-V3.2's indexed latent attention (16 positions, rope on the index heads' last dims, layers 2
    # and 3 reusing layer 1's choice), a sigmoid gate per value dim and a sink per head, the experts' SwiGLU clamped
    # at 1 (their products reach ~2), four residual streams. 16 index heads: with 8, a position whose every head's
    # relu was 0 scored exactly 0 often enough that such ties fell at the 16th place, which transformers and we break
    # otherwise (one prompt in eight moved, alone or batched by turns).
    "hy-v4": (
        "HYV4Config",
        {"q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
         "index_n_heads": 16, "index_head_dim": 16, "index_topk": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "swiglu_limit": 1.0,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # BitNet b1.58 with float projections: Llama with norms before o_proj and down_proj, a gated relu² MLP (its ternary
    # checkpoints: tests/unit/test_bitnet.py).
    "bitnet": ("BitNetConfig", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # LongCat-Flash: two layers of two latent-attention blocks with dense MLPs, each layer's experts (8 of 32 wide and
    # 4 zero-computation ones, 3 a token by softmax score plus a bias, scaled by 2.5) beside its blocks.
    "longcat-flash": (
        "LongcatFlashConfig",
        {"num_key_value_heads": 4, "expert_ffn_hidden_size": 32, "n_routed_experts": 8, "zero_expert_num": 4,
         "moe_topk": 3, "routed_scaling_factor": 2.5, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "head_dim": 8, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    # DeepSeek-V4: windows of 16 positions; HCA entries of 16 positions (layer 0), CSA ones of 4 with the indexer
    # keeping 8 a query (16 index heads, as HY-V4's, against exact-0 ties) on layers 1 and 3, a sliding layer 2; the
    # first layer's experts by token id, the rest by sqrt(softplus) scores and a bias, their SwiGLU (and the shared
    # expert's) clamped at 1; two mHC streams.
    "deepseek-v4": (
        "DeepseekV4Config",
        {"head_dim": 16, "partial_rotary_factor": 0.5, "q_lora_rank": 24, "sliding_window": 16,
         "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                         "compressed_sparse_attention"],
         "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
         "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "o_groups": 2, "o_lora_rank": 16,
         "index_n_heads": 16, "index_head_dim": 16, "index_topk": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "hc_mult": 2, "swiglu_limit": 1.0, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    # A.X K2: DeepSeek-V3.2's indexed latent attention (16 positions a query), its queries and a sigmoid gate per
    # value dim from the query latent beside its norm, gated input norms (and before each sparse layer's experts),
    # the first layer dense, routing over all 8 experts.
    "axk2": (
        "AXK2Config",
        {"num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 16,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
         "routed_scaling_factor": 2.5, "gated_norm_rank": 8, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    # A.X K1: DeepSeek-V3's layout, each sparse layer's MoE output RMS-normalised, dense and sparse layers alternating.
    "axk1": (
        "AXK1Config",
        {"num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
         "topk_group": 2, "moe_intermediate_size": 32, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
         "mlp_layer_types": ["dense", "sparse", "dense", "sparse"], "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    # JetMoE: top-2 of 8 attention experts (each a query per KV head: 2 KV heads of 16) and of 8 MLP experts 32 wide,
    # each mixture's output biased.
    "jetmoe": (
        "JetMoeConfig",
        {"kv_channels": 16, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
         "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Beam: windowed layers (20 positions) with rope between full ones without (their queries scaled by position),
    # gated heads, q/k/v/o biases, depth-scaled sandwich blocks; a dense first MLP, then top-2 of 8 experts within the
    # best 2 of 4 groups; logits capped at 30.
    "beam": (
        "BeamConfig",
        {"head_dim": 16, "sliding_window": WINDOW, "attention_bias": True,
         "layer_types": ["sliding_attention", "full_attention"] * 2, "mlp_layer_types": ["dense"] + ["sparse"] * 3,
         "num_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 32,
         "routed_scaling_factor": 2.5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Ergo: windowed layers (20 positions) with rope over interleaved pairs between full ones without (scores times
    # 1.5), gated residual adds; a dense relu² first MLP, then top-2 of 8 relu² experts each normalised, beside a
    # normalised shared one.
    "ergo": (
        "ErgoConfig",
        {"global_attention_every_n_layers": 2, "sliding_window": WINDOW, "first_dense_intermediate_size": 96,
         "moe_intermediate_size": 32, "shared_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
         "global_attention_scale": 1.5, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default",
         "rope_theta": 10000.0}, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # MiniMax-M3: full attention on layer 0, block-sparse on the rest (2 index heads, blocks of 4 positions, 4 kept a
    # query, its own among them: prompts past 16 tokens attend sparsely), rope over half of each head; a dense first
    # MLP, then top-2 of 8 experts by sigmoid scores and a bias beside a shared expert, every MLP's SwiGLU clamped at 1.
    "minimax-m3": (
        "MiniMaxM3VLTextConfig",
        {"head_dim": 16, "partial_rotary_factor": 0.5,
         "layer_types": ["full_attention"] + ["minimax_m3_sparse"] * 3, "mlp_layer_types": ["dense"] + ["sparse"] * 3,
         "index_n_heads": 2, "index_head_dim": 16, "index_block_size": 4, "index_topk_blocks": 4,
         "index_local_blocks": 1, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
         "dense_intermediate_size": 96, "shared_intermediate_size": 32, "routed_scaling_factor": 2.5,
         "swiglu_limit": 1.0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "minimax-m2": (
        "MiniMaxM2Config",
        {"head_dim": 16, "rotary_dim": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "glm4": ("Glm4Config", {"head_dim": 24, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Seed-OSS: Llama with q/k/v biases and none on o_proj (`attention_out_bias`); ERNIE 4.5: rope over interleaved
    # pairs of each whole head, tied embeddings.
    "seed-oss": ("SeedOssConfig", {"head_dim": 24, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "ernie4.5": ("Ernie4_5Config", {"head_dim": 24, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # ERNIE 4.5's experts: top-2 of 8 by softmax plus a routing bias, a shared expert, the first layer dense.
    "ernie4.5-moe": (
        "Ernie4_5_MoeConfig",
        {"head_dim": 24, "moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 32, "moe_num_shared_experts": 1,
         "moe_layer_start_index": 1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "glm4-moe": (
        "Glm4MoeConfig",
        {"attention_bias": True, "use_qk_norm": True, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
         "topk_group": 1, "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "routed_scaling_factor": 2.5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "afmoe": (
        "AfmoeConfig",
        {"head_dim": 16, "num_dense_layers": 1, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "num_shared_experts": 1, "route_scale": 2.0, "sliding_window": WINDOW, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    "glm4-moe-lite": (
        "Glm4MoeLiteConfig",
        {"num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "n_shared_experts": 1, "routed_scaling_factor": 1.8,
         "mlp_layer_types": ["dense", "sparse", "dense", "sparse"], "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    "deepseek-v2": (
        "DeepseekV2Config",
        {"num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
         "topk_group": 2, "topk_method": "group_limited_greedy", "moe_intermediate_size": 32, "n_shared_experts": 1,
         "first_k_dense_replace": 1, "routed_scaling_factor": 1.5, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    "olmo2": ("Olmo2Config", {"pad_token_id": 0}),
    # Cohere 2 (Command R7B's form): the attention and the MLP in parallel off one LayerNorm, 3 windowed layers to 1
    # global without rope, interleaved rope, tied embeddings (llama.cpp reads no other head), logits scaled.
    "cohere2": (
        "Cohere2Config",
        {"sliding_window": WINDOW, "logit_scale": 0.3, "tie_word_embeddings": True, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2},
    ),
    # MiMo-V2-Flash: full attention on the first layer, windowed layers with twice the KV heads and sinks after it;
    # values 16 wide (keys 32), scaled; the first layer dense, then top-2 of 8 experts by sigmoid scores and a bias.
    "mimo-v2-flash": (
        "MiMoV2FlashConfig",
        {"num_key_value_heads": 1, "head_dim": 32, "v_head_dim": 16, "sliding_window": WINDOW,
         "layer_types": ["full_attention"] + ["sliding_attention"] * 3, "n_routed_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "attention_value_scale": 0.7, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Cohere2-MoE (Command A+): Cohere 2's block and windows (its dense first layer global, with rope), then top-2 of 8
    # experts beside a shared expert, the two averaged.
    "cohere2-moe": (
        "Cohere2MoeConfig",
        {"sliding_window": WINDOW, "logit_scale": 0.3, "first_k_dense_replace": 1, "prefix_dense_intermediate_size": 96,
         "intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Cohere (Command R): that block on every layer, rope everywhere.
    "cohere": (
        "CohereConfig",
        {"logit_scale": 0.3, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # EXAONE 4 (32B's form): OLMo 2's post-norm block, per-head q/k norms, 3 windowed layers to 1 global without rope.
    "exaone4": (
        "Exaone4Config",
        {"sliding_window": WINDOW, "sliding_window_pattern": 4, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    "olmo3": (
        "Olmo3Config",
        {"pad_token_id": 0, "sliding_window": WINDOW,
         "rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                                                "original_max_position_embeddings": 64},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    ),
    "hunyuan-dense": (
        "HunYuanDenseV1Config",
        {"head_dim": 16, "attention_bias": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 128.0, "factor": 1.0}},
    ),
    "hunyuan-moe": (
        "HunYuanMoEV1Config",
        {"head_dim": 16, "num_experts": 4, "moe_topk": [2] * 4, "num_shared_expert": [1] * 4, "intermediate_size": 64,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0, "factor": 1.0}},
    ),
    "arcee": (
        "ArceeConfig",
        {"head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32}},
    ),
    "jais2": ("Jais2Config", {"head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gpt-neox": ("GPTNeoXConfig", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Persimmon: GPT-NeoX's fused q/k/v, one q/k LayerNorm with a bias for every head, rope over half of each head,
    # an ungated relu² MLP.
    "persimmon": ("PersimmonConfig", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # XGLM and BioGPT: OPT's block, token embeddings times sqrt(hidden); XGLM's positions sinusoidal, BioGPT's learned.
    "xglm": ("XGLMConfig", {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}),
    # BLOOM: ALiBi (no rope), its embeddings LayerNorm'd, GPT-NeoX's fused q/k/v, a tanh-GELU MLP.
    "bloom": ("BloomConfig", {"n_head": 4, "pad_token_id": 3, "bos_token_id": 1, "eos_token_id": 2}),
    "biogpt": ("BioGptConfig", {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}),
    # OPT-350M's form (post-LN blocks, no final norm, embeddings 32 wide projected in and out) and GPT-1 (post-LN
    # blocks, learned positions, Conv1D weights).
    "opt-350m": ("OPTConfig", {"ffn_dim": 96, "word_embed_proj_dim": 32, "do_layer_norm_before": False,
                               "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}),
    "openai-gpt": ("OpenAIGPTConfig", {"n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 1024}),
    # Dory: a looped nGPT (unit hidden states, interpolated residuals), one input layer, two recurrent ones run
    # three times, one output layer; windowed layers (6 positions) with a rope base of their own.
    "dory": ("DoryConfig", {"head_dim": 16, "n_input_layers": 1, "n_output_layers": 1, "n_recurrent_loops": 3,
                            "sliding_window": 6, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # MPT: ALiBi with its own slopes (6 heads: interleaved), q/k/v in one projection clamped, no biases.
    "mpt": ("MptConfig", {"hidden_size": 96, "num_attention_heads": 6, "attn_config": {"clip_qkv": 0.3},
                          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Falcon-RW: Falcon's sequential block with biases and ALiBi (16 heads: slopes bfloat16 rounds, as its code does).
    "falcon-rw": ("FalconConfig", {"num_attention_heads": 16, "alibi": True, "bias": True, "multi_query": False,
                                   "parallel_attn": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gpt2": ("GPT2Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gptj": ("GPTJConfig", {"rotary_dim": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # CodeGen: GPT-J's block, q/k/v in one projection laid out by its 4 training shards (2 of the 8 heads each).
    "codegen": ("CodeGenConfig", {"num_attention_heads": 8, "rotary_dim": 4, "pad_token_id": 0, "bos_token_id": 1,
                                  "eos_token_id": 2}),
    "gpt-bigcode": ("GPTBigCodeConfig", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "falcon-7b": ("FalconConfig", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "falcon-40b": ("FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 2, "bias": True,
                                    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "phi": ("PhiConfig", {"partial_rotary_factor": 0.4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "stablelm-12b": (
        "StableLmConfig",
        {"qk_layernorm": True, "use_parallel_residual": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "starcoder2": ("Starcoder2Config", {"sliding_window": WINDOW, "pad_token_id": 0, "bos_token_id": 1,
                                        "eos_token_id": 2}),
    "apertus": (
        "ApertusConfig",
        {"head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    ),
    "ministral3": (
        "Ministral3Config",
        {"head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         "rope_parameters": {"type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5}},
    ),
    "granite": (
        "GraniteConfig",
        {"embedding_multiplier": 12.0, "attention_multiplier": 0.015625, "residual_multiplier": 0.22,
         "logits_scaling": 8.0, "pad_token_id": 0},
    ),
    "llama4": (
        "Llama4TextConfig",
        {"head_dim": 16, "intermediate_size": 32, "intermediate_size_mlp": 96, "num_local_experts": 4,
         "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "no_rope_layers": [1, 0, 1, 0],
         "attention_chunk_size": 32, "floor_scale": 4, "attn_scale": 0.5, "pad_token_id": 0,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    "gpt-oss": (
        "GptOssConfig",
        {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
         "swiglu_limit": 1.0,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}},
    ),
}  # fmt: skip
# Hybrids of Gated DeltaNet linear attention and gated full attention (three linear layers, then a full one), whose
# linear layers keep a state per sequence and no KV cache (tests/unit/test_hybrid_engines.py): Qwen3.5's dense model
# (2 key heads of 16 dims, each serving 2 value heads of 8; partial rope over 4 of 16 dims); Qwen3-Next's grouped
# q/k/v/z and b/a projections beside top-2 of 8 experts and a gated shared expert, its first layer dense. LFM2: gated
# short convolutions (3 taps) in place of the linear attention, plain attention with per-head q/k norms.
# Granite 4.0 H: Mamba-2 (4 heads 32 wide in one group, as released, a 16-wide state, a 4-tap convolution with a
# bias) in place of the linear attention, attention without rope; top-2 of 4 experts beside a shared MLP; Granite's
# multipliers. Nemotron-H: one sublayer per checkpoint block (Mamba-2 of 4 heads 32 wide in 2 groups, attention
# without rope, ungated relu² MLPs), blocks M - M M * - pairing into the same four layers, the second and third without
# an MLP. Falcon-H1: attention beside Mamba-2 (4 heads 16 wide in 2 groups) in every layer, every µP multiplier away
# from 1.
GRANITE4_H: dict[str, Any] = {
    "layer_types": ["mamba"] * 3 + ["attention"], "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16,
    "mamba_n_groups": 1, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 64,
    "embedding_multiplier": 12.0, "attention_multiplier": 0.0625, "residual_multiplier": 0.22, "logits_scaling": 8.0,
    "pad_token_id": 0,
}  # fmt: skip
LINEAR_ATTENTION: dict[str, Any] = {
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "head_dim": 16, "pad_token_id": 0,
}  # fmt: skip
HYBRIDS: dict[str, tuple[str, dict[str, Any]]] = {
    # Zamba2: Mamba-2 layers (4 heads, 2 groups), before three of them one of two shared attention + MLP blocks over
    # cat(h, embeddings), each use with adapters of its own (rank 32: int8 takes their projections, as the released
    # rank 128), rope; its embeddings tied, as released (transformers shares the blocks only then).
    "zamba2": ("Zamba2Config", {"layers_block_type": ["mamba", "hybrid", "hybrid", "mamba", "hybrid"],
                                "num_hidden_layers": 5, "num_mem_blocks": 2, "use_shared_attention_adapter": True,
                                "adapter_rank": 32, "use_mem_rope": True, "num_key_value_heads": 4,
                                "n_mamba_heads": 4, "mamba_d_state": 16, "mamba_ngroups": 2, "chunk_size": 8,
                                "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
                                "eos_token_id": 2}),
    # Zamba (the first): multi-head Mamba-1 layers (2 heads of 64 channels, each its own x_proj and dt_proj), one
    # shared attention + MLP block (no rope, no adapters) before the third, fifth and seventh, its embeddings tied.
    "zamba": ("ZambaConfig", {"num_hidden_layers": 7, "attn_layer_period": 2, "attn_layer_offset": 1,
                              "num_key_value_heads": 4, "n_mamba_heads": 2, "mamba_d_state": 8, "mamba_dt_rank": 8,
                              "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "qwen3.5": ("Qwen3_5TextConfig", LINEAR_ATTENTION),
    "qwen3-next": (
        "Qwen3NextConfig",
        {**LINEAR_ATTENTION, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 64, "mlp_only_layers": [0]},
    ),
    "lfm2": ("Lfm2Config", {"layer_types": ["conv"] * 3 + ["full_attention"], "pad_token_id": 0}),
    # RWKV-4: three blocks of time and channel mixes, the hidden state halved after the second (rescale_every 2).
    "rwkv": ("RwkvConfig", {"num_hidden_layers": 3, "rescale_every": 2, "context_length": 1024, "pad_token_id": 0,
                            "bos_token_id": 1, "eos_token_id": 2}),
    # xLSTM: three mLSTM blocks of 4 heads (q/k 16 wide, v 32: xLSTM 7B's proportions at 128 wide, as transformers'
    # states are sized by widths rounded to 64), its prefill chunkwise in 16-token chunks, gates capped at 15 and
    # logits at 30 (its defaults).
    "xlstm": ("xLSTMConfig", {"hidden_size": 128, "num_blocks": 3, "num_heads": 4, "qk_dim_factor": 0.5,
                              "v_dim_factor": 1.0, "chunk_size": 16, "pad_token_id": 1, "bos_token_id": 0,
                              "eos_token_id": 2}),
    # Qwen4-Exp: Qwen3.5-MoE's layers over 4 hyper-connected streams (rank-24 maps), n-gram embeddings (2- and
    # 3-grams, 2 hash heads each, tables of primes from 97 on, saved in 4 shards) before the first and third linear
    # layers, QSA on the last (2 index heads of 16, blocks of 4 positions, the best 2 kept: prompts past 11 tokens
    # attend sparsely), rope over half of each head; the tokenizer's end of sequence (2) ends an n-gram's context.
    "qwen4-exp": (
        "Qwen4ExpTextConfig",
        {**LINEAR_ATTENTION, "layer_types": ["linear_attention"] * 3 + ["indexed_attention"], "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
         "hc_count": 4, "hc_lowrank": 24, "ple_layer_ids": [1, 3], "ple_embed_dim": 32, "ngram_size": 3,
         "heads_per_ngram": 2, "ngram_vocab_size_base": 97, "make_ngram_vocab_size_divisible_by": 8,
         "split_ngram_parts": 4, "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
         "indexer_budget": 8, "indexer_compress_ratio": 4, "eos_token_id": 2,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    ),
    # MiniMax-01: lightning attention (four heads of 16, blocks of 16 tokens) on three layers, softmax attention on the
    # last; its blocks' residuals normalised and scaled (MiniMax-Text-01's alphas); top-2 of 4 experts.
    "minimax": (
        "MiniMaxConfig",
        {"head_dim": 16, "block_size": 16, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
         "num_local_experts": 4, "num_experts_per_tok": 2, "full_attn_alpha_factor": 3.56,
         "linear_attn_alpha_factor": 3.56, "mlp_alpha_factor": 3.56, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    # RecurrentGemma: Griffin's recurrent blocks (RG-LRU gates in 4 blocks, 4-tap convolutions) on layers 0, 1 and 3,
    # local multi-query attention within 20 positions on layer 2; its MLPs half of `intermediate_size` (64: int8's
    # groups of 32 split it).
    "recurrent-gemma": (
        "RecurrentGemmaConfig",
        {"num_key_value_heads": 1, "attention_window_size": WINDOW, "intermediate_size": 128, "pad_token_id": 0,
         "bos_token_id": 2, "eos_token_id": 1},
    ),
    "granite4-h": ("GraniteMoeHybridConfig", GRANITE4_H),
    "nemotron-h": (
        "NemotronHConfig",
        {"layers_block_type": ["mamba", "mlp", "mamba", "mamba", "attention", "mlp"], "head_dim": 16,
         "mamba_num_heads": 4, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2, "pad_token_id": 0},
    ),
    # LFM3: LFM2's convolutions (first and third layers) under Gemma's sandwich norms, a windowed attention layer
    # (its own rope base) and a full one (proportional rope over half of each head's angles), heads' outputs gated.
    "lfm3": (
        "Lfm3Config",
        {"layer_types": ["conv", "sliding_attention", "conv", "full_attention"], "sliding_window": WINDOW,
         "head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Jamba: Mamba-1 (128 channels, an 8-wide state) on the first three layers, attention without rope on the last;
    # top-2 of 4 experts on the second and fourth.
    "jamba": (
        "JambaConfig",
        {"attn_layer_period": 4, "attn_layer_offset": 3, "num_experts": 4, "num_experts_per_tok": 2,
         "mamba_d_state": 8, "mamba_dt_rank": 32, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # OLMo Hybrid: Gated DeltaNet (4 heads, keys 16 wide, values 32, the write strength doubled) in pre-norm blocks on
    # the first three layers, OLMo 3's post-norm attention on the last, no rope (its released checkpoints' null base).
    "olmo-hybrid": (
        "OlmoHybridConfig",
        {"linear_key_head_dim": 16, "linear_value_head_dim": 32, "rope_parameters": {"rope_type": "default",
         "rope_theta": None}, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Lara Mini: Gated DeltaNet on the first and third layers, Qwen3's attention windowed with rope on the second and
    # full without rope on the fourth; top-2 of 8 experts (softmax) beside an ungated shared expert on every layer.
    "lara-mini": (
        "LaraMiniConfig",
        {**LINEAR_ATTENTION, "sliding_window": WINDOW,
         "layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
         "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
         "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Kimi Linear: Kimi Delta Attention (4 heads of 32, a decay per key channel) on the first, second and fourth
    # layers, latent attention without rope on the third; a dense first MLP, then top-2 of 8 experts in 4 groups
    # (2 chosen) by sigmoid scores and a bias, scaled by 2.5, beside a shared expert.
    "kimi-linear": (
        "KimiLinearConfig",
        {"layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
         "num_key_value_heads": 4, "kv_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
         "v_head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
         "moe_intermediate_size": 32, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "linear_num_heads": 4,
         "linear_head_dim": 32, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Ling 3: Kimi Delta Attention (4 heads of 32) with whole decay and gate projections and its bounded decay on the
    # first, second and fourth layers, latent attention with a gate per head on the third; a dense first MLP, then
    # top-2 of 8 experts in 4 groups (2 chosen) by sigmoid scores and a bias, scaled by 2.5, beside a shared expert.
    "ling-3": (
        "BailingHybridConfig",
        {"layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
         "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "num_key_value_heads": 4, "head_dim": 32,
         "kv_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 16, "num_experts": 8,
         "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
         "routed_scaling_factor": 2.5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # State space models alone, three layers of mixers: Falcon Mamba's Mamba-1 (128 channels, an 8-wide state, a
    # time step of rank 32, it, B and C RMS-normalised without a weight); Mamba-2 (8 heads 16 wide in 2 groups, a
    # 16-wide state, its output normalised per group).
    "falcon-mamba": (
        "FalconMambaConfig",
        {"num_hidden_layers": 3, "state_size": 8, "time_step_rank": 32, "mixer_rms_eps": 1e-5, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2},
    ),
    "mamba2": (
        "Mamba2Config",
        {"num_hidden_layers": 3, "num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 2, "chunk_size": 16,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "falcon-h1": (
        "FalconH1Config",
        {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 2,
         "mamba_chunk_size": 16, "embedding_multiplier": 3.0, "lm_head_multiplier": 0.5, "key_multiplier": 0.6,
         "attention_in_multiplier": 1.3, "attention_out_multiplier": 0.8, "ssm_in_multiplier": 1.25,
         "ssm_multipliers": [0.35, 0.25, 0.35, 0.5, 0.7], "ssm_out_multiplier": 0.6, "mlp_multipliers": [0.9, 0.6],
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
}  # fmt: skip
# Families whose every part is another's, laid out under names of their own (or with one norm of another form:
# Nemotron-4's LayerNorm1P, 1 + weight with a bias; OLMo's LayerNorms without a weight, its q/k/v clamped; EXAONE 3.5,
# Llama under GPT-2's names): their paged model is held to transformers (tests/unit/test_models.py), their saved
# checkpoints load as the engine names them (tests/unit/test_family_engines.py's `test_layout_families_load_as_saved`)
# and their GGUF files convert exactly (tests/unit/test_family_gguf.py), without a whole engine of their own.
LAYOUT_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "nemotron": ("NemotronConfig", {"head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "olmo": ("OlmoConfig", {"clip_qkv": 0.5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "exaone": ("ExaoneConfig", {"tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "glm": ("GlmConfig", {"head_dim": 24, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "solar-open": (
        "SolarOpenConfig",
        {"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "n_shared_experts": 1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "flex-olmo": (
        "FlexOlmoConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    "hy-v3": (
        "HYV3Config",
        {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "num_shared_experts": 1, "router_scaling_factor": 2.5, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    "dots1": (
        "Dots1Config",
        {"head_dim": 16, "attention_bias": True, "sliding_window": WINDOW, "max_window_layers": 1,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 32,
         "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2},
    ),
    "exaone-moe": (
        "ExaoneMoeConfig",
        {"head_dim": 16, "sliding_window": WINDOW, "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "num_shared_experts": 1, "first_k_dense_replace": 1, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2},
    ),
    "mellum": (
        "MellumConfig",
        {"head_dim": 16, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"] * 2,
         "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "num_mtp_layers": 1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "cwm": (
        "CwmConfig",
        {"head_dim": 16, "sliding_window": WINDOW, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 1000000.0, "factor": 16.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    ),
}  # fmt: skip
# Every model `save_family` can write: the families above, plain Llama (the base of the LoRA tests) and Qwen3.5's and
# LFM2's mixtures of experts (their GGUF files' tests; their engines' are tests.unit.test_models').
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    **FAMILIES, **LAYOUT_FAMILIES, **HYBRIDS, "llama": ("LlamaConfig", {}),
    # Mamba: Falcon Mamba's layers without the norms inside the mixer, its embeddings tied to the LM head (as the
    # mamba-*-hf releases).
    "mamba": ("MambaConfig", {**HYBRIDS["falcon-mamba"][1], "tie_word_embeddings": True}),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", {**LINEAR_ATTENTION, "num_experts": 8, "num_experts_per_tok": 2,
                                             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}),
    # Granite 4.0 H's dense form (Granite-4.0-H-Micro's: the shared MLP alone), Granite 3.x (Llama's block with its
    # multipliers) and Granite 3.0's mixture of experts with a shared MLP.
    "granite4-h-dense": ("GraniteMoeHybridConfig", {**GRANITE4_H, "num_local_experts": 0}),
    # Bamba: Granite 4.0 H's layout without its multipliers (Mamba-2 of 4 heads 32 wide in 2 groups), attention on the
    # third layer with rope over half of each head, a dense SwiGLU MLP after every layer.
    "bamba": (
        "BambaConfig",
        {"attn_layer_indices": [2], "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 2,
         "mamba_chunk_size": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "granite": ("GraniteConfig", {k: v for k, v in GRANITE4_H.items() if k.endswith(("multiplier", "scaling"))}),
    "granitemoeshared": ("GraniteMoeSharedConfig", {
        **{k: v for k, v in GRANITE4_H.items() if k.endswith(("multiplier", "scaling"))},
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 64,
    }),
    # Nemotron 3 (Nano's form): Nemotron-H's blocks with experts (E) after the mixers: top-2 of 8 ungated relu²
    # experts in 2 groups (1 chosen) by sigmoid scores and a routing bias, scaled by 2.5, beside a relu² shared expert.
    "nemotron-h-moe": ("NemotronHConfig", {
        **HYBRIDS["nemotron-h"][1], "layers_block_type": ["mamba", "moe", "mamba", "mamba", "attention", "moe"],
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 64, "routed_scaling_factor": 2.5,
    }),
    # LFM2-MoE: LFM2's layers, its first dense and top-2 of 8 experts (sigmoid scores, a routing bias) after it.
    "lfm2-moe": ("Lfm2MoeConfig", {**HYBRIDS["lfm2"][1], "num_dense_layers": 1, "num_experts": 8,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
}  # fmt: skip


# Vectors besides the norms' drawn around their init: biases, Gemma 4's router scales (1 at init), Gemma 3n's AltUp
# output scale (0 at init: its per-layer inputs would add nothing).
PERTURBED_SCALES = ("bias", "router.scale", "per_expert_scale", "correct_output_scale")
# Dory's learned per-channel scales (nGPT's), constants at init.
NGPT_SCALES = ("sqk", "s_gate", "lambda_1", "lambda_2", "suv_gate", "suv_up")
# Router weights' names (Llama 4's `feed_forward.router`), drawn apart from the other matrices.
ROUTERS = ("mlp.gate.weight", "mlp.gate.wg.weight", "mlp.router.weight", "router.proj.weight",
           "router.classifier.weight", "feed_forward.router.weight", "feed_forward.gate.weight",
           "block_sparse_moe.router.weight", "mixer.gate.weight", "mlp.router.gate.weight",
           "ffn.router.layer.weight")  # fmt: skip


# HY-V4's hyper-connection maps' matrices and scales (`layers.hyper_connections`): at transformers' init (scales
# 0.01) each block's stream weights barely vary from token to token; drawn wider, they do.
HYPER_CONNECTION_MAPS = ("_hc.fn", "_hc.scale", "hc_head.hc_fn", "hc_head.hc_scale")


def draw_language_model(model: Any, head: bool = False) -> None:
    """A multimodal model's language model (its parameters under `language_model`, and with `head` its `lm_head`
    beside it) drawn as `save_family` draws a text model's: routers wide, other matrices at 0.08; the vision side
    left at transformers' init."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            drawn = "language_model" in name or (head and name == "lm_head.weight")
            if drawn and name.endswith(ROUTERS):
                parameter.normal_(0.0, 0.3)
            elif drawn and name.endswith(HYPER_CONNECTION_MAPS):
                parameter.normal_(0.0, 0.1) if parameter.dim() > 1 else parameter.uniform_(0.5, 1.5)
            elif parameter.dim() > 1 and drawn:
                parameter.normal_(0.0, 0.08)


def save_family(folder: Path, family: str, seed: int = 0, head_spread: float = 0.0, **overrides: Any) -> Path:
    """A random `family` model (MODELS, with `overrides` of its config) saved to `folder` with the embedded
    tokenizer; returns `folder`.

    `head_spread` > 0 scales each row of the LM head by exp(N(0, head_spread²)), as a trained model's rows differ in
    norm: its next-token distribution then has a clear head. With equal rows the top logits of 49,152 are all
    within a few hundredths of each other, and 4-bit weights flip the argmax at near-ties that say nothing of how
    close the quantized model is (`ladle bench quality`'s top-1 agreement)."""
    import transformers

    class_name, quirks = MODELS[family]
    config = getattr(transformers, class_name)(**{**_SHAPE, **quirks, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # The draws are for hidden 64; a wider model's are narrowed by sqrt(64 / hidden), so each product keeps its
    # scale (else activations grow ~sqrt(hidden / 64) times per layer and the logits of a 1024-wide model are
    # so large that any rounding moves them by whole units).
    width = math.sqrt(_SHAPE["hidden_size"] / config.hidden_size)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(ROUTERS):  # a router: logits
                # ~N(0, 2.4²), spread
                parameter.normal_(0.0, 0.3 * width)  # but not one-hot
            elif name.endswith("self_attn.sinks"):  # sink logits of the scores' size: each takes a share
                parameter.normal_(0.0, 1.0)
            elif name.endswith(HYPER_CONNECTION_MAPS):
                parameter.normal_(0.0, 0.1 * width) if parameter.dim() > 1 else parameter.uniform_(0.5, 1.5)
            elif parameter.dim() > 1:
                parameter.normal_(0.0, 0.08 * width)
            elif name.endswith(NGPT_SCALES):  # Dory's learned scales, constants at init: one per channel each
                parameter.mul_(torch.empty_like(parameter).uniform_(0.5, 1.5))
            elif name.endswith("lm_head.logit_scale"):  # Dory's: logits of a trained model's size (its unit states'
                parameter.uniform_(0.5, 1.5)  # are ~0.1 times 1 / initializer_range)
            elif "norm" in name or name.endswith(PERTURBED_SCALES):
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):  # Apertus's xIELU, one value per layer
                parameter.add_(torch.randn_like(parameter) * 0.5)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's load-balancing bias, of the scores' size
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # (LFM2-MoE's)
                buffer.uniform_(-0.3, 0.3)
            elif name.endswith("layer_scalar"):  # Gemma 4's scale of each layer's output (1 at init)
                buffer.uniform_(0.5, 1.5)
            elif name.endswith("act_fn.beta"):  # xIELU's slope at 0 (0.5 at init)
                buffer.uniform_(0.3, 0.7)
            elif name.endswith("tid2eid"):  # DeepSeek-V4's experts by token id (zeros at init): distinct, drawn
                experts = config.n_routed_experts
                buffer.copy_(torch.stack([torch.randperm(experts)[: buffer.shape[1]] for _ in range(buffer.shape[0])]))
        if head_spread:
            head = model.get_output_embeddings().weight
            head.mul_(torch.exp(torch.randn(head.shape[0], 1) * head_spread))
    unclamped_time_step(model)
    model.save_pretrained(folder)
    if class_name == "Gemma3nTextConfig":
        with_shared_key_values(folder, config)
    copy_tokenizer(folder)
    return folder


def with_shared_key_values(folder: Path, config: Any) -> None:
    """A saved Gemma 3n's checkpoint as the released ones hold it: K/V projections and a key norm for the layers that
    attend over an earlier layer's K/V too (drawn as `save_family` draws the others), which transformers builds none
    of and does not read."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(path)
    rows, hidden = config.num_key_value_heads * config.head_dim, config.hidden_size
    for layer in range(config.num_hidden_layers - config.num_kv_shared_layers, config.num_hidden_layers):
        prefix = f"model.layers.{layer}.self_attn."
        state |= {f"{prefix}k_proj.weight": torch.randn(rows, hidden) * 0.08,
                  f"{prefix}v_proj.weight": torch.randn(rows, hidden) * 0.08,
                  f"{prefix}k_norm.weight": 1.0 + torch.randn(config.head_dim) * 0.1}  # fmt: skip
    save_file(state, path, metadata={"format": "pt"})


def unclamped_time_step(model: Any) -> None:
    """transformers' Nemotron-H and Zamba2 clamp Mamba-2's time step at `time_step_min` (which also sets the time
    steps' random init) in its chunked form alone, the prefill's: its one-token form, vLLM, llama.cpp and ladle clamp
    none (Nemotron-H's config's `time_step_limit`, (0, inf)). With `time_step_min` 0 once `model` is built (in its
    config, so a reload keeps it, and in its mixers), transformers runs one form; other models are left as they are.
    (Zamba2's config keeps its own, whose log its init takes: `load_reference` unclamps its mixers again.)"""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ("nemotron_h", "zamba2"):
        return
    if model_type == "nemotron_h":
        model.config.time_step_min = 0.0
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.0, math.inf)


def load_reference(folder: Path) -> Any:
    """transformers' model on `folder`, float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    unclamped_time_step(model)
    return model


@contextlib.contextmanager
def float_checkpoint(source: Any) -> Iterator[Path]:
    """A GGUF file's model (`source`, resolved) as ladle reads its weights, written out as a whole fp32 checkpoint
    in a temporary folder, removed afterwards: for transformers, the oracle (the cache holds no float copy)."""
    from engine_server.loader import write_float_checkpoint

    with tempfile.TemporaryDirectory(prefix="float-checkpoint-") as folder:
        yield write_float_checkpoint(source, Path(folder))


def hf_greedy(model: Any, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Plain greedy decoding with transformers' KV cache, every prompt in one batch: argmax of each step's logits,
    nothing else. The prompts are left-padded, masked out and given their own positions (0 at each prompt's first
    token), so each row computes what it would alone; only float32 summation order can differ from a batch of one,
    by ~1e-6 relative, which moves an argmax only at an exact near-tie. The cache goes in as `cache`, transformers
    5's name: its Mamba models ignore the older `past_key_values` and would run each step from an empty state."""
    from transformers import DynamicCache

    width = max(map(len, prompts))
    step_input = torch.tensor([[0] * (width - len(ids)) + ids for ids in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # A hybrid's recurrent layers (Qwen3-Next's, Qwen3.5's linear attention, LFM2's convolutions, Falcon-H1's Mamba-2
    # beside attention) keep states, and DeepSeek-V3.2's and GLM-5's indexers their keys, which the cache lays out by
    # the config.
    kinds = getattr(model.config.get_text_config(), "layer_types", None) or ()
    hybrid = bool({"linear_attention", "conv", "mamba", "hybrid", "indexed_attention"} & set(kinds))
    cache = DynamicCache(config=model.config) if hybrid else DynamicCache()
    # State space models alone read a mask as one value per token of the step (the padding's zeroed), so their
    # generate passes none after the prompt: the whole history's would be broadcast over the one new token.
    unmasked = model.config.model_type in ("mamba", "falcon_mamba", "mamba2")
    steps: list[torch.Tensor] = []
    with torch.inference_mode():
        for _ in range(num_tokens):
            logits = model(
                input_ids=step_input, attention_mask=None if unmasked and steps else mask, position_ids=positions,
                cache=cache, use_cache=True,
            ).logits[:, -1]  # fmt: skip
            steps.append(logits.argmax(-1))
            step_input, positions = steps[-1][:, None], positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
    return torch.stack(steps, dim=1).tolist()


def hf_greedy_checked(model: Any, prompt: list[int], num_tokens: int, candidate: list[int] | None) -> list[int]:
    """`hf_greedy`'s tokens for `prompt` alone, found in one forward pass when `candidate` (an engine's) is them: a
    token is transformers' greedy choice if it is the argmax of the logits after the prompt and the tokens before
    it, so one pass over the prompt and the candidate checks every position at once, as speculative decoding
    verifies a draft. Where one disagrees (or no candidate is given), transformers decodes the prompt step by step,
    so the tokens returned are transformers' whatever the candidate. A single pass differs from step-by-step
    decoding only in float summation order (~1e-6), except in models whose pass depends on how many tokens it
    holds (`_stepwise_only`), which always decode step by step."""
    if candidate is not None and len(candidate) == num_tokens and not _stepwise_only(model):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + candidate[:-1]])).logits[0, len(prompt) - 1 :]
        if logits.argmax(-1).tolist() == candidate:
            return list(candidate)
    return hf_greedy(model, [prompt], num_tokens)[0]


def _stepwise_only(model: Any) -> bool:
    """Whether one forward pass over a sequence computes other logits than transformers' step-by-step decoding of it:
    LongRoPE and dynamic NTK pick their rope factors by the length of what a pass holds (the prompt's when it is
    prefilled, so generate's tokens past a limit keep the factors their prompt chose), and DeepSeek-V3.2's indexer
    chooses its keys otherwise in a pass of many tokens (measured on tests/families.py's `deepseek-v32`; HY-V4's
    likewise, on `hy-v4`'s 120-token prompt)."""
    config = model.config.get_text_config()
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    layouts = [rope, *(value for value in rope.values() if isinstance(value, dict))]  # or one a kind of layer
    kinds = {layout.get("rope_type", layout.get("type")) for layout in layouts}
    return bool(kinds & {"longrope", "dynamic"}) or config.model_type in ("deepseek_v32", "hy_v4", "hy_v4_vl_text")


@dataclass(eq=False)
class GreedyReference:
    """transformers' greedy tokens for each of `prompts`, decoded alone (LongRoPE picks its factors by the longest
    sequence of a batch, so a batch would not give each prompt what it gets alone), `num_tokens` each: the engine
    tests' oracle. Computed once, on first use, from the candidate given then (`hf_greedy_checked`): the same tokens
    whatever that candidate, in one forward pass a prompt when it is right."""

    model: Any
    prompts: list[list[int]]
    num_tokens: int
    _tokens: dict[int, list[int]] = field(default_factory=dict)  # by prompt, as computed

    def of(self, candidate: list[list[int]] | None = None) -> list[list[int]]:
        """transformers' tokens for the first `len(candidate)` prompts (all without one), each checked against its
        candidate's if not computed yet."""
        given: list[list[int] | None] = list(candidate) if candidate is not None else [None] * len(self.prompts)
        for index, tokens in enumerate(given):
            if index not in self._tokens:
                self._tokens[index] = hf_greedy_checked(self.model, self.prompts[index], self.num_tokens, tokens)
        return [self._tokens[index] for index in range(len(given))]

    def first_tokens(self) -> list[int]:
        """transformers' first greedy token for each prompt: the argmax after the prompt, one forward pass each
        (what decoding computes first), for a quantized engine's tokens to mostly agree with."""
        firsts = []
        for index, prompt in enumerate(self.prompts):
            if index in self._tokens:
                firsts.append(self._tokens[index][0])
                continue
            with torch.inference_mode():
                firsts.append(int(self.model(input_ids=torch.tensor([prompt])).logits[0, -1].argmax()))
        return firsts


# llama.cpp's tensor names (gguf-py's TENSOR_NAMES) for the checkpoint names of the families written to GGUF here,
# and its architecture names (Gemma's norms after attention and around the MLP have names of their own).
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
                "model.embed_positions": "position_embd",
                "model.embedding_norm": "token_embd_norm",  # LFM2's final norm
                "model.embed_layernorm": "token_embd_norm"}  # BLOOM's embeddings' LayerNorm  # fmt: skip
_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.o_proj": "attn_output",
    "self_attn.query_layernorm": "attn_q_norm", "self_attn.key_layernorm": "attn_k_norm",
    "mlp.gate_up_proj": "ffn_up", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_GGUF_GEMMA_LAYER = {
    **_GGUF_LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip
_GGUF_ARCHITECTURES = {
    "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next",
    "gemma4_text": "gemma4", "llama4_text": "llama4", "gpt_oss": "gpt-oss", "glm4_moe": "glm4moe", "glm4": "glm4",
    "dots1": "dots1",
    "minimax_m2": "minimax-m2", "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "glm_moe_dsa": "glm-dsa",
    "glm4_moe_lite": "deepseek2", "seed_oss": "seed_oss", "ernie4_5": "ernie4_5", "ernie4_5_moe": "ernie4_5-moe",
    "exaone4": "exaone4", "cohere": "command-r", "cohere2": "cohere2", "olmo2": "olmo2", "lfm2": "lfm2",
    "lfm2_moe": "lfm2moe", "granite": "granite", "granitemoe": "granitemoe", "granitemoeshared": "granitemoe",
    "granitemoehybrid": "granitehybrid", "nemotron_h": "nemotron_h", "ministral3": "mistral3", "arcee": "arcee",
    "hunyuan_v1_dense": "hunyuan-dense", "apertus": "apertus", "falcon_h1": "falcon-h1", "jamba": "jamba",
    "gpt2": "gpt2", "gpt_bigcode": "starcoder", "gpt_neox": "gptneox", "falcon": "falcon", "phi": "phi2",
    "stablelm": "stablelm", "starcoder2": "starcoder2", "nemotron": "nemotron", "olmo": "olmo", "exaone": "exaone",
    "mamba": "mamba", "falcon_mamba": "mamba", "mamba2": "mamba2", "dbrx": "dbrx", "gemma3n_text": "gemma3n",
    "bloom": "bloom", "mpt": "mpt",
}  # fmt: skip
# The state space models' architectures: no attention, their own keys (`_state_space_metadata`).
_GGUF_STATE_SPACE = ("mamba", "mamba2")
# The classic families' llama.cpp architectures, whose norms are LayerNorms (`attention.layer_norm_epsilon`), and their
# checkpoints' names as Llama's, which `_GGUF_LAYER` and `_GGUF_GLOBAL` then name as llama.cpp does.
_GGUF_LAYER_NORMED = ("gpt2", "starcoder", "gptneox", "falcon", "phi2", "stablelm", "starcoder2", "nemotron", "olmo",
                      "bloom", "mpt")  # fmt: skip
# The ALiBi families' files: no rope keys, no window (their converters write none).
_GGUF_ALIBI = ("bloom", "mpt")
_GGUF_CLASSIC = (*_GGUF_LAYER_NORMED, "exaone")
_CLASSIC_AS_LLAMA = (
    ("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
    ("gpt_neox.layers.", "model.layers."), ("embed_out.", "lm_head."), ("model.final_layernorm.", "model.norm."),
    ("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.wpe.", "model.embed_positions."),
    (".attn.c_attn.", ".self_attn.qkv_proj."), (".attn.c_proj.", ".self_attn.o_proj."),
    (".self_attention.query_key_value.", ".self_attn.qkv_proj."), (".self_attention.dense.", ".self_attn.o_proj."),
    (".attention.query_key_value.", ".self_attn.qkv_proj."), (".attention.dense.", ".self_attn.o_proj."),
    (".self_attn.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
    (".mlp.dense_4h_to_h.", ".mlp.down_proj."), (".mlp.fc1.", ".mlp.up_proj."), (".mlp.fc2.", ".mlp.down_proj."),
    (".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."),
    ("transformer.wte.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
    ("transformer.h.", "model.layers."), (".attn.attention.out_proj.", ".self_attn.o_proj."),
    (".attn.attention.", ".self_attn."), (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
    (".mlp.c_fc_0.", ".mlp.gate_proj."), (".mlp.c_fc_1.", ".mlp.up_proj."),
    ("transformer.word_embeddings_layernorm.", "model.embed_layernorm."),  # BLOOM's
    ("transformer.blocks.", "model.layers."), ("transformer.norm_f.", "model.norm."),  # MPT's
    (".norm_1.", ".input_layernorm."), (".norm_2.", ".post_attention_layernorm."),
    (".attn.Wqkv.", ".self_attn.qkv_proj."), (".attn.out_proj.", ".self_attn.o_proj."),
    (".ffn.up_proj.", ".mlp.up_proj."), (".ffn.down_proj.", ".mlp.down_proj."),
)  # fmt: skip
_GGUF_GRANITES = ("granite", "granitemoe", "granitehybrid")
# LFM2's checkpoint names, llama.cpp's for them (its convolution's `shortconv.*`; its final norm `token_embd_norm`).
_GGUF_LFM2_LAYER = {
    "operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output", "self_attn.q_layernorm": "attn_q_norm",
    "self_attn.k_layernorm": "attn_k_norm", "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up",
    "feed_forward.w2": "ffn_down", "conv.conv": "shortconv.conv", "conv.in_proj": "shortconv.in_proj",
    "conv.out_proj": "shortconv.out_proj", "feed_forward.gate": "ffn_gate_inp",
}  # fmt: skip
_GGUF_HYBRIDS = ("qwen35", "qwen35moe", "qwen3next")
# A mixture of experts: the routers (kept F32, as llama.cpp's converter keeps them), the shared expert, and each
# expert's projections, which llama.cpp stacks into one `[experts, rows, columns]` tensor per projection.
_GGUF_MOE_LAYER = {
    "mlp.gate": "ffn_gate_inp", "mlp.router": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}  # fmt: skip
_GGUF_ROUTERS = ("ffn_gate_inp", "ffn_gate_inp_shexp")
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe|feed_forward)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)")
_GGUF_EXPERT = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
                "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}  # fmt: skip



def _llama_cpp_linear_attention(config: dict[str, Any], arch: str, layer: str, weights: dict[str, torch.Tensor]
                                ) -> dict[str, np.ndarray]:
    """One Gated DeltaNet layer's checkpoint tensors (`weights`, by name under `linear_attn.`) as llama.cpp's converter
    writes them, by GGUF name: Qwen3-Next's grouped `in_proj_qkvz` split into `attn_qkv` (all q, all k, all v) and
    `attn_gate`; in Qwen3.5's files, value heads tiled rather than grouped by key head (v, z, a, b, A_log, dt_bias,
    the convolution's v channels, out_proj's columns); `ssm_a` = -exp(A_log); the convolution squeezed."""
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key_dim, value_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    per_key, key_rows = value_heads // key_heads, key_heads * key_dim

    def tile(t: torch.Tensor, dim: int, width: int) -> torch.Tensor:
        if arch == "qwen3next" or per_key == 1:
            return t
        t = t.movedim(dim, 0)
        tiled = t.reshape(key_heads, per_key, width, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        return tiled.movedim(0, dim)

    w = {name.removesuffix(".weight"): t.float() for name, t in weights.items()}
    if "in_proj_qkvz" in w:
        grouped = w.pop("in_proj_qkvz").reshape(key_heads, 2 * key_dim + 2 * per_key * value_dim, -1)
        q, k, v, z = grouped.split([key_dim, key_dim, per_key * value_dim, per_key * value_dim], dim=1)
        w["in_proj_qkv"] = torch.cat([q.reshape(-1, q.shape[-1]), k.reshape(-1, k.shape[-1]),
                                      v.reshape(-1, v.shape[-1])])  # fmt: skip
        w["in_proj_z"] = z.reshape(-1, z.shape[-1])
    out = {
        "attn_qkv": torch.cat([w["in_proj_qkv"][: 2 * key_rows], tile(w["in_proj_qkv"][2 * key_rows :], 0, value_dim)]),
        "attn_gate": tile(w["in_proj_z"], 0, value_dim),
        "ssm_conv1d": torch.cat([w["conv1d"].squeeze(1)[: 2 * key_rows], tile(w["conv1d"].squeeze(1)[2 * key_rows :], 0,
                                                                             value_dim)]),
        "ssm_a": -torch.exp(tile(w["A_log"], 0, 1)),
        "ssm_dt.bias": tile(w["dt_bias"], 0, 1),
        "ssm_norm": w["norm"],
        "ssm_out": tile(w["out_proj"], 1, value_dim),
    }  # fmt: skip
    if "in_proj_ba" in w:
        out["ssm_ba"] = w["in_proj_ba"]
    else:
        out["ssm_beta"], out["ssm_alpha"] = tile(w["in_proj_b"], 0, 1), tile(w["in_proj_a"], 0, 1)
    suffix = {"ssm_a": "", "ssm_dt.bias": ""}
    return {f"blk.{layer}.{kind}{suffix.get(kind, '.weight')}": t.numpy() for kind, t in out.items()}


# Gemma 4 as llama.cpp's converter names it: its per-layer inputs' layers, router and expert norms, and the tensors
# whose checkpoint names have no `.weight` (or are not a module's).
_GGUF_GEMMA4_LAYER = {
    "per_layer_input_gate": "inp_gate", "per_layer_projection": "proj", "post_per_layer_input_norm": "post_norm",
    "router.proj": "ffn_gate_inp", "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
    "post_feedforward_layernorm_1": "post_ffw_norm_1", "post_feedforward_layernorm_2": "post_ffw_norm_2",
}  # fmt: skip
_GGUF_GEMMA4_BARE = {
    "layer_scalar": "layer_output_scale.weight", "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
}  # fmt: skip
_GGUF_GEMMA4_GLOBAL = {
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}  # fmt: skip


# Gemma 3n's AltUp and LAuReL tensors as llama.cpp's converter names them (a layer's, after `blk.N.`), and its
# stacked projections of the streams (`altup_projections.{i}`, `altup_unembed_projections.{i}`: one tensor each).
_GGUF_GEMMA3N_LAYER = {
    "altup.correction_coefs": "altup_correct_coef", "altup.prediction_coefs": "altup_predict_coef",
    "altup.modality_router": "altup_router", "altup.router_norm": "altup_router_norm", "laurel.linear_left": "laurel_l",
    "laurel.linear_right": "laurel_r", "laurel.post_laurel_norm": "laurel_post_norm",
}  # fmt: skip
_GGUF_GEMMA3N_STACKED = {"model.altup_projections": "altup_proj.weight",
                         "model.altup_unembed_projections": "altup_unembd_proj.weight"}  # fmt: skip


def _gemma3n_metadata(writer: Any, config: dict[str, Any]) -> None:
    """Gemma 3n's keys as llama.cpp's converter writes them (`gemma3n`): Gemma 3's (one head shape, the full layers'
    rope base, the window, the final soft-cap) with each layer's MLP width, AltUp's streams and active one, the
    per-layer inputs' width, the shared K/V layers, each layer's sparsity as the normal quantile its cutoff takes
    (-inf where none) and the window pattern."""
    layers, types = config["num_hidden_layers"], config["layer_types"]
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["full_attention"]["rope_theta"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_altup_active_idx(config["altup_active_idx"])
    writer.add_altup_num_inputs(config["altup_num_inputs"])
    writer.add_embedding_length_per_layer_input(config["hidden_size_per_layer_input"])
    writer.add_shared_kv_layers(config["num_kv_shared_layers"])
    normal = torch.distributions.Normal(0.0, 1.0)
    writer.add_activation_sparsity_scale(
        [float(normal.icdf(torch.tensor(p, dtype=torch.float32))) for p in config["activation_sparsity_pattern"]]
    )
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in types])


def _gemma4_metadata(writer: Any, config: dict[str, Any]) -> None:
    """Gemma 4's keys as llama.cpp's converter writes them: per-layer KV heads and MLP widths, the full-attention
    layers' head dim beside the windowed ones', the window pattern, shared K/V, per-layer inputs, experts; and the
    `rope_freqs` tensor that makes its full-attention layers' rope proportional (1 for the angles that turn, 1e30 for
    the rest)."""
    layers, types = config["num_hidden_layers"], config["layer_types"]
    windowed = [kind == "sliding_attention" for kind in types]
    full = config["per_layer_config"][str(windowed.index(False))]
    shared = config.get("num_kv_shared_layers") or 0
    width = config["intermediate_size"]
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    wide = config.get("use_double_wide_mlp")
    writer.add_feed_forward_length([width * 2 if wide and i >= layers - shared else width for i in range(layers)])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv([config["num_key_value_heads"] if w else full["num_key_value_heads"] for w in windowed])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_key_length(full["head_dim"])
    writer.add_value_length(full["head_dim"])
    writer.add_key_length_swa(config["head_dim"])
    writer.add_value_length_swa(config["head_dim"])
    writer.add_rope_dimension_count(full["head_dim"])
    writer.add_rope_dimension_count_swa(config["head_dim"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_sliding_window_pattern(windowed)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config.get("enable_moe_block"):
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["top_k_experts"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    turning = int(full["head_dim"] * rope["full_attention"]["partial_rotary_factor"] / 2)
    factors = [1.0] * turning + [1e30] * (full["head_dim"] // 2 - turning)
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))


# Types gguf cannot quantize to (llama.cpp's K-quants): their tensors are written as random blocks
# (tests.lowbit_blocks), so the file's weights are those blocks' and not the folder's.
# DeepSeek-V2/V3's latent attention (`kv_b_proj` is written as two tensors, `_latent_expansion_halves`).
_GGUF_LATENT_LAYER = {
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
}  # fmt: skip
# GLM-5 (`glm-dsa`): `deepseek2`'s layers with the sparse-attention indexer.
_GGUF_LATENT_ARCHES = ("deepseek2", "glm-dsa")
_GGUF_INDEXER_LAYER = {
    "self_attn.indexer.k_norm": "indexer.k_norm", "self_attn.indexer.weights_proj": "indexer.proj",
    "self_attn.indexer.wk": "indexer.attn_k", "self_attn.indexer.wq_b": "indexer.attn_q_b",
}  # fmt: skip


_RANDOM_BLOCK_KINDS = {  # GGMLQuantizationType values
    10: "q2_k", 11: "q3_k", 12: "q4_k", 13: "q5_k", 14: "q6_k", 16: "iq2_xxs", 17: "iq2_xs", 18: "iq3_xxs",
    19: "iq1_s", 20: "iq4_nl", 21: "iq3_s", 22: "iq2_s", 23: "iq4_xs", 29: "iq1_m",
}


def write_gguf(
    folder: Path, path: Path, feed_forward: Any, attention: Any, output: Any = None,
    types: dict[str, Any] | None = None, fuse_gate_up_exps: bool = False, joined_kv_b: bool = False,
) -> Path:
    """`folder`'s Phi-3, Gemma 2, Gemma 3, Gemma 4, Mixtral, Llama 4, Qwen2-MoE, Qwen3-MoE, Qwen3.5, Qwen3.5-MoE,
    Qwen3-Next, gpt-oss, GLM-4 or GLM-4.5 as llama.cpp's converter writes it (scripts/check_gguf_writer.py has llama.cpp
    read such files): its metadata (LongRoPE factors as tensors; Gemma's norm weights w stored as 1 + w, its soft-caps
    and linear rope scaling; the experts' counts and sizes), the embedded tokenizer's vocabulary, norms, embeddings and
    routers in F32, the attention projections in `attention`'s and the MLP's (the experts' and the shared expert's) in
    `feed_forward`'s quantization type (gguf `GGMLQuantizationType`s; a K-quant's tensors random blocks,
    `_RANDOM_BLOCK_KINDS`), the LM head in `output`'s (F32 when None), and a tensor named in `types` (its GGUF name,
    e.g. `blk.0.ffn_down_exps.weight`) in the type it gives; returns `path`. Mixtral is written as llama.cpp's `llama`
    with experts, its q/k rows permuted as its converter does. A Gemma's `query_pre_attn_scalar` must be its head dim
    and its global layers every 2nd (Gemma 2) or 6th (Gemma 3), as llama.cpp assumes; every layer of a mixture of
    experts must have experts (no `mlp_only_layers`), and a hybrid's value heads must be as wide as its key heads, as
    llama.cpp assumes. A hybrid's linear layers are written as `_llama_cpp_linear_attention` says, their projections in
    `attention`'s type; Gemma 4's keys as `_gemma4_metadata` says, its per-layer inputs' projections and experts' banks
    in `feed_forward`'s type (the layers before its sharing ones must end on a full-attention one, as llama.cpp
    assumes). Llama 4's q/k rows stay as its checkpoint's, its banks of experts split into gate, up and down, llama3
    rope scaling written as its `rope_freqs` divisors; what llama.cpp fixes for it (NoPE every 4th layer, chunks of
    8,192, the temperature's floor 8,192 and scale 0.1) must be the model's. GLM-4's q/k rows stay as its checkpoint's
    too (the turned half of each head interleaved); GLM-4.5's multi-token-prediction layers follow its decoder layers
    (`_prediction_layer_tensors`). `fuse_gate_up_exps`: each layer's gate and up banks written as one, as llama.cpp's
    converter does with `--fuse-gate-up-exps` (`_fused_gate_up_exps`). DeepSeek-V2/V3 are written as its `deepseek2`
    (`_deepseek2_metadata`), each layer's `kv_b_proj` split in two as its converter does now
    (`_latent_expansion_halves`), or whole (`attn_kv_b`) as it did before, with `joined_kv_b`; GLM-5 as its
    `glm-dsa`, those with the indexer's keys and tensors."""
    import json

    from gguf import GGUFWriter

    config = json.loads((folder / "config.json").read_text())
    arch = _GGUF_ARCHITECTURES[config["model_type"]]
    if arch in ("gpt2", "starcoder"):  # their config's own names as Llama's
        hidden = config["n_embd"]
        config = {**config, "hidden_size": hidden, "num_attention_heads": config["n_head"],
                  "num_hidden_layers": config["n_layer"], "max_position_embeddings": config["n_positions"],
                  "intermediate_size": config.get("n_inner") or 4 * hidden,
                  "num_key_value_heads": 1 if config.get("multi_query") else config["n_head"]}  # fmt: skip
    if arch == "bloom":  # its converter's context: `seq_length`, else the hidden size
        hidden = config["hidden_size"]
        config = {**config, "num_attention_heads": config["n_head"], "num_hidden_layers": config["n_layer"],
                  "max_position_embeddings": config.get("seq_length", hidden), "intermediate_size": 4 * hidden}
    if arch == "mpt":  # its config's own names as Llama's
        config = {**config, "hidden_size": config["d_model"], "num_attention_heads": config["n_heads"],
                  "num_hidden_layers": config["n_layers"], "max_position_embeddings": config["max_seq_len"],
                  "intermediate_size": 4 * config["d_model"]}  # fmt: skip
    if arch == "nemotron_h" and "moe" in config["layers_block_type"]:  # Nemotron 3's: its converter's other name
        arch = "nemotron_h_moe"
    if arch in (*_GGUF_STATE_SPACE, "dbrx"):  # no attention heads, no rope; DBRX's nested config
        writer = GGUFWriter(str(path), arch)
        if arch == "dbrx":
            _dbrx_metadata(writer, config)
        else:
            _state_space_metadata(writer, config, arch)
        write_gpt2_tokenizer(writer, folder)
        _write_tensors(writer, folder, config, arch, feed_forward, attention, output, types)
        return path
    gemma = arch.startswith("gemma")
    rope = config.get("rope_parameters") or {"rope_theta": 10000.0}  # (Nemotron-H turns none)
    if gemma and "full_attention" in rope:
        rope = rope["full_attention"]
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    writer = GGUFWriter(str(path), arch)
    if arch == "gemma4":
        _gemma4_metadata(writer, config)
    elif arch == "gemma3n":
        _gemma3n_metadata(writer, config)
    elif arch.startswith("nemotron_h"):
        _nemotron_h_metadata(writer, config, head_dim)
    else:
        _common_metadata(writer, config, arch, rope, head_dim)
    write_gpt2_tokenizer(writer, folder)
    if arch == "llama4":  # its converter's name for Llama 4's split of text before BPE (GPT-4o's)
        writer.add_tokenizer_pre("llama4")
    if arch == "gpt-oss":  # llama.cpp fixes the experts' SwiGLU; the file names o200k's split
        assert (config["swiglu_alpha"], config["swiglu_limit"]) == (1.702, 7.0), config
        writer.add_tokenizer_pre("gpt-4o")
    _write_tensors(writer, folder, config, arch, feed_forward, attention, output, types, fuse_gate_up_exps,
                   joined_kv_b)  # fmt: skip
    return path


def _fused_gate_up_exps(tensors: dict[str, tuple[np.ndarray, Any]]) -> dict[str, tuple[np.ndarray, Any]]:
    """`tensors` (by GGUF name: array and type) with each layer's `ffn_gate_exps` and `ffn_up_exps` (weights, and
    gpt-oss's biases) joined into one `ffn_gate_up_exps`, as llama.cpp's converter writes them with
    `--fuse-gate-up-exps`: `[experts, 2 * width, ...]`, each expert's gate rows before its up rows, in their type."""
    fused: dict[str, tuple[np.ndarray, Any]] = {}
    for name, (array, kind) in tensors.items():
        if ".ffn_up_exps." in name:
            continue
        if ".ffn_gate_exps." not in name:
            fused[name] = (array, kind)
            continue
        up, up_kind = tensors[name.replace(".ffn_gate_exps.", ".ffn_up_exps.")]
        assert up_kind == kind, (name, kind, up_kind)
        fused[name.replace(".ffn_gate_exps.", ".ffn_gate_up_exps.")] = (np.concatenate([array, up], axis=1), kind)
    return fused


def _latent_expansion_halves(
    tensors: dict[str, tuple[np.ndarray, Any]], config: dict[str, Any]
) -> dict[str, tuple[np.ndarray, Any]]:
    """`tensors` with each layer's `attn_kv_b` `[heads * (nope + value), rank]` split as llama.cpp's converter splits
    it now: `attn_k_b` `[heads, rank, nope]` (each head's key rows, transposed) and `attn_v_b` `[heads, value, rank]`,
    each in its type (quantized along its own rows)."""
    split: dict[str, tuple[np.ndarray, Any]] = {}
    heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    for name, (array, kind) in tensors.items():
        if not name.endswith(".attn_kv_b.weight"):
            split[name] = (array, kind)
            continue
        per_head = array.reshape(heads, -1, array.shape[-1])
        split[name.replace("attn_kv_b", "attn_k_b")] = (np.ascontiguousarray(per_head[:, :nope].swapaxes(1, 2)), kind)
        split[name.replace("attn_kv_b", "attn_v_b")] = (np.ascontiguousarray(per_head[:, nope:]), kind)
    return split


def _gpt_oss_tensors(layer: str, param: str, array: np.ndarray, feed_forward: Any) -> dict[str, tuple[np.ndarray, Any]]:
    """A gpt-oss layer's sinks or one of its experts' banks (`param`: `gate_up_proj` `[E, H, 2I]` and its bias
    `[E, 2I]`, gate and up alternating; `down_proj` `[E, I, H]` and its bias) as llama.cpp's converter writes them:
    gate, up and down `[E, out, in]` in `feed_forward`'s type, their biases F32."""
    if param == "sinks":
        return {f"blk.{layer}.attn_sinks.weight": (array, None)}
    bias = param.endswith("_bias")
    kind = "bias" if bias else "weight"
    if param.startswith("down_proj"):
        parts = {"ffn_down_exps": array if bias else array.swapaxes(1, 2)}
    else:
        parts = {"ffn_gate_exps": array[..., 0::2], "ffn_up_exps": array[..., 1::2]}
        parts = parts if bias else {name: part.swapaxes(1, 2) for name, part in parts.items()}
    return {f"blk.{layer}.{name}.{kind}": (np.ascontiguousarray(part), None if bias else feed_forward)
            for name, part in parts.items()}  # fmt: skip


def _common_metadata(writer: Any, config: dict[str, Any], arch: str, rope: dict[str, Any], head_dim: int) -> None:
    """The keys llama.cpp's converter writes for every family but Gemma 4 (`_gemma4_metadata`)."""
    from gguf import ExpertGatingFuncType, RopeScalingType

    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    writer.add_block_count(config["num_hidden_layers"] + _prediction_layers(config, arch))
    writer.add_context_length(2048 if arch == "falcon" else config["max_position_embeddings"])  # (Falcon's converter
    # writes 2,048 whatever the model's)
    writer.add_embedding_length(hidden)
    if arch == "llama4":  # its dense layers' width; `intermediate_size` is its experts'
        writer.add_feed_forward_length(config["intermediate_size_mlp"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
        writer.add_interleave_moe_layer_step(config["interleave_moe_layer_step"])
    elif arch == "lfm2":
        writer.add_feed_forward_length(_lfm2_feed_forward_length(config))
    elif arch == "granitehybrid" and not config.get("num_local_experts"):  # its dense MLP: the shared MLP
        writer.add_feed_forward_length(config["shared_intermediate_size"])
    elif arch == "lfm2moe":  # its dense layers' width as stated; its experts' below
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_leading_dense_block_count(config["num_dense_layers"])
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    elif arch in ("phi2", "falcon", "gpt2", "starcoder", *_GGUF_ALIBI):  # their converters', whatever the MLP's width
        writer.add_feed_forward_length(4 * hidden)
    elif "intermediate_size" in config:  # Qwen3.5-MoE's has none (every layer's MLP is its experts)
        writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    if arch in ("command-r", "cohere2"):  # LayerNorms, their logits scaled
        writer.add_layer_norm_eps(config["layer_norm_eps"])
        writer.add_logit_scale(config["logit_scale"])
    elif arch in _GGUF_LAYER_NORMED:  # (OLMo's converter writes its fixed 1e-5)
        writer.add_layer_norm_eps(config.get("layer_norm_eps") or config.get("layer_norm_epsilon")
                                  or config.get("norm_epsilon") or config.get("norm_eps") or 1e-5)  # fmt: skip
        if arch in ("gptneox", "stablelm"):
            writer.add_parallel_residual(bool(config.get("use_parallel_residual", arch == "gptneox")))
        if arch == "olmo" and config.get("clip_qkv") is not None:
            writer.add_clamp_kqv(config["clip_qkv"])
        if arch == "mpt":
            _mpt_metadata(writer, config["attn_config"])
    else:
        writer.add_layer_norm_rms_eps(config["norm_eps"] if arch.startswith("lfm2") else config["rms_norm_eps"])
    if arch in _GGUF_ALIBI:  # no rope; BLOOM's KV heads, every head's (MPT's converter writes none)
        if arch == "bloom":
            writer.add_head_count_kv(heads)
        return
    if rope.get("rope_type") == "dynamic" and rope.get("alpha"):  # Hunyuan's: NTK's alpha applied to the base
        writer.add_rope_freq_base(rope["rope_theta"] * rope["alpha"] ** (head_dim / (head_dim - 2)))
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch in _GGUF_LATENT_ARCHES:
        _deepseek2_metadata(writer, config, rope)
    elif arch == "granitehybrid":  # KV heads on the attention layers, 0 on the Mamba-2 ones; their ssm.* keys
        _granite_hybrid_metadata(writer, config, head_dim)
    elif arch == "jamba":  # Mamba-1: no KV heads on its layers, its shape as `ssm.*`
        _jamba_metadata(writer, config)
    elif arch in ("lfm2", "lfm2moe"):  # KV heads on the attention layers, 0 on the convolution ones (which it is)
        kv_heads = config["num_key_value_heads"]
        writer.add_head_count_kv([kv_heads if kind == "full_attention" else 0 for kind in config["layer_types"]])
        writer.add_shortconv_l_cache(config["conv_L_cache"])
        writer.add_rope_dimension_count(head_dim)
    else:
        if arch not in ("gptneox", "gpt2"):  # (theirs write none: every head its own K/V; Phi-2's the heads')
            kv_heads = heads if arch == "phi2" else falcon_kv_heads(config) if arch == "falcon" \
                else config["num_key_value_heads"]  # fmt: skip
            writer.add_head_count_kv(kv_heads)
        if arch == "falcon":
            writer.add_tensor_data_layout("jploski")
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch not in ("llama4", "starcoder2"):  # llama.cpp reads a llama4 file's 0 as MobileLLM's (no chunks); its
        # converter writes none, nor StarCoder2's (llama.cpp runs it without windows)
        writer.add_sliding_window(config.get("sliding_window") or 0)
    if arch == "exaone4" and config.get("sliding_window"):  # its converter's flag per layer
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])
    if arch == "falcon-h1":  # Mamba-2 beside the attention in every layer: its heads as the time-step rank
        writer.add_ssm_conv_kernel(config["mamba_d_conv"])
        writer.add_ssm_state_size(config["mamba_d_state"])
        writer.add_ssm_group_count(config["mamba_n_groups"])
        writer.add_ssm_inner_size(config["mamba_d_ssm"])
        writer.add_ssm_time_step_rank(config["mamba_n_heads"])
    if arch in _GGUF_HYBRIDS:
        writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(config["linear_key_head_dim"])
        writer.add_ssm_group_count(config["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
        writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
        writer.add_full_attention_interval(config["layer_types"].index("full_attention") + 1)
        if arch != "qwen3next":  # Qwen3.5's multimodal rope: on text every section has the same position
            writer.add_rope_dimension_sections([int(head_dim * rope["partial_rotary_factor"]) // 2, 0, 0, 0])
    if rope.get("rope_type") == "llama3":  # the per-frequency divisors, as a tensor
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(rope, head_dim))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":  # gpt-oss's: its betas are llama.cpp's defaults, not written
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "mistral3":  # Ministral 3's, as its converter writes them
        writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    if config.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") \
        or config.get("moe_num_experts")  # fmt: skip
    if arch == "ernie4_5-moe":  # its converter's keys (the shared experts' width from the dense one: as released)
        writer.add_interleave_moe_layer_step(config["moe_layer_interval"])
        writer.add_leading_dense_block_count(config["moe_layer_start_index"])
        writer.add_expert_shared_count(config["moe_num_shared_experts"])
        writer.add_expert_shared_feed_forward_length(config["intermediate_size"] // config["num_key_value_heads"])
    if arch == "minimax-m2":
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if arch in _GGUF_GRANITES:  # its multipliers, as llama.cpp's converter names them
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])
    if arch == "dots1":  # DeepSeek-V3's experts, as its converter describes them
        writer.add_expert_shared_count(config["n_shared_experts"])
        writer.add_leading_dense_block_count(config["first_k_dense_replace"])
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if arch == "glm4moe":  # DeepSeek-V3's experts, as its converter describes them
        writer.add_expert_shared_count(config["n_shared_experts"])
        writer.add_leading_dense_block_count(config["first_k_dense_replace"])
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
        writer.add_nextn_predict_layers(_prediction_layers(config, arch))
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.get("num_experts_per_tok") or config["moe_k"])
        if arch in ("gpt-oss", "minimax-m2", "granitemoe", "granitehybrid"):  # their experts: intermediate_size wide
            writer.add_expert_feed_forward_length(config["intermediate_size"])
        elif arch not in ("llama", "llama4", "jamba"):  # (Jamba's experts: its feed_forward_length wide)
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        shared = config.get("shared_expert_intermediate_size") or config.get("shared_intermediate_size")
        if shared:
            writer.add_expert_shared_feed_forward_length(shared)


def _granite_hybrid_metadata(writer: Any, config: dict[str, Any], head_dim: int) -> None:
    """Granite 4.0's keys as llama.cpp's converter writes them (`granitehybrid`): KV heads per layer (0 on the Mamba-2
    ones), the Mamba-2 shape as `ssm.*` (the heads as its time-step rank), and rope off (its hybrids turn none;
    the context then 2^20, as written)."""
    layers = config["layer_types"]
    attending = ("attention", "full_attention")  # the released configs' name, transformers 5's
    writer.add_head_count_kv([config["num_key_value_heads"] if kind in attending else 0 for kind in layers])
    writer.add_rope_dimension_count(head_dim)
    writer.add_ssm_conv_kernel(config["mamba_d_conv"])
    writer.add_ssm_state_size(config["mamba_d_state"])
    writer.add_ssm_group_count(config["mamba_n_groups"])
    writer.add_ssm_inner_size(config["mamba_expand"] * config["hidden_size"])
    writer.add_ssm_time_step_rank(config["mamba_n_heads"])
    writer.add_rope_scaling_finetuned(False)
    writer.add_context_length(2**20)


def _llama_cpp_granite(
    name: str, array: np.ndarray, config: dict[str, Any], feed_forward: Any, attention: Any
) -> dict[str, tuple[np.ndarray, Any]]:
    """One of Granite MoE's or Granite 4.0's checkpoint tensors (`model.layers.N.<rest>`) as llama.cpp's converter
    writes it, by GGUF name with its type: the experts' `input_linear` bank split into gate and up banks and the
    shared MLP's into gate and up (`_shexp`, or plain where there are no experts), in `feed_forward`'s type; the
    router F32; Mamba-2's projections in `attention`'s type, its convolution squeezed, `A_log` as `-exp(A_log)` and
    `D` each `[heads, 1]`, the gated norm's weight `[groups, inner / groups]`, F32; {} for any other tensor."""
    layer, _, rest = name.removeprefix("model.layers.").partition(".")
    blk = f"blk.{layer}."
    shared = "_shexp" if config.get("num_local_experts") else ""
    if rest == "block_sparse_moe.input_linear.weight":
        gate, up = np.split(array, 2, axis=1)
        return {f"{blk}ffn_gate_exps.weight": (gate, feed_forward), f"{blk}ffn_up_exps.weight": (up, feed_forward)}
    if rest == "shared_mlp.input_linear.weight":
        gate, up = np.split(array, 2, axis=0)
        return {f"{blk}ffn_gate{shared}.weight": (gate, feed_forward),
                f"{blk}ffn_up{shared}.weight": (up, feed_forward)}  # fmt: skip
    simple = {"block_sparse_moe.output_linear.weight": ("ffn_down_exps.weight", feed_forward),
              "block_sparse_moe.router.layer.weight": ("ffn_gate_inp.weight", None),
              "shared_mlp.output_linear.weight": (f"ffn_down{shared}.weight", feed_forward),
              "mamba.in_proj.weight": ("ssm_in.weight", attention),
              "mamba.out_proj.weight": ("ssm_out.weight", attention),
              "mamba.conv1d.bias": ("ssm_conv1d.bias", None), "mamba.dt_bias": ("ssm_dt.bias", None)}  # fmt: skip
    if rest in simple:
        gguf_name, kind = simple[rest]
        return {blk + gguf_name: (array, kind)}
    groups = config.get("mamba_n_groups") or 1
    reshaped = {"mamba.conv1d.weight": ("ssm_conv1d.weight", lambda a: a.squeeze(1)),
                "mamba.A_log": ("ssm_a", lambda a: -np.exp(a)[:, None]), "mamba.D": ("ssm_d", lambda a: a[:, None]),
                "mamba.norm.weight": ("ssm_norm.weight", lambda a: a.reshape(groups, -1))}  # fmt: skip
    if rest in reshaped:
        gguf_name, change = reshaped[rest]
        return {blk + gguf_name: (np.ascontiguousarray(change(array)), None)}
    return {}


def _llama_cpp_falcon_h1(name: str, tensor: torch.Tensor, config: dict[str, Any]) -> tuple[str, torch.Tensor]:
    """One of Falcon-H1's checkpoint tensors as llama.cpp's converter writes it: each multiplier folded into the
    tensors whose name holds its projection's (the embeddings', the logits', the attention's, Mamba-2's input
    projection's five parts and its output's, the MLP's gate and output), under the names `_write_tensors` maps as
    Llama's (`feed_forward` as `mlp`, `pre_ff_layernorm` as the post-attention norm, the final norm as `norm`)."""
    gate, down = config["mlp_multipliers"]
    attention_in = config["attention_in_multiplier"]
    scales = {"down_proj": down, "gate_proj": gate, "k_proj": config["key_multiplier"] * attention_in,
              "q_proj": attention_in, "v_proj": attention_in, "o_proj": config["attention_out_multiplier"],
              "out_proj": config["ssm_out_multiplier"], "lm_head": config["lm_head_multiplier"],
              "embed_tokens": config["embedding_multiplier"]}  # fmt: skip
    for part, scale in scales.items():
        if part in name:
            tensor = tensor * scale
            break
    if "in_proj" in name:
        inner, grouped = config["mamba_d_ssm"], config["mamba_n_groups"] * config["mamba_d_state"]
        widths = [inner, inner, grouped, grouped, config["mamba_n_heads"]]
        rows = torch.cat([torch.full((width,), float(m)) for width, m in zip(widths, config["ssm_multipliers"],
                                                                              strict=True)])  # fmt: skip
        tensor = tensor * config["ssm_in_multiplier"] * rows[:, None]
    for theirs, ours in ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
                         ("model.final_layernorm.", "model.norm.")):  # fmt: skip
        name = name.replace(theirs, ours)
    return name, tensor


def _jamba_metadata(writer: Any, config: dict[str, Any]) -> None:
    """Jamba's keys as llama.cpp's converter writes them (`jamba`): KV heads per layer (0 on the Mamba ones), Mamba-1's
    shape as `ssm.*`, the experts' count (its experts are `intermediate_size` wide, its `feed_forward_length`)."""
    period, offset = config["attn_layer_period"], config["attn_layer_offset"]
    layers = config["num_hidden_layers"]
    writer.add_head_count_kv([config["num_key_value_heads"] if i % period == offset else 0 for i in range(layers)])
    writer.add_ssm_conv_kernel(config["mamba_d_conv"])
    writer.add_ssm_inner_size(config["mamba_expand"] * config["hidden_size"])
    writer.add_ssm_state_size(config["mamba_d_state"])
    writer.add_ssm_time_step_rank(config["mamba_dt_rank"])


_GPT2_CONV1D = tuple(f".{part}.weight" for part in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_proj",
                                                    "mlp.down_proj"))  # fmt: skip
_HEAD_NORM = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qk])_layernorm\.norms\.(\d+)\.weight")


def _llama_cpp_classic(
    name: str, tensor: torch.Tensor, config: dict[str, Any], arch: str
) -> tuple[str, torch.Tensor]:
    """A classic family's checkpoint tensor under Llama's name (`_CLASSIC_AS_LLAMA`), as llama.cpp's converter writes
    it: GPT-NeoX's and BLOOM's head-by-head and Falcon's KV-grouped q/k/v rows as `cat(q, k, v)`, Nemotron-4's
    LayerNorm1P weights as 1 + w."""
    for theirs, ours in _CLASSIC_AS_LLAMA:
        name = name.replace(theirs, ours)
    if arch == "gpt2" and name.endswith(_GPT2_CONV1D):  # its converter's transposed Conv1D weights
        tensor = tensor.t().contiguous()
    if arch in ("gptneox", "falcon", "bloom") and ".self_attn.qkv_proj." in name:  # grouped by KV head: Falcon's
        heads = config["num_attention_heads"]
        tensor = grouped_qkv_rows(tensor, heads, falcon_kv_heads(config) if arch == "falcon" else heads)
    if arch == "nemotron" and name.endswith("norm.weight"):
        tensor = tensor + 1.0
    return name, tensor


def _mpt_metadata(writer: Any, attention: dict[str, Any]) -> None:
    """MPT's attention keys as llama.cpp's converter writes them: `clip_qkv` as `clamp_kqv` where set, the ALiBi
    bias maximum (0 without ALiBi)."""
    if attention.get("clip_qkv") is not None:
        writer.add_clamp_kqv(attention["clip_qkv"])
    writer.add_max_alibi_bias(float(attention.get("alibi_bias_max", 8)) if attention.get("alibi", True) else 0.0)


def _state_space_metadata(writer: Any, config: dict[str, Any], arch: str) -> None:
    """Mamba's, Falcon Mamba's and Mamba-2's keys as llama.cpp's converter writes them (`mamba`, `mamba2`): no
    attention heads and no MLP (0 for both), the context 2^20 (\"arbitrary\", in its words), the mixer's shape as
    `ssm.*` (Mamba-2's heads as its time-step rank), the norms' epsilon as RMSNorm's, and for `mamba` whether the time
    step, B and C are RMS-normalised (Falcon Mamba's)."""
    hidden, mamba2 = config["hidden_size"], arch == "mamba2"
    writer.add_context_length(2**20)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_ssm_conv_kernel(config["conv_kernel"])
    writer.add_ssm_inner_size(config["num_heads"] * config["head_dim"] if mamba2 else config["intermediate_size"])
    writer.add_ssm_state_size(config["state_size"])
    writer.add_ssm_time_step_rank(config["num_heads"] if mamba2 else config["time_step_rank"])
    writer.add_layer_norm_rms_eps(config["layer_norm_epsilon"])
    if mamba2:
        writer.add_ssm_group_count(config["n_groups"])
    else:
        writer.add_ssm_dt_b_c_rms(config["model_type"] == "falcon_mamba")


def _dbrx_metadata(writer: Any, config: dict[str, Any]) -> None:
    """DBRX's keys as llama.cpp's converter writes them (`dbrx`): its shape from its own names and nested parts, the
    experts' width as `feed_forward_length`, `clip_qkv` as `attention.clamp_kqv`, the LayerNorms' fixed 1e-5; no head
    width, rope dimensions or window."""
    attention, ffn = config["attn_config"], config["ffn_config"]
    writer.add_block_count(config["n_layers"])
    writer.add_context_length(config["max_seq_len"])
    writer.add_embedding_length(config["d_model"])
    writer.add_feed_forward_length(ffn["ffn_hidden_size"])
    writer.add_head_count(config["n_heads"])
    writer.add_head_count_kv(attention["kv_n_heads"])
    writer.add_rope_freq_base(attention["rope_theta"])
    writer.add_clamp_kqv(attention["clip_qkv"])
    writer.add_expert_count(ffn["moe_num_experts"])
    writer.add_expert_used_count(ffn["moe_top_k"])
    writer.add_layer_norm_eps(1e-5)


# DBRX's checkpoint names and llama.cpp's: its `norm_2` (before the experts) is `attn_output_norm`.
_GGUF_DBRX_GLOBAL = {"transformer.wte.weight": "token_embd.weight", "transformer.norm_f.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}  # fmt: skip
_GGUF_DBRX_LAYER = {
    "norm_attn_norm.norm_1": "attn_norm", "norm_attn_norm.attn.Wqkv": "attn_qkv",
    "norm_attn_norm.attn.out_proj": "attn_output", "norm_attn_norm.norm_2": "attn_output_norm",
    "ffn.router.layer": "ffn_gate_inp",
}  # fmt: skip
_GGUF_DBRX_EXPERTS = {"w1": "ffn_gate_exps", "v1": "ffn_up_exps", "w2": "ffn_down_exps"}


def _llama_cpp_dbrx(
    name: str, tensor: torch.Tensor, config: dict[str, Any], feed_forward: Any, attention: Any, output: Any
) -> dict[str, tuple[np.ndarray, Any]]:
    """One of DBRX's checkpoint tensors as llama.cpp's converter writes it, by GGUF name with its type: each
    projection's experts (`ffn.experts.mlp.w1`, `v1`, `w2`, `[experts * width, hidden]`) viewed as `[experts, width,
    hidden]`, `w2`'s then as `[experts, hidden, width]`, in `feed_forward`'s type; q/k/v (one tensor, as stored: no
    rows permuted) and the output projection in `attention`'s, the LM head in `output`'s; norms, embeddings and the
    router F32."""
    array = tensor.float().numpy()
    if name in _GGUF_DBRX_GLOBAL:
        return {_GGUF_DBRX_GLOBAL[name]: (array, output if name == "lm_head.weight" else None)}
    layer, _, rest = name.removeprefix("transformer.blocks.").partition(".")
    stem, _, param = rest.rpartition(".")
    if stem == "ffn.experts.mlp":
        ffn = config["ffn_config"]
        bank = array.reshape(ffn["moe_num_experts"], ffn["ffn_hidden_size"], -1)
        bank = bank.transpose(0, 2, 1) if param == "w2" else bank
        return {f"blk.{layer}.{_GGUF_DBRX_EXPERTS[param]}.weight": (np.ascontiguousarray(bank), feed_forward)}
    kind = _GGUF_DBRX_LAYER[stem]
    return {f"blk.{layer}.{kind}.{param}": (array, attention if kind in ("attn_qkv", "attn_output") else None)}


def _llama_cpp_state_space(
    name: str, tensor: torch.Tensor, config: dict[str, Any], attention: Any
) -> dict[str, tuple[np.ndarray, Any]]:
    """One of Mamba's, Falcon Mamba's or Mamba-2's checkpoint tensors as llama.cpp's converter writes it, by GGUF
    name with its type: the embeddings, final norm and LM head as every family's, a layer's norm `attn_norm`, its
    mixer's tensors as Jamba's Mamba-1 (`_llama_cpp_jamba_mixer`) or Granite 4.0's Mamba-2 (`_llama_cpp_granite`)
    are, the projections in `attention`'s type."""
    globals_ = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip
    array = tensor.float().numpy()
    if name in globals_:
        return {globals_[name]: (array, None)}
    layer, _, rest = name.removeprefix("backbone.layers.").partition(".")
    if rest == "norm.weight":
        return {f"blk.{layer}.attn_norm.weight": (array, None)}
    mamba = f"model.layers.{layer}.{rest.replace('mixer.', 'mamba.', 1)}"
    if config["model_type"] == "mamba2":
        return _llama_cpp_granite(mamba, array, {"mamba_n_groups": config["n_groups"]}, None, attention)
    mixer = _llama_cpp_jamba_mixer(mamba, tensor, attention)
    assert mixer is not None, name
    return mixer


def _llama_cpp_jamba_mixer(name: str, tensor: torch.Tensor, attention: Any) -> dict[str, tuple[np.ndarray, Any]] | None:
    """One of Jamba's Mamba-1 tensors (`model.layers.N.mamba.<rest>`) as llama.cpp's converter writes it: its
    projections in `attention`'s type, the convolution squeezed, `A_log` as `-exp(A_log)`, the rest F32; None for any
    other tensor."""
    if ".mamba." not in name:
        return None
    layer, _, rest = name.removeprefix("model.layers.").partition(".mamba.")
    array = tensor.float().numpy()
    names = {"in_proj.weight": "ssm_in.weight", "x_proj.weight": "ssm_x.weight", "dt_proj.weight": "ssm_dt.weight",
             "dt_proj.bias": "ssm_dt.bias", "out_proj.weight": "ssm_out.weight", "conv1d.bias": "ssm_conv1d.bias",
             "dt_layernorm.weight": "ssm_dt_norm.weight", "b_layernorm.weight": "ssm_b_norm.weight",
             "c_layernorm.weight": "ssm_c_norm.weight", "D": "ssm_d"}  # fmt: skip
    if rest == "conv1d.weight":
        return {f"blk.{layer}.ssm_conv1d.weight": (np.ascontiguousarray(array.squeeze(1)), None)}
    if rest == "A_log":
        return {f"blk.{layer}.ssm_a": (-np.exp(array), None)}
    projection = rest in ("in_proj.weight", "x_proj.weight", "out_proj.weight")
    return {f"blk.{layer}.{names[rest]}": (array, attention if projection else None)}


def _nemotron_h_metadata(writer: Any, config: dict[str, Any], head_dim: int) -> None:
    """Nemotron-H's keys as llama.cpp's converter writes them (`nemotron_h`, Granite 4.0's hybrid converter's): a count
    per block of KV heads (0 but on attention blocks) and of the MLP's width (0 but on MLP blocks; in a Nemotron 3
    file, `nemotron_h_moe`, the experts' width on experts blocks and 0 on all others), the Mamba-2 shape as `ssm.*`,
    no rope (the context then 2^20, as written); Nemotron 3's `expert_*` keys (no count of groups used)."""
    blocks = config["layers_block_type"]
    moe = "moe" in blocks
    writer.add_block_count(len(blocks))
    writer.add_context_length(2**20)
    writer.add_embedding_length(config["hidden_size"])
    width, kind_with = (config["moe_intermediate_size"], "moe") if moe else (config["intermediate_size"], "mlp")
    writer.add_feed_forward_length([width if kind == kind_with else 0 for kind in blocks])
    if moe:
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["moe_shared_expert_intermediate_size"])
        writer.add_expert_count(config["n_routed_experts"])
        writer.add_expert_shared_count(config["n_shared_experts"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
        writer.add_expert_group_count(config["n_group"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv([config["num_key_value_heads"] if kind == "full_attention" else 0 for kind in blocks])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_scaling_finetuned(False)
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])  # (from `layer_norm_epsilon`; the released configs'
    writer.add_layer_norm_rms_eps(config["layer_norm_epsilon"])  # `rms_norm_eps`, the same, read by ladle)
    writer.add_ssm_conv_kernel(config["conv_kernel"])
    writer.add_ssm_state_size(config["ssm_state_size"])
    writer.add_ssm_group_count(config["n_groups"])
    writer.add_ssm_inner_size(config["mamba_num_heads"] * config["mamba_head_dim"])
    writer.add_ssm_time_step_rank(config["mamba_num_heads"])


def _llama_cpp_nemotron_h(
    name: str, array: np.ndarray, config: dict[str, Any], feed_forward: Any, attention: Any
) -> dict[str, tuple[np.ndarray, Any]]:
    """One of Nemotron-H's checkpoint tensors as llama.cpp's converter writes it, by GGUF name with its type: the
    embeddings, final norm and LM head as every family's; a block's norm `attn_norm`; attention's projections in
    `attention`'s type, q/k rows permuted as its llama converter does; the MLP's `ffn_up` / `ffn_down` in
    `feed_forward`'s; Mamba-2's as Granite 4.0's (`_llama_cpp_granite`)."""
    globals_ = {"backbone.embeddings.weight": ("token_embd.weight", None),
                "backbone.norm_f.weight": ("output_norm.weight", None), "lm_head.weight": ("output.weight", None)}
    if name in globals_:  # (its checkpoints, transformers' saved ones too, hold the rest under `backbone.`)
        gguf_name, kind = globals_[name]
        return {gguf_name: (array, kind)}
    layer, _, rest = name.removeprefix("backbone.layers.").partition(".")
    blk = f"blk.{layer}."
    if config["layers_block_type"][int(layer)] == "linear_attention" and rest != "norm.weight":
        mamba = f"model.layers.{layer}.{rest.replace('mixer.', 'mamba.', 1)}"
        return _llama_cpp_granite(mamba, array, {"mamba_n_groups": config["n_groups"]}, feed_forward, attention)
    projections = {"mixer.gate.weight": ("ffn_gate_inp", None),
                   "mixer.shared_experts.up_proj.weight": ("ffn_up_shexp", feed_forward),
                   "mixer.shared_experts.down_proj.weight": ("ffn_down_shexp", feed_forward),
                   "mixer.q_proj.weight": ("attn_q", attention), "mixer.k_proj.weight": ("attn_k", attention),
                   "mixer.v_proj.weight": ("attn_v", attention), "mixer.o_proj.weight": ("attn_output", attention),
                   "mixer.up_proj.weight": ("ffn_up", feed_forward),
                   "mixer.down_proj.weight": ("ffn_down", feed_forward),
                   "norm.weight": ("attn_norm", None)}  # fmt: skip
    if rest == "mixer.gate.e_score_correction_bias":  # Nemotron 3's routing bias
        return {f"{blk}exp_probs_b.bias": (array, None)}
    gguf_kind, kind = projections[rest]
    if gguf_kind in ("attn_q", "attn_k"):
        heads = config["num_attention_heads" if gguf_kind == "attn_q" else "num_key_value_heads"]
        array = array.reshape(heads, 2, -1, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
    return {f"{blk}{gguf_kind}.weight": (np.ascontiguousarray(array), kind)}


def _lfm2_feed_forward_length(config: dict[str, Any]) -> int:
    """LFM2's MLP width as llama.cpp's converter writes it: with `block_auto_adjust_ff_dim`, two thirds of
    `intermediate_size`, times `block_ffn_dim_multiplier` where set, rounded up to a multiple of `block_multiple_of`."""
    width = int(config["intermediate_size"])
    if config["block_auto_adjust_ff_dim"]:
        width = int(2 * width / 3)
        if config["block_ffn_dim_multiplier"] is not None:
            width = int(config["block_ffn_dim_multiplier"] * width)
        multiple = int(config["block_multiple_of"])
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def _deepseek2_metadata(writer: Any, config: dict[str, Any], rope: dict[str, Any]) -> None:
    """DeepSeek-V2/V3's and GLM-4.7-Flash's keys as llama.cpp's converter writes them (its `deepseek2`): the latent as
    one KV head whose key is the latent and the rope key and whose value is the latent, each head's own widths as
    `*_mla`, the ranks, the experts' routing (softmax for V2, sigmoid for the others) with DeepSeek's YaRN attention
    scale, and GLM-4.7-Flash's prediction layers (`_prediction_layer_tensors`). Its dense layers must lead."""
    from gguf import ExpertGatingFuncType

    rank, rope_dims = config["kv_lora_rank"], config["qk_rope_head_dim"]
    writer.add_head_count_kv(1)
    writer.add_key_length(rank + rope_dims)
    writer.add_value_length(rank)
    writer.add_key_length_mla(config["qk_nope_head_dim"] + rope_dims)
    writer.add_value_length_mla(config["v_head_dim"])
    writer.add_kv_lora_rank(rank)
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_rope_dimension_count(rope_dims)
    kinds = config.get("mlp_layer_types")  # GLM-4.7-Flash's: llama.cpp reads the leading dense ones alone
    dense = config["first_k_dense_replace"] if kinds is None else kinds.index("sparse")
    assert kinds is None or set(kinds[dense:]) == {"sparse"}, kinds
    writer.add_leading_dense_block_count(dense)
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    if config.get("num_nextn_predict_layers"):
        writer.add_nextn_predict_layers(config["num_nextn_predict_layers"])
    sigmoid = config["model_type"] != "deepseek_v2"
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if sigmoid else ExpertGatingFuncType.SOFTMAX)
    if config.get("n_group") and (sigmoid or config.get("topk_method") == "group_limited_greedy"):
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
    if rope.get("mscale_all_dim") is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if config["model_type"] == "glm_moe_dsa":  # GLM-5's indexer (its converter's `GlmMoeDsaModel`)
        arch = writer.arch
        writer.add_indexer_head_count(config["index_n_heads"])
        writer.add_indexer_key_length(config["index_head_dim"])
        writer.add_indexer_top_k(config["index_topk"])
        if config.get("indexer_types") is not None:  # (gguf 0.19 has no writer method for it: llama.cpp's key)
            writer.add_array(f"{arch}.attention.indexer.types", [kind == "full" for kind in config["indexer_types"]])


def _prediction_layers(config: dict[str, Any], arch: str) -> int:
    """How many multi-token-prediction layers llama.cpp's converter writes after the decoder layers: GLM-4.5's and
    GLM-4.7-Flash's (their checkpoints hold them; `_prediction_layer_tensors`), none for the other families here."""
    return int(config.get("num_nextn_predict_layers") or 0) if arch in ("glm4moe", *_GGUF_LATENT_ARCHES) else 0


def _prediction_layer_tensors(
    tensors: dict[str, tuple[np.ndarray, Any]], config: dict[str, Any], arch: str
) -> dict[str, tuple[np.ndarray, Any]]:
    """GLM-4.5's (and GLM-4.7-Flash's) multi-token-prediction layers as its converter writes them, `blk.<n>` after
    the decoder layers: a decoder layer's tensors (here the last one's, as drawn: transformers' model holds none of
    its own) and the `nextn.*` ones that feed it (its projection of the joined embedding and hidden state, their
    norms)."""
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    last = f"blk.{layers - 1}."
    out: dict[str, tuple[np.ndarray, Any]] = {}
    rng = np.random.default_rng(layers)
    for extra in range(layers, layers + _prediction_layers(config, arch)):
        out.update({f"blk.{extra}." + name.removeprefix(last): value for name, value in tensors.items()
                    if name.startswith(last)})  # fmt: skip
        out[f"blk.{extra}.nextn.eh_proj.weight"] = ((rng.standard_normal((hidden, 2 * hidden)) * 0.08).astype(
            np.float32), None)  # fmt: skip
        for norm in ("enorm", "hnorm", "shared_head_norm"):
            out[f"blk.{extra}.nextn.{norm}.weight"] = (np.ones(hidden, np.float32), None)
    return out


def _llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """llama3 rope scaling's divisor of each frequency, as llama.cpp's converter computes its `rope_freqs` tensor: 1
    for wavelengths under the original context over `high_freq_factor`, `factor` over it over `low_freq_factor`,
    interpolated between."""
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    original = rope["original_max_position_embeddings"]
    divisors = []
    for freq in 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _write_tensors(
    writer: Any, folder: Path, config: dict[str, Any], arch: str, feed_forward: Any, attention: Any, output: Any,
    types: dict[str, Any] | None, fuse_gate_up_exps: bool = False, joined_kv_b: bool = False,
) -> None:
    """`folder`'s checkpoint tensors under llama.cpp's names and in the types `write_gguf` says; writes the file."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    from safetensors.torch import load_file

    gemma, gemma4 = arch.startswith("gemma"), arch in ("gemma4", "gemma3n")  # (Gemma 3n's: Gemma 4's names, plain w)
    heads = config.get("num_attention_heads")
    layer_names = {**(_GGUF_GEMMA_LAYER if gemma else _GGUF_LAYER), **_GGUF_MOE_LAYER}
    if gemma4:
        layer_names.update({**_GGUF_GEMMA4_LAYER, **_GGUF_GEMMA3N_LAYER})
    stream_projections: dict[str, dict[int, np.ndarray]] = {}  # Gemma 3n's, by GGUF name
    hybrid = arch in _GGUF_HYBRIDS
    if hybrid or arch in ("gpt-oss", "glm4moe", "seed_oss", "exaone4", "olmo2"):
        layer_names["post_attention_layernorm"] = "post_attention_norm"
    if arch == "falcon":  # 40B's and 180B's two norms: llama.cpp's attention reads `attn_norm_2`, its MLP `attn_norm`
        layer_names.update({"ln_attn": "attn_norm_2", "ln_mlp": "attn_norm"})
    if arch in ("exaone4", "olmo2"):  # OLMo 2's norm after the MLP
        layer_names["post_feedforward_layernorm"] = "post_ffw_norm"
    if arch == "glm4":  # Gemma's four norms under its own names: `ffn_norm` is the one before the MLP
        layer_names.update({"post_self_attn_layernorm": "post_attention_norm", "post_attention_layernorm": "ffn_norm",
                            "post_mlp_layernorm": "post_ffw_norm"})  # fmt: skip
    if arch in ("glm4moe", *_GGUF_LATENT_ARCHES, "ernie4_5-moe", "dots1"):  # DeepSeek-V3's shared experts
        layer_names.update({f"mlp.shared_experts.{part}_proj": f"ffn_{part}_shexp" for part in ("gate", "up", "down")})
    if arch in _GGUF_LATENT_ARCHES:
        layer_names.update({**_GGUF_LATENT_LAYER, **_GGUF_INDEXER_LAYER})
    if arch in ("lfm2", "lfm2moe"):
        layer_names = _GGUF_LFM2_LAYER
    if arch == "apertus":  # its norms' own names
        layer_names.update({"attention_layernorm": "attn_norm", "feedforward_layernorm": "ffn_norm"})
    xielu: dict[str, dict[int, float]] = {}  # Apertus's xIELU scalars, written as metadata
    tensors: dict[str, tuple[np.ndarray, Any]] = {}
    banks: dict[str, dict[int, np.ndarray]] = {}
    linear: dict[str, dict[str, torch.Tensor]] = {}
    head_norms: dict[str, dict[int, np.ndarray]] = {}  # StableLM 2's per-head q/k norms, stacked by its converter
    for name, tensor in load_file(folder / "model.safetensors").items():
        if arch in _GGUF_CLASSIC:
            name, tensor = _llama_cpp_classic(name, tensor, config, arch)
            head_norm = _HEAD_NORM.fullmatch(name)
            if head_norm is not None:
                stacked = f"blk.{head_norm[1]}.attn_{head_norm[2]}_norm.weight"
                head_norms.setdefault(stacked, {})[int(head_norm[3])] = tensor.float().numpy()
                continue
        if arch == "falcon-h1":
            name, tensor = _llama_cpp_falcon_h1(name, tensor, config)
        if arch in _GGUF_STATE_SPACE:
            tensors.update(_llama_cpp_state_space(name, tensor, config, attention))
            continue
        if arch == "dbrx":
            tensors.update(_llama_cpp_dbrx(name, tensor, config, feed_forward, attention, output))
            continue
        if arch == "jamba":
            if (jamba := _llama_cpp_jamba_mixer(name, tensor, attention)) is not None:
                tensors.update(jamba)
                continue
            name = name.replace(".feed_forward.router.", ".mlp.gate.").replace(".feed_forward.", ".mlp.")
            name = name.replace(".pre_ff_layernorm.", ".post_attention_layernorm.")
            name = name.replace("model.final_layernorm.", "model.norm.")
        stem, param = name.rsplit(".", 1)
        kind_type = None  # norms, embeddings and routers stay F32
        if hybrid and ".linear_attn." in name:
            layer, rest = name.removeprefix("model.layers.").split(".linear_attn.")
            linear.setdefault(layer, {})[rest] = tensor
            continue
        if (gemma or hybrid) and not gemma4 and name.endswith("norm.weight"):  # Gemma 4's norms are plain w
            tensor = tensor + 1.0
        array = tensor.float().numpy()
        bare = name.removeprefix("model.layers.").partition(".")
        if ".mlp.act_fn." in name:
            xielu.setdefault(param, {})[int(bare[0])] = float(tensor)
            continue
        if arch.startswith("nemotron_h") and ".mixer.experts." in name:  # Nemotron 3's, stacked by projection
            layer, _, rest = name.removeprefix("backbone.layers.").partition(".mixer.experts.")
            expert, proj, _ = rest.split(".")
            banks.setdefault(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", {})[int(expert)] = array
            continue
        if arch.startswith("nemotron_h"):
            tensors.update(_llama_cpp_nemotron_h(name, array, config, feed_forward, attention))
            continue
        if arch in (*_GGUF_GRANITES, "falcon-h1") and (
            granite := _llama_cpp_granite(name, array, config, feed_forward, attention)
        ):  # (Falcon-H1's Mamba-2 tensors are Granite 4.0's)
            tensors.update(granite)
            continue
        if arch == "llama4" and stem.endswith(".feed_forward.experts"):  # the banks: [E, H, 2I] and [E, I, H]
            if param == "gate_up_proj":
                gate, up = (np.ascontiguousarray(half.swapaxes(1, 2)) for half in np.split(array, 2, axis=-1))
                tensors[f"blk.{bare[0]}.ffn_gate_exps.weight"] = (gate, feed_forward)
                tensors[f"blk.{bare[0]}.ffn_up_exps.weight"] = (up, feed_forward)
            else:
                down = np.ascontiguousarray(array.swapaxes(1, 2))
                tensors[f"blk.{bare[0]}.ffn_down_exps.weight"] = (down, feed_forward)
            continue
        if arch == "gpt-oss" and (stem.endswith(".mlp.experts") or param == "sinks"):
            tensors.update(_gpt_oss_tensors(bare[0], param, array, feed_forward))
            continue
        if stem.rpartition(".")[0] in _GGUF_GEMMA3N_STACKED:  # one of a stack: `model.altup_projections.<i>`
            owner, _, index = stem.rpartition(".")
            stream_projections.setdefault(_GGUF_GEMMA3N_STACKED[owner], {})[int(index)] = array
            continue
        if gemma4 and name.endswith(".altup.correct_output_scale"):  # its converter's name for it: `.weight` added
            tensors[f"blk.{bare[0]}.altup_correct_scale.weight"] = (array, None)
            continue
        if gemma4 and (name in _GGUF_GEMMA4_GLOBAL or bare[2] in _GGUF_GEMMA4_BARE):
            gguf_name = _GGUF_GEMMA4_GLOBAL.get(name) or f"blk.{bare[0]}.{_GGUF_GEMMA4_BARE[bare[2]]}"
            banked = gguf_name.endswith("_exps.weight")  # the experts' banks in `feed_forward`'s type
            tensors[gguf_name] = (array, feed_forward if banked else None)
            continue
        if stem.startswith("model.layers."):
            layer, kind = stem.removeprefix("model.layers.").split(".", 1)
            if arch == "llama4":  # Llama 4's MLP is its `feed_forward`, its router `feed_forward.router`
                kind = kind.replace("feed_forward.router", "mlp.gate").replace("feed_forward.", "mlp.")
            expert = _EXPERT.fullmatch(kind)
            if expert is not None:
                banks.setdefault(f"blk.{layer}.{_GGUF_EXPERT[expert[2]]}.{param}", {})[int(expert[1])] = array
                continue
            if param in ("e_score_correction_bias", "expert_bias"):  # the routing bias (MiniMax-M2's, LFM2-MoE's:
                # on the block)
                tensors[f"blk.{layer}.exp_probs_b.bias"] = (array, None)
                continue
            gguf_name = f"blk.{layer}.{layer_names[kind]}.{param}"
            if arch in ("lfm2", "lfm2moe"):  # the MLP's in `feed_forward`'s type, the mixers' in `attention`'s
                kind_type = None if kind.endswith(("norm", "conv.conv", "feed_forward.gate")) else feed_forward \
                    if kind.startswith("feed_forward.") else attention  # fmt: skip
                array = array.squeeze(1) if kind == "conv.conv" else array  # stored [channels, taps]
            elif layer_names[kind] in _GGUF_ROUTERS:
                array = array.reshape(-1) if layer_names[kind] == "ffn_gate_inp_shexp" else array
            elif kind.startswith(("mlp.", "block_sparse_moe.", "per_layer_")):
                kind_type = feed_forward
            elif kind.startswith("self_attn.") and not kind.endswith("_norm"):  # Gemma's q/k norms stay F32
                kind_type = attention
            if arch in ("llama", "mistral3", "arcee", "olmo", *_GGUF_GRANITES) and kind in ("self_attn.q_proj",
                                                                                     "self_attn.k_proj"):
                heads_here = heads if kind == "self_attn.q_proj" else config["num_key_value_heads"]
                array = array.reshape(heads_here, 2, -1, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
        else:
            gguf_name = f"{_GGUF_GLOBAL[stem]}.{param}" if stem in _GGUF_GLOBAL else _GGUF_GEMMA4_GLOBAL[name]
            kind_type = output if stem == "lm_head" else feed_forward if stem.endswith("per_layer_model_projection") \
                else None
        if arch == "falcon-h1" and gguf_name.endswith(".ffn_norm.weight"):  # its converter's name for it: no suffix
            gguf_name = gguf_name.removesuffix(".weight")
        tensors[gguf_name] = (array, kind_type if array.ndim > 1 else None)  # biases stay F32, as llama.cpp's
    for gguf_name, rows in head_norms.items():
        tensors[gguf_name] = (np.stack([rows[head] for head in range(len(rows))]), None)
    for layer, weights in linear.items():  # the projections in `attention`'s type; the rest F32
        for gguf_name, array in _llama_cpp_linear_attention(config, arch, layer, weights).items():
            projection = array.ndim > 1 and not gguf_name.endswith("ssm_conv1d.weight")
            tensors[gguf_name] = (array, attention if projection else None)
    for gguf_name, by_expert in banks.items():
        tensors[gguf_name] = (np.stack([by_expert[e] for e in range(len(by_expert))]), feed_forward)
    for gguf_name, by_index in stream_projections.items():  # F32, as the AltUp and LAuReL tensors
        tensors[gguf_name] = (np.stack([by_index[i] for i in range(len(by_index))]), None)
    if not arch.startswith("nemotron_h") and arch != "dbrx":  # (whose configs state no layer count: Nemotron-H's
        # blocks are its pattern's; DBRX's is `n_layers`)
        tensors.update(_prediction_layer_tensors(tensors, config, arch))
    for gguf_name, stored_type in (types or {}).items():
        tensors[gguf_name] = (tensors[gguf_name][0], stored_type)
    if arch in _GGUF_LATENT_ARCHES and not joined_kv_b:
        tensors = _latent_expansion_halves(tensors, config)
    if fuse_gate_up_exps:
        tensors = _fused_gate_up_exps(tensors)
    if xielu:  # as llama.cpp's converter writes them: each scalar as stored (before softplus), one per layer
        writer.add_xielu_alpha_p([xielu["alpha_p"][i] for i in sorted(xielu["alpha_p"])])
        writer.add_xielu_alpha_n([xielu["alpha_n"][i] for i in sorted(xielu["alpha_n"])])
        writer.add_xielu_beta([xielu["beta"][i] for i in sorted(xielu["beta"])])
        writer.add_xielu_eps([xielu["eps"][i] for i in sorted(xielu["eps"])])
    for index, (gguf_name, (array, kind_type)) in enumerate(tensors.items()):
        if kind_type is None or kind_type == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
        elif kind_type in _RANDOM_BLOCK_KINDS:  # gguf has no K-quant or IQ4 quantizer: blocks drawn, not `array`
            from tests.lowbit_blocks import random_blocks

            blocks = random_blocks(_RANDOM_BLOCK_KINDS[kind_type], math.prod(array.shape[:-1]), array.shape[-1],
                                   torch.Generator().manual_seed(index))  # fmt: skip
            writer.add_tensor(gguf_name, blocks.reshape(*array.shape[:-1], -1).numpy(), raw_dtype=kind_type)
        else:
            writer.add_tensor(gguf_name, quantize(array, kind_type), raw_dtype=kind_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_dummy_equals_transformers(preset: str, batch: list[list[int]], atol: float = 1e-4) -> None:
    """`dummy:<preset>` served by the engine (float path) and the same seeded weights in transformers
    (`benchmarks.common.hf_model`, the benchmarks' peer) give each of `batch`'s prompts the same logits, within
    `atol` (the engine's from half the prompt on, as `benchmarks.quality.batch_sequence_logits` reads them)."""
    from benchmarks.common import hf_model
    from benchmarks.quality import batch_sequence_logits
    from engine_server import LLM
    from engine_server.config import CacheConfig, EngineConfig

    model = hf_model(f"dummy:{preset}", "cpu", torch.float32)
    config = EngineConfig(model=f"dummy:{preset}", device="cpu", quantization="none",
                          cache=CacheConfig(memory_bytes=64 * 1024**2))  # fmt: skip
    with LLM(config=config) as llm:
        ours = batch_sequence_logits(llm, batch, [len(ids) // 2 for ids in batch])
    for ids, logits in zip(batch, ours, strict=True):
        with torch.inference_mode():
            theirs = model(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(logits, theirs, atol=atol, rtol=1e-4)
