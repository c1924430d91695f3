"""Our paged-KV models against Hugging Face transformers on tiny random models: logits and greedy tokens."""

from __future__ import annotations

import copy
import math
import random
import re
from dataclasses import dataclass, field, replace
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import transformers

from engine_server.attention_metadata import AttentionMetadata, allocate_kv_cache, kv_cache_bytes_per_block
from engine_server.config import Gemma4Assistant, HyperConnections, LongRope, NormedResiduals
from engine_server.hf_config import model_config_from_hf
from engine_server.hf_mamba import MAX_POSITIONS
from engine_server.layers.attention import PagedSelfAttention
from engine_server.layers.norm import ShardedRMSNorm
from engine_server.models import CausalLM, get_model_class
from engine_server.parallel.group import TensorParallel
from tests.families import DBRX, HYPER_CONNECTION_MAPS, unclamped_time_step

BLOCK_SIZE = 4
VOCAB = 128
SMALL: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# A Laguna config's experts (what the refusals below need to read the rest).
LAGUNA = {"model_type": "laguna", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 48}  # fmt: skip
LINEAR_ATTENTION = {
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
    "layer_types": ["linear_attention", "full_attention"],
}  # fmt: skip
# Qwen4-Exp's small shape (tests/families.py's engines run it too).
QWEN4_EXP: dict[str, Any] = {
    "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 8, "layer_types": ["linear_attention", "indexed_attention"], "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "hc_count": 4,
    "hc_lowrank": 24, "ple_layer_ids": [1], "ple_embed_dim": 32, "ngram_size": 3, "heads_per_ngram": 2,
    "ngram_vocab_size_base": 97, "make_ngram_vocab_size_divisible_by": 8, "split_ngram_parts": 4,
    "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 4,
    "indexer_compress_ratio": 2, "eos_token_id": 2, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}  # fmt: skip
# Top-2 of 8 experts beside a gated shared expert (Qwen3-Next's and Qwen3.5-MoE's MLP).
HYBRID_EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48}  # fmt: skip
# Granite's multipliers (embeddings x12, residuals x0.22, logits /8), with weights drawn wider (0.1) and a sharper
# attention scale (0.5) than Granite 3.x's 1/64: at its 1/64 and transformers' 0.02 init a tiny model's logits barely
# depend on positions (a rope base 5x off moved them 4e-6, inside the comparisons' 1e-4; now 1.5-3e-3).
GRANITE_MULTIPLIERS = {"embedding_multiplier": 12.0, "attention_multiplier": 0.5, "residual_multiplier": 0.22,
                       "logits_scaling": 8.0, "initializer_range": 0.1}  # fmt: skip
FALCON_H1 = {
    "head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
    "mamba_n_groups": 2, "mamba_chunk_size": 16, "embedding_multiplier": 3.0, "lm_head_multiplier": 0.5,
    "key_multiplier": 0.6, "attention_in_multiplier": 1.3, "attention_out_multiplier": 0.8, "ssm_in_multiplier": 1.25,
    "ssm_multipliers": [0.35, 0.25, 0.35, 0.5, 0.7], "ssm_out_multiplier": 0.6, "mlp_multipliers": [0.9, 0.6],
    "initializer_range": 0.1, "pad_token_id": 0,
}  # fmt: skip
GEMMA3N: dict[str, Any] = {
    "num_hidden_layers": 6, "head_dim": 16, "sliding_window": 6, "num_kv_shared_layers": 2,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 100, "laurel_rank": 8,
    "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0, 0.0, 0.0], "final_logit_softcapping": 5.0,
}  # fmt: skip
AXK2_SMALL: dict[str, Any] = {
    "num_hidden_layers": 2, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 6,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "gated_norm_rank": 8, "mlp_layer_types": ["dense", "sparse"], "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
# DeepSeek-V4: an HCA layer (entries of 8 positions), two CSA ones (of 4, the indexer keeping 2 a query: 16 index
# heads, so that no two entries tie at an exact 0, which we break earliest first and transformers' `topk` by its
# vector's length) and a sliding one, each attending over a window of 6 (shorter than the prompts); the first layer's
# experts chosen by token id,
# the rest by sqrt(softplus) scores plus a bias; experts and the shared one clamped at 0.03 (their products at init
# are ~0.05); two mHC streams.
DEEPSEEK_V4: dict[str, Any] = {
    "num_hidden_layers": 4, "head_dim": 16, "partial_rotary_factor": 0.5, "q_lora_rank": 24, "sliding_window": 6,
    "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                    "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 16,
    "index_head_dim": 16, "index_topk": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "hc_mult": 2, "swiglu_limit": 0.03, "pad_token_id": 0,
}  # fmt: skip
# MiniMax-M3: a dense layer of full attention, then two sparse layers over experts; the indexer (2 heads, each over
# two query heads) pools blocks of 2 positions and keeps 2 a query (its own the local one), so prompts past 4 tokens
# attend sparsely; rope over half of each head; every MLP clamped at 0.03 (their products at init are ~0.05).
MINIMAX_M3: dict[str, Any] = {
    "num_hidden_layers": 3, "head_dim": 16, "partial_rotary_factor": 0.5,
    "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
    "mlp_layer_types": ["dense", "sparse", "sparse"], "index_n_heads": 2, "index_head_dim": 16,
    "index_block_size": 2, "index_topk_blocks": 2, "index_local_blocks": 1, "num_local_experts": 8,
    "num_experts_per_tok": 2, "intermediate_size": 32, "dense_intermediate_size": 48, "shared_intermediate_size": 24,
    "routed_scaling_factor": 2.5, "swiglu_limit": 0.03, "pad_token_id": 0,
}  # fmt: skip
# Beam: windowed layers (6 positions, shorter than the prompts) with rope and full ones without, q/k/v/o biases, a
# dense first MLP, then top-2 of 8 experts chosen within the best 2 of 4 groups; logits capped at 0.5 (at their
# size: 30 would leave them as they are).
BEAM: dict[str, Any] = {
    "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 6, "attention_bias": True,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "mlp_layer_types": ["dense"] + ["sparse"] * 3,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}, "full_attention": None},
    "num_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 32,
    "routed_scaling_factor": 2.5, "final_logit_softcapping": 0.5, "pad_token_id": 0,
}  # fmt: skip
# Ergo: windowed layers (6 positions) with rope over interleaved pairs between full ones without (their scores times
# 1.7); a dense relu² first MLP, then top-2 of 8 relu² experts, each normalised with a weight of its own, beside a
# normalised shared one; gated residual adds.
ERGO: dict[str, Any] = {
    "num_hidden_layers": 4, "global_attention_every_n_layers": 2, "sliding_window": 6, "num_dense_blocks": 1,
    "first_dense_intermediate_size": 96, "moe_intermediate_size": 32, "shared_intermediate_size": 48,
    "num_experts": 8, "num_experts_per_tok": 2, "global_attention_scale": 1.7, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}, "pad_token_id": 0,
}  # fmt: skip
DBRX_SMALL = {**DBRX, "n_layers": 2, "max_seq_len": 256, "attn_config": {**DBRX["attn_config"], "clip_qkv": 0.8}}
# Dory's learned per-channel scales (nGPT's), constants at init.
NGPT_SCALES = ("sqk", "s_gate", "lambda_1", "lambda_2", "suv_gate", "suv_up", "logit_scale")
MAX_SEQUENCES = 8  # the recurrent states' slots (`PagedRunner`: sequence i's is slot i)
FAMILIES: dict[str, tuple[type[Any], dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, {"tie_word_embeddings": True}),
    "llama3-rope": (transformers.LlamaConfig, {"rope_parameters": LLAMA3_ROPE}),
    "llama-bias": (transformers.LlamaConfig, {"attention_bias": True, "num_key_value_heads": 1}),
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 24}),
    # Qwen's long-context setting: YaRN over a quarter of the context; linear rope scaling on Llama.
    "qwen3-yarn": (
        transformers.Qwen3Config,
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64}},
    ),
    "llama-linear-rope": (transformers.LlamaConfig, {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}),
    # Granite: multipliers on the embeddings, the scores, the residual adds and the logits (Granite 3.x's values).
    "granite": (
        transformers.GraniteConfig,
        {"embedding_multiplier": 12.0, "attention_multiplier": 0.015625, "residual_multiplier": 0.22,
         "logits_scaling": 8.0},
    ),
    # HyperCLOVA X SEED: Granite's multipliers, its logits multiplied by `logits_scaling`, a norm after each
    # sub-layer's output (use_post_norm, its default) scaled before its residual add; scores by head_dim ** -0.5
    # where attention_multiplier is null. Without the post norms: Granite's block with the logits multiplied.
    "hyperclovax": (
        transformers.HyperCLOVAXConfig,
        {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "logits_scaling": 2.5, "attention_multiplier": None},
    ),
    "hyperclovax-pre-norm": (
        transformers.HyperCLOVAXConfig,
        {"use_post_norm": False, "embedding_multiplier": 3.0, "attention_multiplier": 0.1, "residual_multiplier": 0.5,
         "logits_scaling": 2.5},
    ),
    # DeepSeek-V3: latent attention (a rank-32 query, a rank-24 latent, 12 nope + 8 interleaved rope dims per key,
    # 10 per value) under YaRN with mscale; one dense layer, then 8 experts in 4 groups (2 chosen) of which 3 per
    # token, sigmoid scores with a correction bias, scaled by 2.5, and a shared expert.
    "deepseek-v3": (
        transformers.DeepseekV3Config,
        {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 12,
         "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4,
         "topk_group": 2, "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "routed_scaling_factor": 2.5, "pad_token_id": 0,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}},
    ),
    # Moonlight's layout of it: one q_proj (no query rank), the rope dims as halves (not interleaved), no scaling.
    "deepseek-v3-q-proj": (
        transformers.DeepseekV3Config,
        {"num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 24, "qk_nope_head_dim": 12,
         "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1,
         "topk_group": 1, "moe_intermediate_size": 32, "n_shared_experts": 2, "first_k_dense_replace": 1,
         "rope_interleave": False, "pad_token_id": 0},
    ),
    # Mistral 4: DeepSeek-V3's latent attention with Llama 4's query temperature (over an 8-token original context,
    # so these sequences reach 8 of its steps), softmax routing within the best of 2 groups, no load-balancing bias.
    "mistral4": (
        transformers.Mistral4Config,
        {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 8,
         "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
         "topk_group": 1, "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "routed_scaling_factor": 1.5, "pad_token_id": 0,
         "rope_parameters": {"type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1,
                             "partial_rotary_factor": 0.5}},
    ),
    # Ministral 3: Mistral under YaRN with Llama 4's query temperature on every layer (over an 8-token original
    # context, so these sequences reach several of its steps; beta 0.5, the released 0.1 would move them less);
    # Ministral (2410): windows on the layers its `layer_types` names.
    "ministral3": (
        transformers.Ministral3Config,
        {"head_dim": 16, "pad_token_id": 0,
         "rope_parameters": {"type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5}},
    ),
    # Hunyuan: per-head q/k norms after rope, NTK's alpha on rope's base (a `dynamic` rope with an alpha), q/k/v/o
    # biases here; its MoE: top-2 of 4 experts by softmax, renormalised, beside an ungated shared MLP.
    "hunyuan-dense": (
        transformers.HunYuanDenseV1Config,
        {"head_dim": 16, "attention_bias": True, "pad_token_id": 0,
         "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0, "factor": 1.0}},
    ),
    "hunyuan-moe": (
        transformers.HunYuanMoEV1Config,
        {"head_dim": 16, "num_experts": 4, "moe_topk": 2, "intermediate_size": 48, "pad_token_id": 0,
         "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0, "factor": 1.0}},
    ),
    # InternLM3: Llama under dynamic NTK rope (the sequences here short of max_position_embeddings, where it acts);
    # IQuest-Coder: Llama; Helium: Llama with rope over interleaved pairs, q/k/v biases.
    "internlm3": (
        transformers.InternLM3Config,
        {"head_dim": 16, "pad_token_id": 0, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 50000.0,
                                                                 "factor": 6.0}},
    ),
    "iquestcoder": (transformers.IQuestCoderConfig, {"head_dim": 16, "pad_token_id": 0}),
    "helium": (transformers.HeliumConfig, {"head_dim": 16, "attention_bias": True, "pad_token_id": 0}),
    # Jais 2: Llama with biased LayerNorms, q/k/v/o biases and an ungated relu² MLP with biases.
    "jais2": (transformers.Jais2Config, {"head_dim": 16, "pad_token_id": 0}),
    # CWM: Llama under Llama 3 rope scaling with windowed layers (3 in 4, here 1 in 2, a window shorter than the
    # prompts).
    "cwm": (
        transformers.CwmConfig,
        {"head_dim": 16, "sliding_window": 6, "layer_types": ["full_attention", "sliding_attention"], "pad_token_id": 0,
         "rope_parameters": LLAMA3_ROPE},
    ),
    # Arcee AFM: Llama's block with an ungated relu² MLP.
    "arcee": (transformers.ArceeConfig, {"head_dim": 16, "pad_token_id": 0}),
    # Apertus: per-head q/k norms before rope, an ungated MLP with xIELU (its scalars drawn per layer), Llama 3 rope
    # scaling (Apertus 8B's, over a short original context here), q/k/v/o biases.
    "apertus": (
        transformers.ApertusConfig,
        {"head_dim": 16, "attention_bias": True, "pad_token_id": 0,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    ),
    # Apertus 1.5's text model: Apertus's, its LM head pruned to the vocabulary's first 96 rows (the logits of the
    # other 32 -inf: transformers' narrower logits are compared padded so, `hf_logits`).
    "apertus1p5": (
        transformers.Apertus1p5TextConfig,
        {"head_dim": 16, "output_vocab_size": 96, "tie_word_embeddings": False, "pad_token_id": 0},
    ),
    "ministral": (
        transformers.MinistralConfig,
        {"head_dim": 16, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
         "pad_token_id": 0},
    ),
    # MiniMax-M2: q/k norms over the whole projection, rope over half of each head (its legacy `rotary_dim`), top-2 of
    # 8 experts by sigmoid scores with a load-balancing bias, renormalised.
    "minimax-m2": (
        transformers.MiniMaxM2Config,
        {"head_dim": 16, "rotary_dim": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
         "bos_token_id": 1, "eos_token_id": 2},
    ),
    # GLM-4: sandwich norms under its own names, fused gate/up, q/k/v biases, rope over the first half of each head
    # with its pairs interleaved (head dim 24: 12 turned, 12 not).
    "glm4": (transformers.Glm4Config, {"head_dim": 24, "pad_token_id": 0}),
    # GLM-4-9B (`glm`): GLM-4's attention (q/k/v biases, rope over half of each head in interleaved pairs) and fused
    # MLP in a pre-norm block
    "glm": (transformers.GlmConfig, {"head_dim": 24, "pad_token_id": 0}),
    # Seed-OSS: q/k/v biases, o_proj's apart (here on, as `attention_out_bias` allows); ERNIE 4.5: interleaved rope
    # over each whole head.
    "seed-oss": (transformers.SeedOssConfig, {"head_dim": 24, "attention_out_bias": True, "pad_token_id": 0}),
    "ernie4.5": (transformers.Ernie4_5Config, {"head_dim": 24, "pad_token_id": 0}),
    # ERNIE 4.5's experts: top-3 of 8 by softmax plus a routing bias, 2 shared experts, on every second layer.
    # Cohere: the attention and the MLP in parallel off one LayerNorm, interleaved rope, logits scaled (not by a power
    # of two); Cohere 2 with windows on three layers in four, the fourth without rope.
    "cohere": (transformers.CohereConfig, {"logit_scale": 0.3, "pad_token_id": 0}),
    "cohere2": (
        transformers.Cohere2Config,
        {"num_hidden_layers": 4, "sliding_window": 6, "logit_scale": 0.3, "pad_token_id": 0},
    ),
    "ernie4.5-moe": (
        transformers.Ernie4_5_MoeConfig,
        {"head_dim": 24, "moe_num_experts": 8, "moe_k": 3, "moe_intermediate_size": 32, "moe_num_shared_experts": 2,
         "moe_layer_start_index": 0, "moe_layer_interval": 2, "pad_token_id": 0},
    ),
    # GLM-4.5: grouped-query attention with q/k/v biases, per-head q/k norms and rope over half of each head, then
    # DeepSeek-V3's experts (8 in 2 groups, 1 chosen, 3 per token, a correction bias, scaled by 2.5, a shared one).
    "glm4-moe": (
        transformers.Glm4MoeConfig,
        {"attention_bias": True, "use_qk_norm": True, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 2,
         "topk_group": 1, "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "routed_scaling_factor": 2.5, "pad_token_id": 0},
    ),
    # Solar Open: GLM-4.5's experts on every layer (top-3 of 8 by sigmoid scores and a correction bias, renormalised,
    # a shared one) under Llama's attention (q/k/v biases here, none on o_proj; rope over each whole head).
    "solar-open": (
        transformers.SolarOpenConfig,
        {"head_dim": 16, "attention_bias": True, "n_routed_experts": 8, "num_experts_per_tok": 3,
         "moe_intermediate_size": 32, "n_shared_experts": 1, "routed_scaling_factor": 1.5, "pad_token_id": 0},
    ),
    # AFMoE (Arcee Trinity): gated attention with per-head q/k norms, rope on the windowed layers alone (one in two
    # here, a window shorter than the prompts), sandwich norms, muP's embedding scale; a dense first layer, then
    # top-2 of 8 experts by sigmoid scores and a routing bias, renormalised and scaled, beside 2 shared experts.
    "afmoe": (
        transformers.AfmoeConfig,
        {"head_dim": 16, "num_hidden_layers": 3, "num_dense_layers": 1, "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "num_shared_experts": 2, "route_scale": 2.0, "global_attn_every_n_layers": 2,
         "sliding_window": 6, "mup_enabled": True, "pad_token_id": 0},
    ),
    # FlexOlmo: OLMoE's experts (top-2 of 4, not renormalised) and whole-projection q/k norms under OLMo 2's post-norm
    # block.
    "flex-olmo": (
        transformers.FlexOlmoConfig,
        {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "pad_token_id": 0},
    ),
    # K-EXAONE: EXAONE 4's attention (per-head q/k norms; windows on 3 layers in 4, here shorter than the prompts, the
    # global ones without rope) in a pre-norm block, GLM-4.5's experts (top-2 of 8 by sigmoid scores and a correction
    # bias, a shared one, scaled by 2.5) after a dense first layer.
    "exaone-moe": (
        transformers.ExaoneMoeConfig,
        {"head_dim": 16, "num_hidden_layers": 4, "sliding_window": 6, "sliding_window_pattern": 4, "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_shared_experts": 1, "first_k_dense_replace": 1,
         "pad_token_id": 0},
    ),
    # Youtu-LLM: DeepSeek-V3's latent attention (interleaved rope dims, a low-rank query) over dense MLPs, tied
    # embeddings.
    "youtu": (
        transformers.YoutuConfig,
        {"num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "pad_token_id": 0},
    ),
    # Hy3: GLM-4.5's layout under Apertus's attention (per-head q/k norms, rope over whole heads, q/k/v/o biases
    # here), a dense first layer, then top-2 of 8 experts by sigmoid scores and a correction bias, renormalised and
    # scaled, beside a shared one.
    "hy-v3": (
        transformers.HYV3Config,
        {"head_dim": 16, "attention_bias": True, "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "num_shared_experts": 1, "router_scaling_factor": 2.5, "pad_token_id": 0,
         "initializer_range": 0.05},  # (its 0.006 leaves the experts' share too small to tell)
    ),
    # dots.llm1: GLM-4.5's layout under Qwen3's attention (per-head q/k norms, rope over whole heads, q/k/v/o biases
    # here, windows from its second layer on, shorter than the prompts, as `max_window_layers` puts them), a dense
    # first layer, then top-2 of 8 experts in 2 groups (1 chosen) by sigmoid scores and a correction bias, not
    # renormalised (its default), scaled, beside a shared one.
    "dots1": (
        transformers.Dots1Config,
        {"head_dim": 16, "attention_bias": True, "sliding_window": 6, "max_window_layers": 1, "n_routed_experts": 8,
         "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 32, "n_shared_experts": 1,
         "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "pad_token_id": 0},
    ),
    # Granite SWA: Granite's multipliers (logits unscaled), windows on alternate layers (shorter than the prompts),
    # per-head attention sinks, no rope on the full-attention layers (base 0).
    "granite-swa": (
        transformers.GraniteSWAConfig,
        {"head_dim": 16, "sliding_window": 6, "layer_types": ["full_attention", "sliding_attention"],
         "layer_rope_theta": [0, 50000.0], **GRANITE_MULTIPLIERS, "logits_scaling": 1.0, "pad_token_id": 0},
    ),
    # LFM3: convolutions on the first, second and fourth layers, full attention (proportional rope over half of each
    # head's angles) on the third, windowed attention (6 positions, its own rope base) on the fifth; Gemma's sandwich
    # norms; each head's output gated.
    "lfm3": (
        transformers.Lfm3Config,
        {"num_hidden_layers": 5, "head_dim": 16, "sliding_window": 6, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2},
    ),
    # MiMo-V2-Flash: a full-attention first layer (rope base 5e6), then windowed layers (6 positions, rope base 1e4)
    # with twice the KV heads and a sink per head; rope over 10 of each head's 32 dims, values 16 wide and scaled;
    # the first layer dense, then top-2 of 4 experts by sigmoid scores with a load-balancing bias.
    "mimo-v2-flash": (
        transformers.MiMoV2FlashConfig,
        {"num_hidden_layers": 3, "num_key_value_heads": 1, "head_dim": 32, "v_head_dim": 16, "sliding_window": 6,
         "layer_types": ["full_attention", "sliding_attention", "sliding_attention"], "n_routed_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "attention_value_scale": 0.7},
    ),
    # Jamba: Mamba-1 (128 channels, an 8-wide state, a 4-tap convolution with a bias, its time step, B and C
    # RMS-normalised) on the first and third layers, attention without rope on the others; top-2 of 4 experts (not
    # renormalised) on the second and fourth, dense SwiGLU MLPs on the others.
    "jamba": (
        transformers.JambaConfig,
        {"attn_layer_period": 2, "attn_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2,
         "mamba_d_state": 8, "mamba_dt_rank": 8, "num_hidden_layers": 4, "pad_token_id": 0},
    ),
    # State space models alone (every layer a mixer, no attention, no MLP): Mamba's Mamba-1 (128 channels, an 8-wide
    # state), Falcon Mamba's with its time step, B and C RMS-normalised without a weight, Mamba-2 (8 heads 16 wide in 2
    # groups, a 16-wide state, its output normalised per group).
    "mamba": (transformers.MambaConfig, {"state_size": 8, "time_step_rank": 8, "pad_token_id": 0}),
    "falcon-mamba": (
        transformers.FalconMambaConfig,
        {"state_size": 8, "time_step_rank": 8, "mixer_rms_eps": 1e-5, "pad_token_id": 0},
    ),
    "mamba2": (
        transformers.Mamba2Config,
        {"num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 2, "chunk_size": 16, "pad_token_id": 0},
    ),
    # Cohere2-MoE (Command A+): Command A's parallel block and windows (rope on windowed layers, and on its dense
    # first layer, global), over top-2 of 4 experts (softmax over the top-2 logits) beside a shared expert, the two
    # averaged; its other form: RMSNorms, sigmoid routing renormalised, shared and routed output summed.
    "cohere2-moe": (
        transformers.Cohere2MoeConfig,
        {"num_hidden_layers": 3, "head_dim": 16, "sliding_window": 6, "first_k_dense_replace": 1,
         "sliding_window_pattern": 2, "prefix_dense_intermediate_size": 96, "intermediate_size": 32,
         "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1, "logit_scale": 0.5},
    ),
    "cohere2-moe-sigmoid": (
        transformers.Cohere2MoeConfig,
        {"num_hidden_layers": 3, "head_dim": 16, "sliding_window": 6, "first_k_dense_replace": 1,
         "prefix_dense_sliding_window_pattern": 2, "sliding_window_pattern": 2, "prefix_dense_intermediate_size": 96,
         "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 2,
         "expert_selection_fn": "sigmoid", "shared_expert_combination_strategy": "sum", "rms_norm_eps": 1e-6},
    ),
    # Granite-MoE SWA: that attention (rope on the windowed layer alone) over top-2 of 4 experts beside a shared MLP.
    "granitemoe-swa": (
        transformers.GraniteMoeSWAConfig,
        {"head_dim": 16, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
         "layer_rope_theta": [50000.0, 0], "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
         "shared_intermediate_size": 48, **GRANITE_MULTIPLIERS, "pad_token_id": 0},
    ),
    # MiniCPM3: DeepSeek-V2's latent attention (a low-rank query; rope over halves, under LongRoPE's short factors as
    # MiniCPM3-4B's) over dense MLPs, its embeddings, residual branches and logits scaled (muP).
    "minicpm3": (
        transformers.MiniCPM3Config,
        {"num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "scale_emb": 4.0, "scale_depth": 2.0, "dim_model_base": 16,
         "pad_token_id": 0, "initializer_range": 0.02,
         "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 1.28,
                             "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [4.0] * 4,
                             "original_max_position_embeddings": 200}},
    ),
    # Sarvam 30B: GLM-4.5's model with rope over whole heads and q/k norms (its defaults); Sarvam 105B: DeepSeek-V3's
    # (no query rank, YaRN), the first layer dense.
    "sarvam-moe": (
        transformers.SarvamMoEConfig,
        {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "num_shared_experts": 1, "first_k_dense_replace": 1, "pad_token_id": 0, "initializer_range": 0.05},
    ),
    # Param2: GLM-4.5's model, rope over whole heads, q/k norms, two shared experts (its defaults); the first layer
    # dense. MiniCPM5-MoE: its experts under Llama's attention with a sigmoid gate on each query dim's output.
    "param2moe": (
        transformers.Param2MoeConfig,
        {"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "pad_token_id": 0, "initializer_range": 0.05},
    ),
    "minicpm5-moe": (
        transformers.MiniCPM5MoeConfig,
        {"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.05},
    ),
    "sarvam-mla": (
        transformers.SarvamMLAConfig,
        {"num_key_value_heads": 4, "kv_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10,
         "n_routed_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1, "pad_token_id": 0,
         "initializer_range": 0.05, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                        "original_max_position_embeddings": 16, "mscale_all_dim": 1.0,
                                                        "mscale": 1.0}},
    ),
    # GLM-4.7-Flash: DeepSeek-V3's latent attention (interleaved rope dims) and experts, the dense layers named by
    # `mlp_layer_types` (the second of two here, where DeepSeek's dense layers come first).
    "glm4-moe-lite": (
        transformers.Glm4MoeLiteConfig,
        {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 12,
         "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 1,
         "topk_group": 1, "moe_intermediate_size": 32, "n_shared_experts": 1, "routed_scaling_factor": 1.8,
         "mlp_layer_types": ["sparse", "dense"], "pad_token_id": 0},
    ),
    # DeepSeek-V2: the same attention with its complex (interleaved) rope; softmax routing within the best 2 of 4
    # groups of 2 experts, each group scored by its best, weights not renormalised but scaled.
    "deepseek-v2": (
        transformers.DeepseekV2Config,
        {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 12,
         "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4,
         "topk_group": 2, "topk_method": "group_limited_greedy", "moe_intermediate_size": 32, "n_shared_experts": 1,
         "first_k_dense_replace": 1, "routed_scaling_factor": 1.5, "pad_token_id": 0},
    ),
    # OLMo 2: norms after the attention and the MLP only, q/k norms over the whole projection.
    "olmo2": (transformers.Olmo2Config, {"pad_token_id": 0}),
    # EXAONE 4: OLMo 2's post-norm block with per-head q/k norms; windowed layers alternating with global ones that
    # turn no rope (the 32B's form), or no window and rope everywhere (the 1.2B's).
    "exaone4": (
        transformers.Exaone4Config,
        {"num_hidden_layers": 4, "sliding_window": 6, "sliding_window_pattern": 2, "pad_token_id": 0},
    ),
    "exaone4-full": (
        transformers.Exaone4Config,
        {"sliding_window": None, "layer_types": ["full_attention"] * 2, "pad_token_id": 0},
    ),
    # OLMo 3: OLMo 2's block with a 6-position window on three layers in four; YaRN on the full-attention layers
    # only (the windowed ones keep plain rope of another base).
    "olmo3": (
        transformers.Olmo3Config,
        {"pad_token_id": 0, "num_hidden_layers": 4, "sliding_window": 6,
         "rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                                                "original_max_position_embeddings": 64},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    ),
    # SmolLM3: no rope on every second layer here (every fourth in the released model), o_proj's bias.
    "smollm3": (transformers.SmolLM3Config, {"no_rope_layer_interval": 2, "attention_bias": True, "pad_token_id": 0}),
    # Phi-3: fused checkpoint tensors; partial rotary with LongRoPE's short factors (the sequences here stay below
    # original_max_position_embeddings: tests/unit/test_family_engines.py crosses it).
    "phi3": (transformers.Phi3Config, {"pad_token_id": 0}),
    "phi3-longrope": (
        transformers.Phi3Config,
        {"pad_token_id": 0, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 200,
         "rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 200,
                          "short_factor": [1.0 + 0.25 * i for i in range(6)], "long_factor": [4.0] * 6}},
    ),
    # Mixtures of experts: top-2 of 4 renormalised; top-3 of 8 small experts renormalised, the first layer dense;
    # top-2 of 4 unnormalised beside a gated shared expert.
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # PhiMoE: Mixtral's layout with biased LayerNorms, q/k/v/o and LM head biases, LongRoPE with its mscale; its
    # sparsemixer's reach widened (0.5: most tokens' weights are softmaxes over several logits; at the released
    # 0.01 they are mostly 1).
    "phimoe": (
        transformers.PhimoeConfig,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "attention_bias": True, "lm_head_bias": True,
         "router_jitter_noise": 0.5, "pad_token_id": 0, "original_max_position_embeddings": 200,
         "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 200,
                             "short_factor": [1.0 + 0.25 * i for i in range(8)], "long_factor": [4.0] * 8,
                             "short_mscale": 1.2, "long_mscale": 1.2}},
    ),
    "qwen3-moe": (
        transformers.Qwen3MoeConfig,
        {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": True,
         "mlp_only_layers": [0]},
    ),
    # Mellum: Qwen3-MoE's attention and experts over three layers, windowed (shorter than the prompts), full and
    # windowed again, each kind with its own rope base; a dense first MLP, then top-3 of 8 experts renormalised.
    "mellum": (
        transformers.MellumConfig,
        {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 6,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
         "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
         "mlp_layer_types": ["dense", "sparse", "sparse"], "num_experts": 8, "num_experts_per_tok": 3,
         "moe_intermediate_size": 32, "pad_token_id": 0},
    ),
    # NanoChat: RMSNorms without weights (one over the embeddings too), q/k norms after a rope turned the other way,
    # an ungated relu² MLP, q/k/v/o biases here, logits soft-capped at 2 (these small ones reach it).
    "nanochat": (
        transformers.NanoChatConfig,
        {"attention_bias": True, "final_logit_softcapping": 2.0, "pad_token_id": 0},
    ),
    # OLMo Hybrid: Gated DeltaNet in pre-norm blocks (4 heads, keys 16 wide, values 32, the write strength doubled,
    # the gated norm's epsilon 1e-5) around OLMo 3's post-norm attention (q/k norms over the whole projection), with
    # no rope (its released checkpoints' null base) or with it.
    "olmo-hybrid": (
        transformers.OlmoHybridConfig,
        {"layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 16,
         "linear_value_head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": None},
         "pad_token_id": 0, "eos_token_id": 2},
    ),
    "olmo-hybrid-rope": (
        transformers.OlmoHybridConfig,
        {"num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
         "linear_key_head_dim": 16, "linear_value_head_dim": 32, "pad_token_id": 0, "eos_token_id": 2},
    ),
    # Kolibri-1: per-head q/k norms, a 6-position window on four layers in five (the fifth full attention without
    # rope), GLM-4's sandwich norms, 8 experts (3 per token) chosen by logit plus bias, their sigmoid scores
    # renormalised, beside a shared expert.
    "kolibri1": (
        transformers.Kolibri1Config,
        {"num_hidden_layers": 5, "head_dim": 16, "sliding_window": 6, "num_experts": 8, "num_experts_per_tok": 3,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "norm_topk_prob": True,
         "pad_token_id": 0},
    ),
    # Kolibri-1.1: Kolibri-1's layers, windowed ones with rope (0, 3) between indexed ones without (1, 2, 4, 5);
    # layers 2 and 5 attend over layer 1's K/V, layers 1 and 4 pick pools (4 blocks of 2 keys past 8 keys), each
    # indexed layer keeps the best 3 keys of its pool beside 1 sink and the last 2 (past 6 keys), scored by 2 query
    # heads; a dense first MLP 80 wide.
    "kolibri1.1": (
        transformers.Kolibri1_1Config,
        {"num_hidden_layers": 6, "head_dim": 16, "sliding_window": 6,
         "layer_types": ["sliding_attention", "indexed_attention", "indexed_attention", "sliding_attention",
                         "indexed_attention", "indexed_attention"],
         "index_layers": [1, 4], "kv_source_layers": [0, 1, 1, 3, 4, 1], "index_topk": 3, "index_pool_size": 8,
         "index_compression": 2, "index_num_heads": 2, "index_num_local_tokens": 2, "index_num_sink_tokens": 1,
         "mlp_only_layers": [0], "mlp_only_intermediate_size": 80, "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "norm_topk_prob": True,
         "pad_token_id": 0},
    ),
    # Flint: per-head q/k norms and a learned sink per head, a 6-position window with rope on the middle two layers,
    # full attention without rope on the first and last; a dense first MLP (its default: two), then top-3 of 8
    # experts by sigmoid score (no bias), renormalised, beside an ungated shared expert.
    "flint": (
        transformers.FlintConfig,
        {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 6,
         "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
         "mlp_only_layers": [0], "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48, "pad_token_id": 0},
    ),
    # Lara Mini: Gated DeltaNet (2 key heads, 4 value heads) on the first and third layers, Qwen3's attention with a
    # 6-position window and rope on the second, full without rope on the fourth; plain norms, no output gate; top-3 of
    # 8 experts (softmax, renormalised) beside an ungated shared expert.
    "lara-mini": (
        transformers.LaraMiniConfig,
        {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 6,
         "layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
         "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
         "pad_token_id": 0},
    ),
    # Cohere Compass (North): Command A's parallel block under LayerNorms, rope over halves on its windowed layers
    # (base 50,000; 6 positions) and none on the full one (its null rope parameters), the logits scaled.
    "cohere-compass": (
        transformers.CohereCompassTextConfig,
        {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 6, "logit_scale": 0.5,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 50000.0},
                             "full_attention": None}, "pad_token_id": 0},
    ),
    # Kimi Linear: Kimi Delta Attention (4 heads of 16: a decay per key channel through a rank-16 projection, the
    # output gate likewise, the norm gated by sigmoid) around a latent-attention layer without rope; a dense first
    # MLP, then DeepSeek-V3's router (8 experts in 4 groups, 2 chosen, 3 per token, a bias, scaled by 2.5) beside a
    # shared expert.
    "kimi-linear": (
        transformers.KimiLinearConfig,
        {"num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
         "mlp_layer_types": ["dense", "sparse", "sparse"], "num_key_value_heads": 4, "kv_lora_rank": 24,
         "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "num_local_experts": 8,
         "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
         "routed_scaling_factor": 2.5, "linear_num_heads": 4, "linear_head_dim": 16, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Ling 3: Kimi Delta Attention (4 heads of 16) with whole decay and gate projections and the safe gate's bounded
    # decay, around a latent-attention layer whose heads' outputs are gated each by a sigmoid; a dense first MLP,
    # then DeepSeek-V3's router (8 experts in 4 groups, 2 chosen, 3 per token, a bias, scaled by 2.5) beside a shared
    # expert.
    "ling-3": (
        transformers.BailingHybridConfig,
        {"num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
         "mlp_layer_types": ["dense", "sparse", "sparse"], "num_key_value_heads": 4, "head_dim": 16, "kv_lora_rank": 24,
         "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "num_experts": 8, "num_experts_per_tok": 3,
         "n_group": 4, "topk_group": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
         "routed_scaling_factor": 2.5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # HY-V4: DeepSeek-V3.2's latent attention over the 6 positions its indexer picks (rope on the index heads' last
    # dims; 8 index heads: with 4, a position whose every head's relu is 0 was often among the 6 best, a tie at 0
    # that transformers and we break otherwise), layer 1 reusing layer 0's choice, each value dim of each head gated
    # by a sigmoid, a sink per head; a dense first MLP, then DeepSeek-V3's router (8 experts, 2 per token, a bias,
    # scaled by 2.5) with the experts' SwiGLU clamped at 0.03 (its products at init are ~0.05) beside an unclamped
    # shared expert; four residual streams around every block.
    # A.X K2: DeepSeek-V3.2's indexed latent attention (6 positions a query), its queries and a sigmoid gate per value
    # dim from the query latent beside its norm (one `q_gate_proj`), the input norms (and the sparse layer's norm
    # before its experts) gated by a rank-8 MLP; routing over all 8 experts.
    "axk2": (transformers.AXK2Config, AXK2_SMALL),
    # LongCat-Flash: two layers of two latent-attention blocks with dense MLPs (48 wide), each layer's experts
    # (8 of 32 and 4 zero-computation ones, 3 a token by softmax score plus a bias, scaled by 2.5) beside them; the
    # LoRA scales of its latents.
    "longcat-flash": (
        transformers.LongcatFlashConfig,
        {"num_layers": 2, "ffn_hidden_size": 48, "expert_ffn_hidden_size": 32, "n_routed_experts": 8,
         "zero_expert_num": 4, "moe_topk": 3, "routed_scaling_factor": 2.5, "q_lora_rank": 48, "kv_lora_rank": 24,
         "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "head_dim": 8, "rms_norm_eps": 1e-5,
         "num_key_value_heads": 4, "pad_token_id": 0},
    ),
    # MiniMax-01: lightning attention (blocks of 4 tokens: prompts cross several) on layers 0 and 2, softmax attention
    # on 1 and 3, each block's residuals its normalised inputs scaled by (alpha, beta) of its own kind; top-2 of 4
    # experts.
    "minimax": (
        transformers.MiniMaxConfig,
        {"num_hidden_layers": 4, "head_dim": 16, "block_size": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
         "layer_types": ["linear_attention", "full_attention"] * 2, "full_attn_alpha_factor": 1.7,
         "full_attn_beta_factor": 0.8, "linear_attn_alpha_factor": 1.3, "linear_attn_beta_factor": 1.1,
         "mlp_alpha_factor": 1.5, "mlp_beta_factor": 0.9, "pad_token_id": 0},
    ),
    # BitNet b1.58 with float projections (no quantization_config): Llama with norms before o_proj and down_proj, a
    # gated relu² MLP (its ternary forms: tests/unit/test_bitnet.py).
    "bitnet": (transformers.BitNetConfig, {"pad_token_id": 0}),
    "ergo": (transformers.ErgoConfig, ERGO),
    # RecurrentGemma: two recurrent blocks (4-tap convolutions, RG-LRU gates in 4 blocks) then local multi-query
    # attention (6 positions, shorter than the prompts), then one more recurrent block; 80 wide (sqrt(80) rounds to
    # bfloat16 as its embedding scale); logits capped at 2 (at their size: 30 would leave them as they are).
    "recurrent-gemma": (
        transformers.RecurrentGemmaConfig,
        {"num_hidden_layers": 4, "hidden_size": 80, "num_key_value_heads": 1, "attention_window_size": 6,
         "logits_soft_cap": 2.0, "pad_token_id": 0},
    ),
    # Persimmon: GPT-NeoX's q/k/v in one projection (grouped by head), one q/k LayerNorm with a bias for every head,
    # rope over half of each head, an ungated relu² MLP with biases, a sequential block.
    "persimmon": (transformers.PersimmonConfig, {"pad_token_id": 0}),
    # XGLM and BioGPT: OPT's block, the token embeddings times sqrt(hidden); XGLM's positions sinusoidal, BioGPT's
    # learned (offset by 2).
    "xglm": (transformers.XGLMConfig, {"d_model": 64, "num_layers": 2, "attention_heads": 4, "ffn_dim": 96}),
    "biogpt": (transformers.BioGptConfig, {}),
    # BLOOM: ALiBi, its embeddings LayerNorm'd, GPT-NeoX's fused q/k/v; with 5 heads a power of two's slopes and one
    # more.
    "bloom": (transformers.BloomConfig, {"n_head": 4, "pad_token_id": 3}),
    "bloom-5": (transformers.BloomConfig, {"hidden_size": 80, "n_head": 5, "pad_token_id": 3}),
    # MPT: its ALiBi slopes, q/k/v in one projection clamped, no biases; with 6 heads its slopes of 8 interleaved,
    # the scores scaled by its softmax_scale.
    "mpt": (transformers.MptConfig, {"max_seq_len": 256, "attn_config": {"clip_qkv": 0.15}}),
    # Zamba2: Mamba-2 layers, before three of them one of two shared attention + MLP blocks over cat(h, embeddings)
    # (heads twice hidden / heads wide), each use with adapters of its own on q/k/v and gate/up, rope; and one shared
    # block without attention adapters or rope. Weights drawn 0.08 wide (not 0.02): scores far from uniform, so each
    # part of the block moves the logits.
    "zamba2": (transformers.Zamba2Config, {
        "layers_block_type": ["mamba", "hybrid", "hybrid", "mamba", "hybrid"], "num_hidden_layers": 5,
        "num_mem_blocks": 2, "use_shared_attention_adapter": True, "adapter_rank": 8, "use_mem_rope": True,
        "num_key_value_heads": 4, "n_mamba_heads": 4, "mamba_d_state": 16, "mamba_ngroups": 2, "chunk_size": 8,
        "initializer_range": 0.08,
    }),
    # Untied embeddings: transformers then unties the blocks too, a block for each use.
    "zamba2-untied": (transformers.Zamba2Config, {
        "layers_block_type": ["hybrid", "mamba", "hybrid", "hybrid"], "num_hidden_layers": 4, "num_mem_blocks": 2,
        "use_shared_attention_adapter": True, "adapter_rank": 8, "num_key_value_heads": 4, "n_mamba_heads": 4,
        "mamba_d_state": 16, "chunk_size": 8, "initializer_range": 0.08, "tie_word_embeddings": False,
    }),
    "zamba2-plain": (transformers.Zamba2Config, {
        "layers_block_type": ["hybrid", "mamba", "hybrid"], "num_hidden_layers": 3, "adapter_rank": 8,
        "n_mamba_heads": 4, "mamba_d_state": 16, "chunk_size": 8, "initializer_range": 0.08,
    }),
    # Zamba (the first): multi-head Mamba-1 layers (2 heads of 64 channels, each its own x_proj and dt_proj), one
    # shared attention + MLP block (no rope, no adapters) before the third and fifth, each use's linear map its own.
    "zamba": (transformers.ZambaConfig, {
        "num_hidden_layers": 5, "attn_layer_period": 2, "attn_layer_offset": 1, "num_key_value_heads": 4,
        "n_mamba_heads": 2, "mamba_d_state": 8, "mamba_dt_rank": 8, "initializer_range": 0.08,
    }),
    # Dory: a looped nGPT, one input layer, two recurrent ones run three times, one output layer; windowed layers
    # (4 positions) with a rope base of their own between full ones; q/k/v and MLP biases.
    "dory": (transformers.DoryConfig, {
        "head_dim": 16, "num_hidden_layers": 4, "n_input_layers": 1, "n_output_layers": 1, "n_recurrent_loops": 3,
        "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                             "full_attention"],
        "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False,
    }),
    "mpt-6": (transformers.MptConfig, {"hidden_size": 96, "num_attention_heads": 6, "max_seq_len": 256,
                                       "attn_config": {"softmax_scale": 0.2}}),
    # JetMoE: top-2 of 4 attention experts (each a query per KV head, 2 KV heads of 16) and of 4 MLP experts, each
    # mixture's output biased.
    "jetmoe": (
        transformers.JetMoeConfig,
        {"num_key_value_heads": 2, "kv_channels": 16, "intermediate_size": 32, "num_local_experts": 4,
         "num_experts_per_tok": 2, "tie_word_embeddings": False, "pad_token_id": 0},
    ),
    "beam": (transformers.BeamConfig, BEAM),
    "minimax-m3": (transformers.MiniMaxM3VLTextConfig, MINIMAX_M3),
    # Two local blocks of 3 positions and 3 kept a query, an index head over every query head, rope over whole heads.
    "minimax-m3-local": (
        transformers.MiniMaxM3VLTextConfig,
        {**MINIMAX_M3, "index_n_heads": 1, "index_block_size": 3, "index_topk_blocks": 3, "index_local_blocks": 2,
         "partial_rotary_factor": 1.0, "index_head_dim": 16},
    ),
    "deepseek-v4": (transformers.DeepseekV4Config, DEEPSEEK_V4),
    # Its released rope: YaRN (factor 4 over 16 positions) on the compressing layers alone, their attention factor 1.
    "deepseek-v4-yarn": (
        transformers.DeepseekV4Config,
        {**DEEPSEEK_V4, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                            "beta_fast": 32.0, "beta_slow": 1.0}},
    ),
    "hy-v4": (
        transformers.HYV4Config,
        {"num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"],
         "indexer_types": ["full", "shared", "full"], "q_lora_rank": 48, "kv_lora_rank": 24, "qk_nope_head_dim": 12,
         "qk_rope_head_dim": 8, "v_head_dim": 10, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 6,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
         "routed_scaling_factor": 2.5, "swiglu_limit": 0.03, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Laguna: windowed (shorter than the prompts) and full layers, each kind with its rope base and share (the full
    # ones turn half of each head, its default), 4, 8 and 2 query heads over 2 KV heads, per-head q/k norms, each
    # head's output times softplus of its own gate;
    # a dense first layer, then top-2 of 8 experts by sigmoid scores and a correction bias, renormalised, scaled,
    # beside a shared expert of its own width. Then a gate per element of each head.
    "laguna": (
        transformers.LagunaConfig,
        {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 6, "num_attention_heads_per_layer": [4, 8, 2],
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
         "moe_routed_scaling_factor": 2.5, "pad_token_id": 0},
    ),
    "laguna-per-element": (
        transformers.LagunaConfig,
        {"head_dim": 16, "gating": "per-element", "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "pad_token_id": 0},
    ),
    "qwen2-moe": (
        transformers.Qwen2MoeConfig,
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48},
    ),
    # gpt-oss: attention sinks, biases everywhere, a 6-position window on the even layers, YaRN, top-2 of 4 experts
    # with biases and the clamped SwiGLU (a limit of 0.5 clamps many of these small activations).
    "gpt-oss": (
        transformers.GptOssConfig,
        {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6, "swiglu_limit": 0.5,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}},
    ),
    # OPT: learned positions (its rows offset by 2), LayerNorms and projections with biases, a ReLU MLP, tied
    # embeddings; and without biases (`enable_bias` false).
    "opt": (transformers.OPTConfig, {"ffn_dim": 96, "word_embed_proj_dim": 64}),
    # OPT-350M's form: post-LN blocks, no final norm, embeddings 32 wide projected in and out (its LM head tied to
    # them); GPT-1: post-LN blocks, learned positions, Conv1D weights.
    "opt-350m": (transformers.OPTConfig, {"ffn_dim": 96, "word_embed_proj_dim": 32, "do_layer_norm_before": False}),
    "openai-gpt": (transformers.OpenAIGPTConfig, {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}),
    "opt-unbiased": (transformers.OPTConfig, {"ffn_dim": 96, "word_embed_proj_dim": 64, "enable_bias": False}),
    # GPT-Neo: learned positions, global and local (a 6-position window) layers in turn, unscaled scores, q/k/v
    # without biases and out_proj with one, a GELU (tanh) MLP with biases, tied embeddings.
    "gpt-neo": (transformers.GPTNeoConfig, {"attention_types": [[["global", "local"], 1]], "window_size": 6}),
    # DBRX: top-2 of 4 renormalised (and not: `moe_normalize_expert_weights` null), each layer's experts one tensor a
    # projection, bias-free LayerNorms, q/k/v in one projection clamped to 0.8 (a third of them here).
    "dbrx": (transformers.DbrxConfig, DBRX_SMALL),
    "dbrx-unnormalised": (transformers.DbrxConfig, {
        **DBRX_SMALL, "ffn_config": {**DBRX_SMALL["ffn_config"], "moe_normalize_expert_weights": None}}),
    # OLMoE: top-2 of 4 unnormalised, q/k norms over the whole projection, q/k/v clamped.
    "olmoe": (transformers.OlmoeConfig, {"num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 1.0}),
    # Hybrids of Gated DeltaNet and gated attention (the first layer linear, the second full): Qwen3.5's dense model
    # (2 key heads of 16 dims, each serving 2 value heads of 8); Qwen3-Next's grouped q/k/v/z and b/a projections
    # beside top-2 of 8 experts and a gated shared expert; Qwen3.5's mixture of experts (always renormalised).
    "qwen3.5": (transformers.Qwen3_5TextConfig, {"head_dim": 16, **LINEAR_ATTENTION}),
    "qwen3-next": (
        transformers.Qwen3NextConfig,
        {"head_dim": 16, **LINEAR_ATTENTION, **HYBRID_EXPERTS},
    ),
    "qwen3.5-moe": (
        transformers.Qwen3_5MoeTextConfig,
        {"head_dim": 16, **LINEAR_ATTENTION, **HYBRID_EXPERTS},
    ),
    # Qwen4-Exp: Qwen3.5-MoE's hybrid over 4 hyper-connected streams (a rank-24 map each), n-gram embeddings (2-
    # and 3-grams, 2 hash heads each, tables of primes from 97 on) before the linear layer, QSA on the attention layer
    # (2 index heads of 16, blocks of 2 positions, the best 2 kept: sequences past 5 positions attend sparsely),
    # rope over half of each head.
    "qwen4-exp": (transformers.Qwen4ExpTextConfig, QWEN4_EXP),
    # xLSTM: two mLSTM blocks of 4 heads (q/k 16 wide, v 32: xLSTM 7B's proportions; 128 wide, as transformers'
    # states are sized by widths rounded to 64), transformers' prefill in chunks of 4 tokens (its chunkwise form,
    # against the engine's token-by-token recurrence), gates capped at 1.5 and logits at 2 (bending them).
    "xlstm": (
        transformers.xLSTMConfig,
        {"hidden_size": 128, "num_blocks": 2, "num_heads": 4, "qk_dim_factor": 0.5, "v_dim_factor": 1.0,
         "chunk_size": 4, "gate_soft_cap": 1.5, "output_logit_soft_cap": 2.0, "pad_token_id": 1, "bos_token_id": 0,
         "eos_token_id": 2},
    ),
    # RWKV-4: two blocks of time and channel mixes, the hidden state halved after each (transformers' inference
    # rescaling, every block).
    "rwkv": (transformers.RwkvConfig, {"rescale_every": 1, "context_length": 256}),
    # DiffLlama: Llama's blocks with differential attention (4 heads in two halves, 2 KV heads whose values split in
    # two, a learned lambda per layer).
    "diffllama": (transformers.DiffLlamaConfig, {}),
    # LFM2: gated short convolutions (3 taps) on the first and last layers, attention with per-head q/k norms between.
    "lfm2": (transformers.Lfm2Config, {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"],
                                       "pad_token_id": 0}),
    # Granite 4.0 H: Mamba-2 on the first and last layers (4 heads 32 wide in 2 groups, a 16-wide state, a 4-tap
    # convolution with a bias), attention without rope between; top-2 of 4 experts beside a shared MLP; Granite's
    # multipliers. Granite 4.0's dense form: attention layers alone, rope, the shared MLP alone. Granite 3.0's
    # mixtures of experts, with a shared MLP (granitemoeshared) and without.
    "granite4-h": (
        transformers.GraniteMoeHybridConfig,
        {"num_hidden_layers": 3, "layer_types": ["mamba", "attention", "mamba"], "mamba_n_heads": 4,
         "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 2, "num_local_experts": 4,
         "num_experts_per_tok": 2, "shared_intermediate_size": 48, **GRANITE_MULTIPLIERS, "pad_token_id": 0},
    ),
    # Bamba: Granite 4.0 H's layout without its multipliers, rope over half of each head on its attention layer.
    "bamba": (
        transformers.BambaConfig,
        {"num_hidden_layers": 3, "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 32,
         "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_chunk_size": 16, "pad_token_id": 0},
    ),
    "granite4-dense": (
        transformers.GraniteMoeHybridConfig,
        {"layer_types": ["attention"] * 2, "num_local_experts": 0, "shared_intermediate_size": 48,
         "position_embedding_type": "rope", **GRANITE_MULTIPLIERS, "pad_token_id": 0},
    ),
    "granitemoe": (
        transformers.GraniteMoeConfig,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, **GRANITE_MULTIPLIERS},
    ),
    "granitemoeshared": (
        transformers.GraniteMoeSharedConfig,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "shared_intermediate_size": 48,
         **GRANITE_MULTIPLIERS},
    ),
    # LFM2-MoE: the first layer dense, then top-3 of 8 experts by sigmoid scores plus a routing bias, renormalised.
    "lfm2-moe": (
        transformers.Lfm2MoeConfig,
        {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"], "num_dense_layers": 1,
         "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "pad_token_id": 0},
    ),
    # Nemotron-H: one sublayer per block; Mamba-2 (4 heads 16 wide in 2 groups, a 16-wide state, a 4-tap convolution
    # with a bias), attention without rope and ungated relu² MLPs: blocks M - M * - M pair into four layers, the
    # second and the last without an MLP.
    "nemotron-h": (
        transformers.NemotronHConfig,
        {"layers_block_type": ["mamba", "mlp", "mamba", "attention", "mlp", "mamba"], "head_dim": 16,
         "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "pad_token_id": 0},
    ),
    # Nemotron 3 (Nano's form): those blocks with experts (E) after the mixers, top-2 of 8 ungated relu² experts in 2
    # groups (1 chosen) by sigmoid scores and a routing bias, renormalised, scaled by 2.5, beside a relu² shared expert;
    # an MLP block (-) after one mixer, and a mixer alone.
    "nemotron-h-moe": (
        transformers.NemotronHConfig,
        {"layers_block_type": ["mamba", "moe", "attention", "mlp", "mamba", "moe", "mamba"], "head_dim": 16,
         "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "n_routed_experts": 8,
         "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 32,
         "moe_shared_expert_intermediate_size": 48, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
         "pad_token_id": 0},
    ),
    # Falcon-H1: attention and Mamba-2 (4 heads 16 wide in 2 groups, a 16-wide state) side by side in every layer,
    # the scan's output gated by silu(z) alone, and every µP multiplier away from 1 (weights drawn at 0.1, so each
    # moves the logits). Its other form: the gated output RMS-normalised per group, biases on the attention.
    "falcon-h1": (transformers.FalconH1Config, FALCON_H1),
    "falcon-h1-norm": (
        transformers.FalconH1Config,
        {**FALCON_H1, "mamba_rms_norm": True, "mamba_norm_before_gate": False, "attention_bias": True},
    ),
    # Gemma 4: windowed layers 16 wide, full-attention ones 32 wide with one KV head, values from the keys'
    # projection and proportional rope; the fourth layer attends over the second's K/V (its MLP twice as wide);
    # per-layer inputs 8 wide; logits soft-capped.
    "gemma4": (
        transformers.Gemma4TextConfig,
        {"head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
         "sliding_window": 6, "num_hidden_layers": 4, "num_kv_shared_layers": 1, "use_double_wide_mlp": True,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
         "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB, "final_logit_softcapping": 5.0},
    ),
    # Gemma 4 Unified (Gemma 4 12B's text model): Gemma 4's layers without per-layer inputs or experts, full-attention
    # ones 32 wide, text tokens causal ("vision" bidirectional attention).
    "gemma4-unified": (
        transformers.Gemma4UnifiedTextConfig,
        {"head_dim": 16, "sliding_window": 6, "num_hidden_layers": 4,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
         "per_layer_config": {"1": {"head_dim": 32}, "3": {"head_dim": 32}}},
    ),
    # Gemma 3n: AltUp's four streams, LAuReL of rank 8, the first two layers' MLPs sparse (5% of their gates kept),
    # windows on four layers in six, the last two attending over the third's and fourth's K/V, per-layer inputs 16
    # wide from a table shorter than the vocabulary, logits soft-capped.
    "gemma3n": (transformers.Gemma3nTextConfig, GEMMA3N),
    # Gemma 4's mixture of experts: top-2 of 4 GELU experts beside each layer's dense MLP, its own router.
    "gemma4-moe": (
        transformers.Gemma4TextConfig,
        {"head_dim": 16, "global_head_dim": 32, "sliding_window": 6, "hidden_size_per_layer_input": 0,
         "layer_types": ["sliding_attention", "full_attention"], "enable_moe_block": True, "num_experts": 4,
         "top_k_experts": 2, "moe_intermediate_size": 32},
    ),
    # Llama 4: NoPE on the second layer, with a temperature steep enough for these short sequences (floor 2, scale
    # 0.5); weightless q/k norms, interleaved rope and attention within chunks of 8 positions (two blocks) on the
    # first, so these sequences cross chunks in prefill, chunked prefill and decode; top-1 of 4 experts on the second
    # layer, each chosen expert's input scaled by its sigmoid score, beside a shared expert; the first layer dense.
    "llama4": (
        transformers.Llama4TextConfig,
        {"head_dim": 16, "intermediate_size": 32, "intermediate_size_mlp": 96, "num_local_experts": 4,
         "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "no_rope_layers": [1, 0], "floor_scale": 2,
         "attn_scale": 0.5, "attention_chunk_size": 8},
    ),
    # The classic decoders. GPT-NeoX (Pythia): LayerNorms with biases, head-by-head fused q/k/v, rope over a quarter
    # of each head, exact GELU, the attention and the MLP in parallel off norms of their own (or one after the other).
    "gpt-neox": (transformers.GPTNeoXConfig, {}),
    "gpt-neox-sequential": (transformers.GPTNeoXConfig, {"use_parallel_residual": False, "hidden_act": "gelu_new"}),
    # Falcon 7B: multi-query attention (one KV head), the attention and an exact-GELU MLP in parallel off one
    # LayerNorm; Falcon 40B / 180B: two KV heads (grouped q/k/v), the parallel block off two (`ln_attn`, `ln_mlp`),
    # biases here; Falcon-RW's form without alibi: every head its own K/V, the block one after the other; Falcon-RW
    # (alibi, its biases; 16 heads: slopes that bfloat16 rounds).
    "falcon-7b": (transformers.FalconConfig, {}),
    "falcon-40b": (transformers.FalconConfig, {"new_decoder_architecture": True, "num_kv_heads": 2, "bias": True}),
    "falcon-sequential": (transformers.FalconConfig, {"multi_query": False, "parallel_attn": False}),
    "falcon-rw": (transformers.FalconConfig, {"hidden_size": 128, "num_attention_heads": 16, "alibi": True,
                                              "bias": True, "multi_query": False, "parallel_attn": False}),
    # GPT-2: learned positions, no rope, Conv1D weights ([in, out]) with q/k/v in one; GPT-BigCode (StarCoder): one
    # KV head (`multi_query`), plain weights; its multi-head form's q/k/v grouped head by head.
    "gpt2": (transformers.GPT2Config, {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}),
    "gpt-bigcode": (transformers.GPTBigCodeConfig, {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}),
    "gpt-bigcode-mha": (
        transformers.GPTBigCodeConfig,
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "multi_query": False},
    ),
    # GPT-J: one LayerNorm feeding the attention and a GELU (tanh) MLP in parallel, rope over the first 8 of each
    # head's 16 dims with its pairs interleaved, an LM head bias, q/k/v/o without biases.
    "gptj": (transformers.GPTJConfig, {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "rotary_dim": 8}),
    # CodeGen: GPT-J's block with q/k/v in one projection laid out by its 4 training shards (2 heads a shard here).
    "codegen": (transformers.CodeGenConfig, {"n_embd": 64, "n_layer": 2, "n_head": 8, "num_attention_heads": 8,
                                             "n_positions": 256, "rotary_dim": 4}),
    # Phi-2: one LayerNorm feeding the attention and a GELU (tanh) MLP in parallel, biases everywhere (the LM head
    # too), rope over 0.4 of each head (6 of these 16 dims).
    "phi": (transformers.PhiConfig, {"partial_rotary_factor": 0.4}),
    # StableLM 2 12B: a LayerNorm of each head's own over q and k, the parallel block; StableLM 2 1.6B: q/k/v biases.
    "stablelm-12b": (transformers.StableLmConfig, {"qk_layernorm": True, "use_parallel_residual": True}),
    "stablelm": (transformers.StableLmConfig, {"use_qkv_bias": True}),
    # StarCoder2: biases everywhere, a GELU (tanh) MLP, every layer windowed (a window shorter than the prompts).
    "starcoder2": (transformers.Starcoder2Config, {"sliding_window": 6}),
    # Nemotron-4: LayerNorm1P (1 + weight, with a bias), an ungated relu² MLP, rope over half of each head.
    "nemotron": (transformers.NemotronConfig, {"head_dim": 16}),
    # OLMo: LayerNorms without a weight or a bias, q/k/v clamped (to 0.1: many of these values are past it).
    "olmo": (transformers.OlmoConfig, {"clip_qkv": 0.1}),
    # EXAONE 3.5: Llama under Llama 3 rope scaling, tied embeddings.
    "exaone": (transformers.ExaoneConfig, {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    # Gemma 2: soft-capping tight enough to bend these small models' attention scores (~0.05 at transformers' init)
    # and logits (a real model's 50 and 30 would leave them as they are), a 6-position window on the first layer.
    "gemma2": (
        transformers.Gemma2Config,
        {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 6, "attn_logit_softcapping": 0.05,
         "final_logit_softcapping": 3.0},
    ),
    # VaultGemma: Gemma 2's attention, soft-caps and windows in a pre-norm block (no norms after the sub-layers).
    "vaultgemma": (
        transformers.VaultGemmaConfig,
        {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 6, "attn_logit_softcapping": 0.05,
         "final_logit_softcapping": 3.0},
    ),
}  # fmt: skip
MODEL_CLASSES = {
    transformers.LlamaConfig: transformers.LlamaForCausalLM,
    transformers.Ministral3Config: transformers.Ministral3ForCausalLM,
    transformers.MinistralConfig: transformers.MinistralForCausalLM,
    transformers.ArceeConfig: transformers.ArceeForCausalLM,
    transformers.CwmConfig: transformers.CwmForCausalLM,
    transformers.Jais2Config: transformers.Jais2ForCausalLM,
    transformers.InternLM3Config: transformers.LlamaForCausalLM,
    transformers.IQuestCoderConfig: transformers.LlamaForCausalLM,
    transformers.HeliumConfig: transformers.HeliumForCausalLM,
    transformers.PhimoeConfig: transformers.PhimoeForCausalLM,
    transformers.ApertusConfig: transformers.ApertusForCausalLM,
    transformers.Apertus1p5TextConfig: transformers.Apertus1p5TextForCausalLM,
    transformers.HunYuanDenseV1Config: transformers.HunYuanDenseV1ForCausalLM,
    transformers.HunYuanMoEV1Config: transformers.HunYuanMoEV1ForCausalLM,
    transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
    transformers.Qwen3Config: transformers.Qwen3ForCausalLM,
    transformers.Phi3Config: transformers.Phi3ForCausalLM,
    transformers.MixtralConfig: transformers.MixtralForCausalLM,
    transformers.Qwen3MoeConfig: transformers.Qwen3MoeForCausalLM,
    transformers.MellumConfig: transformers.MellumForCausalLM,
    transformers.NanoChatConfig: transformers.NanoChatForCausalLM,
    transformers.OlmoHybridConfig: transformers.OlmoHybridForCausalLM,
    transformers.LagunaConfig: transformers.LagunaForCausalLM,
    transformers.KimiLinearConfig: transformers.KimiLinearForCausalLM,
    transformers.BailingHybridConfig: transformers.BailingHybridForCausalLM,
    transformers.HYV4Config: transformers.HYV4ForCausalLM,
    transformers.DeepseekV4Config: transformers.DeepseekV4ForCausalLM,
    transformers.LongcatFlashConfig: transformers.LongcatFlashForCausalLM,
    transformers.MiniMaxConfig: transformers.MiniMaxForCausalLM,
    transformers.BitNetConfig: transformers.BitNetForCausalLM,
    transformers.Kolibri1Config: transformers.Kolibri1ForCausalLM,
    transformers.FlintConfig: transformers.FlintForCausalLM,
    transformers.LaraMiniConfig: transformers.LaraMiniForCausalLM,
    transformers.CohereCompassTextConfig: transformers.CohereCompassForCausalLM,
    transformers.Qwen2MoeConfig: transformers.Qwen2MoeForCausalLM,
    transformers.OlmoeConfig: transformers.OlmoeForCausalLM,
    transformers.DbrxConfig: transformers.DbrxForCausalLM,
    transformers.AXK2Config: transformers.AXK2ForCausalLM,
    transformers.OPTConfig: transformers.OPTForCausalLM,
    transformers.CodeGenConfig: transformers.CodeGenForCausalLM,
    transformers.GPTNeoConfig: transformers.GPTNeoForCausalLM,
    transformers.Param2MoeConfig: transformers.Glm4MoeForCausalLM,
    transformers.MiniCPM5MoeConfig: transformers.MiniCPM5MoeForCausalLM,
    transformers.Gemma2Config: transformers.Gemma2ForCausalLM,
    transformers.GptOssConfig: transformers.GptOssForCausalLM,
    transformers.SmolLM3Config: transformers.SmolLM3ForCausalLM,
    transformers.GraniteConfig: transformers.GraniteForCausalLM,
    transformers.HyperCLOVAXConfig: transformers.HyperCLOVAXForCausalLM,
    transformers.VaultGemmaConfig: transformers.VaultGemmaForCausalLM,
    transformers.Olmo2Config: transformers.Olmo2ForCausalLM,
    transformers.Olmo3Config: transformers.Olmo3ForCausalLM,
    transformers.DeepseekV3Config: transformers.DeepseekV3ForCausalLM,
    transformers.Mistral4Config: transformers.Mistral4ForCausalLM,
    transformers.DeepseekV2Config: transformers.DeepseekV2ForCausalLM,
    transformers.Glm4MoeConfig: transformers.Glm4MoeForCausalLM,
    transformers.SolarOpenConfig: transformers.SolarOpenForCausalLM,
    transformers.ExaoneMoeConfig: transformers.ExaoneMoeForCausalLM,
    transformers.FlexOlmoConfig: transformers.FlexOlmoForCausalLM,
    transformers.AfmoeConfig: transformers.AfmoeForCausalLM,
    transformers.YoutuConfig: transformers.YoutuForCausalLM,
    transformers.MiniCPM3Config: transformers.MiniCPM3ForCausalLM,
    transformers.GraniteSWAConfig: transformers.GraniteSWAForCausalLM,
    transformers.GraniteMoeSWAConfig: transformers.GraniteMoeSWAForCausalLM,
    transformers.Cohere2MoeConfig: transformers.Cohere2MoeForCausalLM,
    transformers.JambaConfig: transformers.JambaForCausalLM,
    transformers.MambaConfig: transformers.MambaForCausalLM,
    transformers.FalconMambaConfig: transformers.FalconMambaForCausalLM,
    transformers.Mamba2Config: transformers.Mamba2ForCausalLM,
    transformers.MiMoV2FlashConfig: transformers.MiMoV2FlashForCausalLM,
    transformers.Lfm3Config: transformers.Lfm3ForCausalLM,
    transformers.HYV3Config: transformers.HYV3ForCausalLM,
    transformers.Dots1Config: transformers.Dots1ForCausalLM,
    transformers.SarvamMoEConfig: transformers.Glm4MoeForCausalLM,
    transformers.SarvamMLAConfig: transformers.DeepseekV3ForCausalLM,
    transformers.Glm4Config: transformers.Glm4ForCausalLM,
    transformers.GlmConfig: transformers.GlmForCausalLM,
    transformers.SeedOssConfig: transformers.SeedOssForCausalLM,
    transformers.Ernie4_5Config: transformers.Ernie4_5ForCausalLM,
    transformers.Exaone4Config: transformers.Exaone4ForCausalLM,
    transformers.CohereConfig: transformers.CohereForCausalLM,
    transformers.Cohere2Config: transformers.Cohere2ForCausalLM,
    transformers.Ernie4_5_MoeConfig: transformers.Ernie4_5_MoeForCausalLM,
    transformers.MiniMaxM2Config: transformers.MiniMaxM2ForCausalLM,
    transformers.MiniMaxM3VLTextConfig: transformers.MiniMaxM3VLForCausalLM,
    transformers.BeamConfig: transformers.BeamForCausalLM,
    transformers.JetMoeConfig: transformers.JetMoeForCausalLM,
    transformers.PersimmonConfig: transformers.PersimmonForCausalLM,
    transformers.XGLMConfig: transformers.XGLMForCausalLM,
    transformers.BioGptConfig: transformers.BioGptForCausalLM,
    transformers.BloomConfig: transformers.BloomForCausalLM,
    transformers.MptConfig: transformers.MptForCausalLM,
    transformers.OpenAIGPTConfig: transformers.OpenAIGPTLMHeadModel,
    transformers.DoryConfig: transformers.DoryForCausalLM,
    transformers.Zamba2Config: transformers.Zamba2ForCausalLM,
    transformers.ZambaConfig: transformers.ZambaForCausalLM,
    transformers.RecurrentGemmaConfig: transformers.RecurrentGemmaForCausalLM,
    transformers.ErgoConfig: transformers.ErgoForCausalLM,
    transformers.Glm4MoeLiteConfig: transformers.Glm4MoeLiteForCausalLM,
    transformers.Qwen3_5TextConfig: transformers.Qwen3_5ForCausalLM,
    transformers.Qwen3NextConfig: transformers.Qwen3NextForCausalLM,
    transformers.Qwen3_5MoeTextConfig: transformers.Qwen3_5MoeForCausalLM,
    transformers.Qwen4ExpTextConfig: transformers.Qwen4ExpForCausalLM,
    transformers.Kolibri1_1Config: transformers.Kolibri1_1ForCausalLM,
    transformers.xLSTMConfig: transformers.xLSTMForCausalLM,
    transformers.DiffLlamaConfig: transformers.DiffLlamaForCausalLM,
    transformers.RwkvConfig: transformers.RwkvForCausalLM,
    transformers.Gemma4TextConfig: transformers.Gemma4ForCausalLM,
    transformers.Gemma4UnifiedTextConfig: transformers.Gemma4UnifiedForCausalLM,
    transformers.Gemma3nTextConfig: transformers.Gemma3nForCausalLM,
    transformers.Llama4TextConfig: transformers.Llama4ForCausalLM,
    transformers.Lfm2Config: transformers.Lfm2ForCausalLM,
    transformers.Lfm2MoeConfig: transformers.Lfm2MoeForCausalLM,
    transformers.GraniteMoeHybridConfig: transformers.GraniteMoeHybridForCausalLM,
    transformers.BambaConfig: transformers.BambaForCausalLM,
    transformers.GraniteMoeConfig: transformers.GraniteMoeForCausalLM,
    transformers.GraniteMoeSharedConfig: transformers.GraniteMoeSharedForCausalLM,
    transformers.NemotronHConfig: transformers.NemotronHForCausalLM,
    transformers.FalconH1Config: transformers.FalconH1ForCausalLM,
    transformers.GPTNeoXConfig: transformers.GPTNeoXForCausalLM,
    transformers.FalconConfig: transformers.FalconForCausalLM,
    transformers.GPT2Config: transformers.GPT2LMHeadModel,
    transformers.GPTJConfig: transformers.GPTJForCausalLM,
    transformers.GPTBigCodeConfig: transformers.GPTBigCodeForCausalLM,
    transformers.PhiConfig: transformers.PhiForCausalLM,
    transformers.StableLmConfig: transformers.StableLmForCausalLM,
    transformers.Starcoder2Config: transformers.Starcoder2ForCausalLM,
    transformers.NemotronConfig: transformers.NemotronForCausalLM,
    transformers.OlmoConfig: transformers.OlmoForCausalLM,
    transformers.ExaoneConfig: transformers.LlamaForCausalLM,
}


def build_pair(family: str) -> tuple[transformers.PreTrainedModel, CausalLM]:
    """A tiny random Hugging Face model and our model loaded from its state dict."""
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    hf_config = config_cls(**{**SMALL, **extra})
    hf = MODEL_CLASSES[config_cls](hf_config).eval()
    unclamped_time_step(hf)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0; perturb them so they are tested
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith(("bias", "router.scale", "per_expert_scale", "correct_output_scale")):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(("mlp.gate.weight", "mlp.gate.wg.weight", "mlp.router.weight", "sinks",
                                "mlp.gate.linear.weight", "residual_gate.weight",
                                "mlp.router.classifier.weight",
                                "router.proj.weight", "feed_forward.router.weight", "feed_forward.gate.weight",
                                "block_sparse_moe.router.weight", "mixer.gate.weight", "mlp.router.gate.weight",
                                "ffn.router.layer.weight", "altup.modality_router.weight",
                                "altup.prediction_coefs.weight", "altup.correction_coefs.weight")):
                # routers far from uniform (no near-ties between experts); sinks of the scores' size
                param.normal_(0.0, 1.0)
            elif name.endswith("position_bias"):  # DeepSeek-V4's compressors' (zeros at init)
                param.normal_(0.0, 1.0)
            elif name.endswith(("ple.conv1d.weight", "mlstm_layer.q.weight", "mlstm_layer.k.weight")):
                # Qwen4-Exp's n-gram convolution (zeros at init); xLSTM's q and k (its memories' reads past the floor)
                param.normal_(0.0, 0.5)
            elif name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):  # Apertus's xIELU, one value per layer
                param.add_(torch.randn_like(param) * 0.5)
            elif name.endswith(NGPT_SCALES):  # Dory's learned scales (constants at init): one per channel each,
                # of either sign (its rates' absolute values are taken)
                signs = torch.where(torch.rand_like(param) < 0.3, -1.0, 1.0)
                param.mul_(torch.empty_like(param).uniform_(0.5, 1.5) * signs)
                if name.endswith("logit_scale"):  # logits of a trained model's size (unit states give ~0.05)
                    param.mul_(50.0)
            elif name.endswith(HYPER_CONNECTION_MAPS):  # HY-V4's: weights that vary from token to token
                param.normal_(0.0, 0.1) if param.dim() > 1 else param.uniform_(0.5, 1.5)
        for name, buffer in hf.named_buffers():  # DeepSeek-V3's load-balancing bias, of the sigmoid scores' size
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                buffer.uniform_(-0.3, 0.3)
            elif name.endswith("tid2eid"):  # DeepSeek-V4's experts by token id (zeros at init): distinct, drawn
                rows = [torch.randperm(hf_config.n_routed_experts)[: buffer.shape[1]] for _ in range(buffer.shape[0])]
                buffer.copy_(torch.stack(rows))
            elif name.endswith("layer_scalar"):  # Gemma 4's scale of each layer's output (1 at init)
                buffer.uniform_(0.5, 1.5)
            elif name.endswith("act_fn.beta"):  # xIELU's slope at 0 (0.5 at init)
                buffer.uniform_(0.3, 0.7)
    config = model_config_from_hf(hf_config.to_dict())
    ours = get_model_class(config.architecture)(config)
    ours.load_weights(hf.state_dict().items())
    return hf, ours.eval()


@dataclass
class PagedRunner:
    """Drives our model like the engine would: block tables from a shuffled pool, one flattened batch a step."""

    model: CausalLM
    num_blocks: int = 64
    computed: dict[int, int] = field(default_factory=dict)  # tokens of each sequence already in the cache
    tables: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kv_caches = allocate_kv_cache(
            self.model.config, self.num_blocks, BLOCK_SIZE, torch.float32, "cpu", state_slots=MAX_SEQUENCES
        )
        self.free = list(range(1, self.num_blocks))  # block 0 left unused so padding never aliases real data
        random.Random(0).shuffle(self.free)

    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Feed each `(seq_id, new_tokens)` and return the logits of every new token, `[T, vocab]`."""
        ids, positions, q_lens, s_lens, tables = [], [], [], [], []
        for seq, tokens in chunks:
            start = self.computed.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            ids += tokens
            positions += list(range(start, end))
            q_lens.append(len(tokens))
            s_lens.append(end)
            tables.append(list(table))
            self.computed[seq] = end
        meta = AttentionMetadata.build(q_lens, s_lens, tables, BLOCK_SIZE, "cpu")
        meta.state_slots_cpu = [seq for seq, _ in chunks]  # linear attention's: sequence i's state is in slot i
        meta.state_slots = torch.tensor(meta.state_slots_cpu)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)
            return self.model.compute_logits(hidden)


def hf_logits(hf: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """transformers' logits `[T, vocab]`; a head pruned to fewer rows than the vocabulary (Apertus 1.5's) padded with
    -inf for the others, as the engine gives them."""
    with torch.inference_mode():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    missing = hf.config.vocab_size - logits.shape[-1]
    if not missing:
        return logits
    return torch.cat((logits, logits.new_full((logits.shape[0], missing), float("-inf"))), dim=-1)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request: pytest.FixtureRequest) -> tuple[transformers.PreTrainedModel, CausalLM]:
    return build_pair(request.param)


def test_mixed_prefill_batch_matches_hf(pair: tuple[transformers.PreTrainedModel, CausalLM]) -> None:
    hf, ours = pair
    seqs = {0: random_tokens(5, 1), 1: random_tokens(11, 2), 2: random_tokens(1, 3), 3: random_tokens(8, 4)}
    logits = PagedRunner(ours).step(list(seqs.items()))
    expected = torch.cat([hf_logits(hf, tokens) for tokens in seqs.values()])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_mixed_decode_match_hf(pair: tuple[transformers.PreTrainedModel, CausalLM]) -> None:
    hf, ours = pair
    runner = PagedRunner(ours)
    a, b, c = random_tokens(17, 5), random_tokens(9, 6), random_tokens(6, 7)
    # Step 1: the first chunk of A; step 2: the rest of A (after cached context) next to all of B.
    runner.step([(0, a[:6])])
    out = runner.step([(1, b), (0, a[6:13])])
    torch.testing.assert_close(out[9:], hf_logits(hf, a[:13])[6:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[:9], hf_logits(hf, b), atol=1e-4, rtol=1e-4)
    # Decode steps for B and A (one token each), with C's prompt arriving in the middle of them.
    b_next = random_tokens(4, 13)
    for i in range(4):
        chunks = [(0, [a[13 + i]]), (1, [b_next[i]])]
        if i == 1:
            chunks.insert(1, (2, c))
        out = runner.step(chunks)
        torch.testing.assert_close(out[0], hf_logits(hf, a[: 14 + i])[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[-1], hf_logits(hf, b + b_next[: i + 1])[-1], atol=1e-4, rtol=1e-4)
        if i == 1:
            torch.testing.assert_close(out[1:-1], hf_logits(hf, c), atol=1e-4, rtol=1e-4)


def test_shared_prefix_block_written_in_the_same_step(pair: tuple[transformers.PreTrainedModel, CausalLM]) -> None:
    hf, ours = pair
    runner = PagedRunner(ours)
    prefix = random_tokens(BLOCK_SIZE, 8)
    x, y = prefix + random_tokens(3, 9), prefix + random_tokens(6, 10)
    runner.tables[1] = [runner.free.pop()]
    runner.tables[2] = list(runner.tables[1])  # both sequences map their first block to the same id
    out = runner.step([(1, x), (2, y)])
    torch.testing.assert_close(out[: len(x)], hf_logits(hf, x), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[len(x) :], hf_logits(hf, y), atol=1e-4, rtol=1e-4)
    # Y's decode reads the shared block back after X's and Y's writes of it.
    out = runner.step([(2, [5])])
    torch.testing.assert_close(out[0], hf_logits(hf, [*y, 5])[-1], atol=1e-4, rtol=1e-4)


def test_greedy_generation_matches_hf_generate(pair: tuple[transformers.PreTrainedModel, CausalLM]) -> None:
    hf, ours = pair
    prompts = [random_tokens(7, 11), random_tokens(3, 12)]
    runner = PagedRunner(ours)
    logits = runner.step(list(enumerate(prompts)))
    last = torch.tensor([len(prompts[0]) - 1, len(logits) - 1])
    generated: list[list[int]] = [[], []]
    eos = hf.generation_config.eos_token_id  # min_new_tokens below keeps generate from choosing it: nor do we
    eos_ids = [i for i in ([eos] if isinstance(eos, int) else eos or []) if i < logits.shape[-1]]
    banned = torch.tensor(eos_ids, dtype=torch.long)
    for _ in range(20):
        next_tokens = logits[last].index_fill(-1, banned, -torch.inf).argmax(-1).tolist()
        for seq, token in enumerate(next_tokens):
            generated[seq].append(token)
        logits = runner.step([(seq, [token]) for seq, token in enumerate(next_tokens)])
        last = torch.tensor([0, 1])
    for prompt, ours_out in zip(prompts, generated, strict=True):
        with torch.inference_mode():
            ids = hf.generate(  # type: ignore[operator]
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=20,
                min_new_tokens=20,
                do_sample=False,
                pad_token_id=0,
            )
        assert ours_out == ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["bloom-5", "mpt-6", "falcon-rw"])
def test_alibi_biases_match_transformers_far_into_a_sequence(family: str) -> None:
    """ALiBi's biases grow with distance: over 240 tokens the logits still equal transformers' (MPT's interleaved
    slopes; Falcon-RW's bias rounded to bfloat16 as its modeling code rounds it, which moves logits ~3e-3 there)."""
    hf, ours = build_pair(family)
    tokens = random_tokens(240, 3)
    got = PagedRunner(ours, num_blocks=128).step([(0, tokens)])
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_qwen4_exp_n_gram_contexts_end_at_end_of_sequence_tokens_and_qsa_keeps_its_blocks_far_in() -> None:
    """Qwen4-Exp (`QWEN4_EXP`) on a 60-token sequence with end-of-sequence tokens (2) inside it, one right after
    another too: each token's n-grams read EOS for every position at or before the last EOS before it, also across
    a chunk boundary (its context carried in the state), and its QSA layer keeps 2 of up to 30 complete blocks."""
    hf, ours = build_pair("qwen4-exp")
    tokens = random_tokens(60, 21)
    for at in (5, 17, 18, 30, 44):
        tokens[at] = 2
    whole = hf_logits(hf, tokens)
    torch.testing.assert_close(PagedRunner(ours).step([(0, tokens)]), whole, atol=1e-4, rtol=1e-4)
    runner = PagedRunner(ours)
    pieces = [runner.step([(1, tokens[start:end])]) for start, end in ((0, 18), (18, 19), (19, 31), (31, 60))]
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-4, rtol=1e-4)


def test_kolibri1_1_indexed_layers_choose_far_into_a_sequence_and_across_chunks() -> None:
    """Kolibri-1.1 (`kolibri1.1` above) on a 60-token sequence: its pool layers choose 4 of up to 30 blocks, each
    indexed layer 3 of its pool's keys beside the sink and the last 2, prefilled whole and in chunks (a chunk's queries
    choosing among keys earlier chunks wrote, the reading layers over the writing layer's cache)."""
    hf, ours = build_pair("kolibri1.1")
    tokens = random_tokens(60, 22)
    whole = hf_logits(hf, tokens)
    torch.testing.assert_close(PagedRunner(ours).step([(0, tokens)]), whole, atol=1e-4, rtol=1e-4)
    runner = PagedRunner(ours)
    pieces = [runner.step([(1, tokens[start:end])]) for start, end in ((0, 7), (7, 8), (8, 33), (33, 60))]
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-4, rtol=1e-4)


def test_kolibri1_1_configs_read_as_transformers_fills_them_in() -> None:
    """Kolibri 1.1's defaults as transformers fills them in and from a config that names none of them: every fifth
    layer indexed (no rope, no window), pools picked by its 1st, 3rd, 4th and 6th, K/V read as its default layout
    says, the first two MLPs dense and 3,584 wide, the rest 384 experts."""
    released = {"model_type": "kolibri1_1", "num_hidden_layers": 50, "hidden_size": 2560, "num_attention_heads": 48,
                "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 128000, "num_local_experts": 384,
                "num_experts_per_tok": 6, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                "sliding_window": 513}  # fmt: skip
    for cfg in (transformers.Kolibri1_1Config().to_dict(), released):
        config = model_config_from_hf(cfg)
        spec = config.kolibri_index
        assert spec is not None and config.architecture == "glm4_moe"
        indexed = tuple(range(4, 50, 5))
        assert spec.layers == indexed and spec.pool_layers == (4, 14, 19, 29)
        assert [config.kv_source(i) for i in indexed] == [4, 4, 4, 19, 24, 29, 29, 29, 29, 4]
        assert config.kv_source(3) == 3 and config.attention_layers == 40 + 4
        assert [config.attention_window(i) for i in (3, 4)] == [513, 0] and not config.uses_rope(4)
        assert config.uses_rope(3) and config.dense_layers == (0, 1) and config.layer_intermediate_size(0) == 3584
        assert (spec.topk, spec.pool_size, spec.compression, spec.heads, spec.local, spec.sinks) == (
            2048, 16384, 16, 12, 128, 8)


def test_rwkv_4_pile_config_reads_as_released() -> None:
    """RWKV-4 169M Pile's config (RWKV/rwkv-4-169m-pile): 12 blocks 768 wide, WKV over every channel, a channel mix
    3,072 wide, the hidden state halved every 6 blocks, 1,024 positions, its own head."""
    released = {"model_type": "rwkv", "vocab_size": 50277, "context_length": 1024, "hidden_size": 768,
                "num_hidden_layers": 12, "attention_hidden_size": 768, "intermediate_size": 3072,
                "layer_norm_epsilon": 1e-5, "bos_token_id": 0, "eos_token_id": 0, "rescale_every": 6,
                "tie_word_embeddings": False}  # fmt: skip
    config = model_config_from_hf(released)
    assert config.architecture == "rwkv" and config.rwkv is not None and config.attention_layers == 0
    assert (config.rwkv.attention_hidden, config.rwkv.rescale_every, config.intermediate_size) == (768, 6, 3072)
    assert config.max_position_embeddings == 1024 and not config.tie_word_embeddings
    assert config.rwkv.state_size == 2 * 768 + 3 * 768 and config.recurrent is config.rwkv


def test_zamba_7b_config_reads_as_transformers_fills_it_in() -> None:
    """transformers' Zamba defaults (Zamba 7B's shape): 76 Mamba-1 layers of 2 heads (7,424 channels, a time-step
    rank of 232), one shared block before 13 of them (heads 464 wide, no rope), unrolled to 89 layers, its MLP 14,848
    wide."""
    config = model_config_from_hf(transformers.ZambaConfig().to_dict())
    mamba, shared = config.mamba1, config.shared_blocks
    assert config.architecture == "zamba2" and mamba is not None and shared is not None
    assert (mamba.heads, mamba.inner, mamba.dt_rank, mamba.state_dim, mamba.inner_norms) == (2, 7424, 232, 16, "none")
    assert (shared.blocks, len(shared.hybrid_layers), shared.adapter_rank) == (1, 13, 0)
    assert config.num_hidden_layers == 89 and config.head_dim == 464 and not config.uses_rope(0)
    assert config.intermediate_size == 14848 and mamba.sharded(2).heads == 1


def test_xlstm_fused_checkpoints_split_into_their_parts() -> None:
    """A `weight_mode` fused xLSTM checkpoint (q, k, v and the output gate in `qkv_opreact`, the input and forget
    gates in `ifgate_preact`, the MLP's gate and up in `proj_up_gate_z`; transformers' own fused model does not build
    here: its init slices the gates' bias wrong) is `xlstm`'s single model's weights joined: it serves the same
    logits."""
    hf, _ = build_pair("xlstm")
    joined = {".mlstm_layer.qkv_opreact.": ("q", "k", "v", "ogate_preact"),
              ".mlstm_layer.ifgate_preact.": ("igate_preact", "fgate_preact"),
              ".ffn.proj_up_gate_z.": ("proj_up_gate", "proj_up")}  # fmt: skip
    state = dict(hf.state_dict())
    fused: dict[str, torch.Tensor] = {}
    for name in list(state):
        for target, parts in joined.items():
            prefix = ".mlstm_layer." if "mlstm" in target else ".ffn."
            head, _, kind = name.rpartition(".")
            if head.endswith(prefix + parts[0]):
                base = head.removesuffix(prefix + parts[0])
                pieces = [state.pop(f"{base}{prefix}{part}.{kind}") for part in parts]
                fused[f"{base}{target}{kind}"] = torch.cat(pieces)
    config = model_config_from_hf({**hf.config.to_dict(), "weight_mode": "fused"})
    ours = get_model_class(config.architecture)(config)
    ours.load_weights([*state.items(), *fused.items()])
    tokens = random_tokens(20, 5)
    torch.testing.assert_close(PagedRunner(ours.eval()).step([(0, tokens)]), hf_logits(hf, tokens), atol=1e-4,
                               rtol=1e-4)  # fmt: skip
    assert len(fused) == 2 * 4  # each of the 2 blocks: the three fused weights and the gates' bias


def test_xlstm_7b_config_reads_as_transformers_fills_it_in() -> None:
    """transformers' xLSTM defaults (xLSTM 7B's shape): 32 blocks of 8 heads, q/k 256 wide a head and v 512, gates
    capped at 15, an MLP 10,944 wide (4096 x 2.667 rounded up to 64), logits capped at 30, every layer a state."""
    config = model_config_from_hf(transformers.xLSTMConfig(vocab_size=50304).to_dict())
    spec = config.mlstm
    assert spec is not None and config.architecture == "xlstm" and config.num_hidden_layers == 32
    assert (spec.heads, spec.qk_head_dim, spec.v_head_dim, spec.gate_soft_cap) == (8, 256, 512, 15.0)
    assert config.intermediate_size == 10944 and config.final_logit_softcap == 30.0 and config.attention_layers == 0
    assert config.recurrent is spec and spec.state_size == 8 * (256 * 512 + 256 + 1) and spec.sharded(2).heads == 4


def test_qwen4_exp_configs_read_as_transformers_fills_them_in() -> None:
    """transformers' defaults (every fourth layer QSA, no n-gram layers, 4 streams of rank 320) with rope over a
    quarter of each head (its index heads must hold rope's dims), and a config with n-gram layers (one-based ids;
    their convolution's 9 rows of the streams and 2 token ids grow every linear layer's state)."""
    plain = model_config_from_hf(transformers.Qwen4ExpTextConfig(
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048,
        indexer_compress_ratio=64, rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.25},
    ).to_dict())  # fmt: skip
    spec, linear = plain.qwen4_exp, plain.linear_attention
    assert spec is not None and linear is not None and plain.architecture == "qwen4_exp"
    assert spec.qsa_layers == tuple(range(3, 40, 4)) and spec.ngram_layers == ()
    assert (spec.streams, spec.rank) == (4, 320)
    assert plain.rotary_dim == 64 and linear.extra_state == 0 and spec.dense_positions == 2048 + 63
    assert plain.layer_index_heads(3) == 1 and plain.layer_index_heads(2) == 0
    grams = model_config_from_hf({**SMALL, **QWEN4_EXP, "model_type": "qwen4_exp_text"})
    assert grams.qwen4_exp is not None and grams.linear_attention is not None
    assert grams.qwen4_exp.ngram_layers == (0,) and grams.linear_attention.extra_state == 9 * 4 * 64 + 2
    assert grams.linear_attention.state_size == grams.linear_attention.own_state_size + 9 * 4 * 64 + 2


def test_registry_and_cache_size() -> None:
    config = model_config_from_hf(transformers.LlamaConfig(**SMALL).to_dict())
    assert get_model_class("llama").__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="unsupported"):
        get_model_class("gpt2")
    caches = allocate_kv_cache(config, num_blocks=3, block_size=BLOCK_SIZE, dtype=torch.float32, device="cpu")
    assert len(caches) == 2 and caches[0].shape == (2, 3, BLOCK_SIZE, 2, 16)
    assert kv_cache_bytes_per_block(config, BLOCK_SIZE, torch.float32) == 2 * caches[0][:, 0].numel() * 4


def test_load_weights_rejects_missing_unknown_and_misshaped() -> None:
    hf, _ = build_pair("qwen2")
    config = model_config_from_hf(hf.config.to_dict())
    state = dict(hf.state_dict())
    model = get_model_class(config.architecture)(config)
    with pytest.raises(ValueError, match="missing"):
        model.load_weights((k, v) for k, v in state.items() if "k_proj.bias" not in k)
    with pytest.raises(ValueError, match="unexpected"):
        model.load_weights([*state.items(), ("model.layers.0.mystery.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


class _Unreadable:
    """A checkpoint tensor that may be looked at (shape, dim) but fails the test when read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape = tensor.shape

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        raise AssertionError("a replaced layer's weight was read")


def test_replaced_layers_weights_are_not_read_and_their_biases_load() -> None:
    """What a GGUF engine loads: the layers its quantized blocks replace (here the fused QKV, stored as three
    tensors with biases, and an MLP projection) keep their weights unread; everything else loads as always."""
    hf, _ = build_pair("qwen2")
    config = model_config_from_hf(hf.config.to_dict())
    replaced = {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj"}
    state = dict(hf.state_dict())
    unread = {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"} | {"model.layers.1.mlp.down_proj.weight"}
    model = get_model_class(config.architecture)(config)
    model.load_weights(((k, _Unreadable(v) if k in unread else v) for k, v in state.items()), replaced=replaced)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert torch.equal(qkv.bias, torch.cat([state[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"]))
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, state["model.layers.0.mlp.down_proj.weight"])
    with pytest.raises(AssertionError, match="was read"):  # a layer not replaced reads its weight
        get_model_class(config.architecture)(config).load_weights(
            (k, _Unreadable(v) if k in unread else v) for k, v in state.items()
        )


def test_a_mixture_of_experts_missing_an_expert_projection_is_refused() -> None:
    hf, _ = build_pair("mixtral")
    config = model_config_from_hf(hf.config.to_dict())
    state = {k: v for k, v in hf.state_dict().items() if k != "model.layers.1.mlp.experts.down_proj"}
    with pytest.raises(ValueError, match=r"missing 4 weights, e.g. \['model.layers.1.mlp.experts\[0.down\]"):
        get_model_class(config.architecture)(config).load_weights(state.items())
    # One expert's tensor as checkpoints store it, of the wrong shape, is named in the error.
    bad = {**state, "model.layers.1.block_sparse_moe.experts.3.w2.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=r"experts.3.down_proj.weight.*expert 3 down"):
        get_model_class(config.architecture)(config).load_weights(bad.items())


# DBRX Instruct's config.json as released (its nested parts as Databricks wrote them).
DBRX_INSTRUCT = {
    "model_type": "dbrx", "architectures": ["DbrxForCausalLM"], "d_model": 6144, "n_heads": 48, "n_layers": 40,
    "max_seq_len": 32768, "vocab_size": 100352, "emb_pdrop": 0.0, "resid_pdrop": 0.0, "tie_word_embeddings": False,
    "attn_config": {"clip_qkv": 8, "kv_n_heads": 8, "model_type": "", "rope_theta": 500000},
    "ffn_config": {"ffn_hidden_size": 10752, "model_type": "", "moe_jitter_eps": 0.01, "moe_loss_weight": 0.05,
                   "moe_num_experts": 16, "moe_top_k": 4},
    "eos_token_id": 100257, "pad_token_id": 100277, "initializer_range": 0.02, "output_router_logits": False,
}  # fmt: skip


def test_opt_reads_its_first_checkpoints_names_and_refuses_what_it_does_not_build() -> None:
    """An OPT checkpoint under its first names (`decoder.*`, without `model.`, as facebook/opt-* were saved) loads as
    the same model; a pre-LN model without its final norm and LayerNorms without weights are refused by name."""
    hf, ours = build_pair("opt")
    config = model_config_from_hf(hf.config.to_dict())
    first = get_model_class(config.architecture)(config)
    first.load_weights((name.removeprefix("model."), tensor) for name, tensor in hf.state_dict().items())
    for theirs, mine in zip(first.state_dict().values(), ours.state_dict().values(), strict=True):
        assert torch.equal(theirs, mine)
    base = hf.config.to_dict()
    for bad, message in (
        ({"_remove_final_layer_norm": True}, "opt without its final LayerNorm"),
        ({"layer_norm_elementwise_affine": False}, "opt without its final LayerNorm, or with LayerNorms without"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            model_config_from_hf({**base, **bad})


def test_opt_350m_and_gpt1_configs_read_as_released() -> None:
    """OPT-350M's released config: post-LN blocks (`do_layer_norm_before` false), embeddings 512 wide projected in
    and out of its 1,024; GPT-1's (openai-community/openai-gpt): post-LN blocks, 512 learned positions, its "gelu"
    transformers' tanh form, an MLP 4 x 768, Conv1D weights."""
    opt_350m = {"model_type": "opt", "activation_function": "relu", "do_layer_norm_before": False, "ffn_dim": 4096,
                "hidden_size": 1024, "max_position_embeddings": 2048, "num_attention_heads": 16,
                "num_hidden_layers": 24, "vocab_size": 50272, "word_embed_proj_dim": 512, "pad_token_id": 1,
                "bos_token_id": 2, "eos_token_id": 2}  # fmt: skip
    config = model_config_from_hf(opt_350m)
    assert (config.post_layer_norm, config.embedding_size, config.hidden_size, config.intermediate_size) == (
        True, 512, 1024, 4096)
    assert (config.absolute_positions, config.tie_word_embeddings, config.hidden_act) == (True, True, "relu")
    gpt1 = {"model_type": "openai-gpt", "afn": "gelu", "layer_norm_epsilon": 1e-05, "n_ctx": 512, "n_embd": 768,
            "n_head": 12, "n_layer": 12, "n_positions": 512, "n_special": 0, "vocab_size": 40478}  # fmt: skip
    config = model_config_from_hf(gpt1)
    shape = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers,
             config.intermediate_size, config.max_position_embeddings)  # fmt: skip
    assert shape == (768, 12, 12, 12, 3072, 512)
    assert (config.post_layer_norm, config.transposed_weights, config.hidden_act, config.embedding_size) == (
        True, True, "gelu_tanh", 0)


def test_gpt_neo_125m_config_reads_as_released() -> None:
    """GPT-Neo 125M's released config (its layers' kinds as `attention_types` alone, no MLP width): global and local
    layers in turn, a 256-position window on the local ones, the MLP 4 x hidden, unscaled scores, biases on out_proj
    and the MLP only, learned positions, tied embeddings; another kind, or too few, refused by name."""
    released = {
        "model_type": "gpt_neo", "architectures": ["GPTNeoForCausalLM"], "hidden_size": 768, "num_layers": 12,
        "num_heads": 12, "attention_types": [[["global", "local"], 6]], "window_size": 256,
        "max_position_embeddings": 2048, "vocab_size": 50257, "activation_function": "gelu_new",
        "intermediate_size": None, "layer_norm_epsilon": 1e-5, "bos_token_id": 50256, "eos_token_id": 50256,
    }  # fmt: skip
    config = model_config_from_hf(released)
    assert [config.attention_window(i) for i in range(12)] == [0, 256] * 6
    assert (config.intermediate_size, config.attention_scale, config.attention_bias, config.o_proj_bias) == (
        3072, 1.0, False, True)  # fmt: skip
    assert config.absolute_positions and config.tie_word_embeddings and config.mlp_bias and not config.gated_mlp
    assert config.hidden_act == "gelu_tanh" and config.max_position_embeddings == 2048
    for bad in ([[["global", "sparse"], 6]], [[["global", "local"], 5]]):
        with pytest.raises(ValueError, match="gpt_neo attention_layers must name global or local for each of the 12"):
            model_config_from_hf({**released, "attention_types": bad})


def test_gemma4_unified_configs_read_as_transformers_builds_them() -> None:
    """Gemma 4 Unified's multimodal config at transformers' defaults (Gemma 4 12B's text model): 30 layers 2,304 wide,
    every sixth full with heads 512 wide, the others windowed over 1,024 positions, no per-layer inputs, experts or
    shared K/V, its image tokens' bidirectional attention ("vision") leaving text causal; "all" refused by name."""
    config = model_config_from_hf(transformers.Gemma4UnifiedConfig().to_dict())
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("gemma4", 30, 2304)
    assert config.gemma4 is not None and config.gemma4.per_layer_input_size == 0 and config.gemma4.experts == 0
    assert [config.layer_head_dim(i) for i in range(6)] == [256] * 5 + [512]
    assert [config.attention_window(i) for i in range(6)] == [1024] * 5 + [0]
    assert all(config.kv_source(i) == i for i in range(30)) and config.tie_word_embeddings
    text = transformers.Gemma4UnifiedTextConfig().to_dict()
    with pytest.raises(ValueError, match="use_bidirectional_attention 'all' is not supported"):
        model_config_from_hf({**text, "use_bidirectional_attention": "all"})


def test_gemma3n_configs_and_its_multimodal_checkpoint_read_as_transformers_builds_them() -> None:
    """A multimodal Gemma 3n config with its text model at transformers' defaults (E4B's shape): 35 layers, every
    fifth full and the others windowed over 512 positions, the last 15 over the last earlier layer of their kind's
    K/V (transformers' `kv_sharing_modes`), the first ten MLPs sparse at 0.95, per-layer inputs 256 wide from
    262,144 rows, rope bases 1,000,000 and 10,000, logits capped at 30, tied embeddings. Its checkpoint's text model
    (`model.language_model.`) loads as the text model's own weights, its towers and embedders not read. Refused by
    name: MLP widths that differ between layers, another active stream than the first."""
    text = transformers.Gemma3nTextConfig()
    config = model_config_from_hf(transformers.Gemma3nConfig(text_config=text.to_dict()).to_dict())
    assert (config.architecture, config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        "gemma3n", 35, 2048, 16384)  # fmt: skip
    assert config.altup is not None and config.altup.sparsity == (0.95,) * 10 + (0.0,) * 25
    assert (config.altup.streams, config.altup.laurel_rank, config.altup.correct_scale) == (4, 64, True)
    assert config.gemma4 is not None and (config.gemma4.per_layer_input_size, config.gemma4.per_layer_vocab_size) == (
        256, 262_144)  # fmt: skip
    modes = text.kv_sharing_modes
    producers = {text.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    assert [config.kv_source(i) for i in range(35)] == [
        producers[text.layer_types[i]] if mode == "reuse" else i for i, mode in enumerate(modes)]  # fmt: skip
    assert [config.attention_window(i) for i in range(35)] == [
        512 if kind == "sliding_attention" else 0 for kind in text.layer_types]  # fmt: skip
    assert (config.rope_theta, config.local_rope_theta, config.final_logit_softcap) == (1e6, 1e4, 30.0)
    assert config.tie_word_embeddings and config.attention_scale == 1.0
    hf, ours = build_pair("gemma3n")
    towers = {"model.vision_tower.timm_model.conv_stem.weight": torch.zeros(2), "model.embed_vision.embedding.weight":
              torch.zeros(2), "model.audio_tower.subsample.weight": torch.zeros(2),
              "model.embed_audio.embedding.weight": torch.zeros(2)}  # fmt: skip
    multimodal = {name.replace("model.", "model.language_model.", 1): t for name, t in hf.state_dict().items()}
    loaded = get_model_class("gemma3n")(ours.config)
    loaded.load_weights({**multimodal, **towers}.items())
    for (name, theirs), mine in zip(loaded.state_dict().items(), ours.state_dict().values(), strict=True):
        assert torch.equal(theirs, mine), name
    base = text.to_dict()
    for bad, message in (({"intermediate_size": [16384] * 34 + [8192]}, "gemma3n intermediate_size"),
                         ({"altup_active_idx": 1}, "gemma3n altup_active_idx 1 is not supported")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(message)):
            model_config_from_hf({**base, **bad})


def test_axk2_configs_read_as_transformers_fills_them_in() -> None:
    """An A.X K2 config with its MLP layers in the legacy keys (`first_k_dense_replace`, `moe_layer_freq`) and no
    expert groups (A.X K2 Light's) reads as transformers builds the model: the dense layers it derives, every layer
    indexed (DeepSeek-V3.2's indexer), one group of experts, the gate's rank, the queries from the latent pair; a
    grouped router where `n_group` is set; no query latent refused by name."""
    released = {**SMALL, **AXK2_SMALL, "model_type": "axk2", "num_hidden_layers": 6, "first_k_dense_replace": 2,
                "moe_layer_freq": 2}  # fmt: skip
    del released["mlp_layer_types"]
    theirs = transformers.AXK2Config.from_dict(released)
    for raw in (released, theirs.to_dict()):
        ours = model_config_from_hf(raw)
        assert [ours.is_moe_layer(i) for i in range(6)] == [kind == "sparse" for kind in theirs.mlp_layer_types]
        assert ours.sparse_indexer is not None and ours.sparse_indexer.shared_layers == ()
        assert ours.latent_attention is not None and ours.latent_attention.query_latent_pair
        assert ours.latent_attention.value_gate and ours.gated_norm_rank == 8 and ours.moe_groups == 1
    grouped = model_config_from_hf({**released, "n_group": 4, "topk_group": 2})
    assert (grouped.moe_groups, grouped.moe_topk_groups) == (4, 2)
    with pytest.raises(ValueError, match="axk2 needs a positive q_lora_rank"):
        model_config_from_hf({**released, "q_lora_rank": 0})


def test_dbrx_instruct_config_reads_as_released() -> None:
    """DBRX Instruct's released config: its shape from DBRX's own names and nested parts, 16 experts 10,752 wide of
    which the top 4 are renormalised (`moe_normalize_expert_weights` absent: 1), q/k/v clamped to 8, LayerNorms,
    `attn_config`'s rope base (500,000) over the default `rope_parameters` that transformers 5 writes back beside it;
    what the layers do not build is refused by name."""
    config = model_config_from_hf(DBRX_INSTRUCT)
    shape = (config.architecture, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
             config.head_dim, config.num_hidden_layers, config.max_position_embeddings)  # fmt: skip
    assert shape == ("dbrx", 6144, 48, 8, 128, 40, 32768)
    experts = (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.norm_topk_prob)
    assert experts == (16, 4, 10752, True)
    assert (config.clip_qkv, config.layer_norm, config.rms_norm_eps, config.rope_theta) == (8.0, True, 1e-5, 500000.0)
    assert (config.tie_word_embeddings, config.attention_bias, config.eos_token_ids) == (False, False, (100257,))
    resaved = {**DBRX_INSTRUCT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert model_config_from_hf(resaved).rope_theta == 500000.0
    ffn = DBRX_INSTRUCT["ffn_config"]
    unnormalised = {**DBRX_INSTRUCT, "ffn_config": {**ffn, "moe_normalize_expert_weights": None}}
    assert not model_config_from_hf(unnormalised).norm_topk_prob
    for bad, message in (
        ({"ffn_config": {**ffn, "ffn_act_fn": {"name": "gelu"}}}, "dbrx ffn_act_fn {'name': 'gelu'} is not supported"),
        ({"ffn_config": {**ffn, "moe_normalize_expert_weights": 2}}, "dbrx moe_normalize_expert_weights 2 is not"),
        ({"tie_word_embeddings": True}, "dbrx with tie_word_embeddings is not supported"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            model_config_from_hf({**DBRX_INSTRUCT, **bad})


# MPT-7B's released config (mosaicml/mpt-7b; MPT-30B's differs in its shape and `max_seq_len` alone).
MPT_7B: dict[str, Any] = {
    "architectures": ["MPTForCausalLM"], "model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32,
    "expansion_ratio": 4, "max_seq_len": 2048, "vocab_size": 50432, "resid_pdrop": 0.0, "emb_pdrop": 0.0,
    "learned_pos_emb": True, "logit_scale": None, "no_bias": True, "norm_type": "low_precision_layernorm",
    "embedding_fraction": 1.0, "use_cache": False, "torch_dtype": "bfloat16",
    "attn_config": {"alibi": True, "alibi_bias_max": 8, "attn_impl": "torch", "attn_pdrop": 0.0,
                    "attn_type": "multihead_attention", "attn_uses_sequence_id": False, "clip_qkv": None,
                    "prefix_lm": False, "qk_ln": False, "softmax_scale": None},
}  # fmt: skip
# Falcon-RW-1B's (tiiuae/falcon-rw-1b).
FALCON_RW_1B: dict[str, Any] = {
    "model_type": "falcon", "alibi": True, "apply_residual_connection_post_layernorm": False, "bias": True,
    "hidden_size": 2048, "layer_norm_epsilon": 1e-05, "multi_query": False, "new_decoder_architecture": False,
    "num_attention_heads": 32, "num_hidden_layers": 24, "parallel_attn": False, "vocab_size": 50304,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def test_mpt_and_falcon_rw_configs_read_as_released() -> None:
    """MPT-7B's config: its own names, an MLP 4 x 4,096, no biases, ALiBi with MPT's slopes over every layer (no
    rope), tied embeddings; a `logit_scale` and `alibi_bias_max` read as MosaicML's code reads them. Falcon-RW-1B's:
    every head its own K/V, the sequential block, biases, ALiBi with BLOOM's slopes (Falcon's form)."""
    config = model_config_from_hf(MPT_7B)
    shape = (config.architecture, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
             config.intermediate_size, config.num_hidden_layers, config.max_position_embeddings)  # fmt: skip
    assert shape == ("gpt_neox", 4096, 32, 32, 16384, 32, 2048)
    assert (config.alibi, config.alibi_bias_max, config.clip_qkv, config.nope_layers) == ("mpt", 8.0, 0.0,
                                                                                          tuple(range(32)))
    assert (config.layer_norm, config.layer_norm_bias, config.attention_bias, config.mlp_bias) == (True, False,
                                                                                                   False, False)
    assert (config.tie_word_embeddings, config.hidden_act, config.logit_scale) == (True, "gelu", 1.0)
    scaled = {**MPT_7B, "logit_scale": "inv_sqrt_d_model", "attn_config": {"alibi_bias_max": 16, "clip_qkv": 6}}
    config = model_config_from_hf(scaled)
    assert (config.logit_scale, config.alibi_bias_max, config.clip_qkv) == (1 / 64, 16.0, 6.0)
    config = model_config_from_hf(FALCON_RW_1B)
    shape = (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, config.parallel_block)
    assert shape == (32, 32, 8192, False)
    assert (config.alibi, config.nope_layers, config.attention_bias) == ("falcon", tuple(range(24)), True)


def test_dory_configs_read_as_transformers_writes_them() -> None:
    """Dory 1.0 4B's config as transformers writes it (each layer counted twice, `layer_types` naming an "mlp" block
    after each): 36 layers, 8 in, 20 run twice, 8 out, unrolled to 56 (each pass its own KV cache) with every
    fourth checkpoint layer full and the rest windowed (1,024 positions, a rope base of 10,000 beside the full
    layers' 10,000,000). Sections that do not add up, no pass, or its `last_loop` cache mode are refused by name."""
    written = transformers.DoryConfig().to_dict()
    assert written["num_hidden_layers"] == 72 and written["layer_types"][1] == "mlp"
    config = model_config_from_hf(written)
    loops = config.looped_ngpt
    assert loops is not None and (loops.input_layers, loops.recurrent_layers, loops.loops) == (8, 20, 2)
    assert (config.num_hidden_layers, config.head_dim, config.num_key_value_heads) == (56, 256, 4)
    assert [loops.layer_of(i) for i in (0, 8, 27, 28, 47, 48, 55)] == [0, 8, 27, 8, 27, 28, 35]
    assert [loops.loop_start(i) for i in (7, 8, 27, 28, 48)] == [False, True, False, True, False]
    full = [i for i in range(56) if config.attention_window(i) == 0]
    assert full == [i for i in range(56) if (loops.layer_of(i) + 1) % 4 == 0]
    assert config.attention_window(0) == 1024 and (config.rope_theta, config.local_rope_theta) == (1e7, 1e4)
    for changed, message in (
        ({"n_input_layers": 10}, "dory n_input_layers 5 + n_recurrent_layers 20 + n_output_layers 8 must equal"),
        ({"n_recurrent_loops": 0}, "dory n_recurrent_loops must be at least 1"),
        ({"recurrent_kv_cache_mode": "last_loop"}, "dory recurrent_kv_cache_mode 'last_loop' is not supported"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            model_config_from_hf({**written, **changed})


def test_zamba2_configs_read_as_transformers_writes_them() -> None:
    """Zamba2 2.7B's shape as transformers writes its config: 54 layers, 9 of them hybrid (a shared block's use
    before their Mamba-2), unrolled to 63 (each use a layer of K/V, heads 2 * 2,560 / 32 wide; each Mamba-2 layer
    one of states, 8 heads of 640), its one block shared by them all; its legacy and transformers 5 layer names read
    alike.
    Biases, and attention adapters over fewer KV heads, are refused by name."""
    written = transformers.Zamba2Config(tie_word_embeddings=True).to_dict()
    config = model_config_from_hf(written)
    shared, mamba = config.shared_blocks, config.mamba2
    assert shared is not None and mamba is not None
    assert (config.num_hidden_layers, config.head_dim, shared.blocks, len(shared.hybrid_layers)) == (63, 160, 1, 9)
    assert (mamba.num_heads, mamba.head_dim, mamba.state_dim, mamba.groups) == (8, 640, 64, 1)
    unrolled = shared.layers(54)
    assert unrolled[5:8] == [(5, False), (6, True), (6, False)]  # (layer 6 its first hybrid one)
    assert [config.is_recurrent_layer(i) for i in range(63)] == [not use for _, use in unrolled]
    assert config.nope_layers == tuple(range(63))  # (`use_mem_rope` off)
    legacy = {**written, "layers_block_type": ["mamba" if kind == "linear_attention" else kind
                                               for kind in written["layers_block_type"]]}  # fmt: skip
    assert model_config_from_hf(legacy) == config
    for changed, message in (
        ({"add_bias_linear": True}, "zamba2 with biases on its projections (add_bias_linear, mamba_proj_bias)"),
        ({"use_shared_attention_adapter": True, "num_key_value_heads": 8},
         "zamba2 with use_shared_attention_adapter and 8 KV heads for 32 heads is not supported"),
        ({"layers_block_type": ["mamba", "moe"], "num_hidden_layers": 2}, "zamba2 layers_block_type must name"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            model_config_from_hf({**written, **changed})


def test_olmoe_config_and_its_whole_projection_norms_split_by_rank() -> None:
    shape = {**SMALL, "intermediate_size": 32}
    olmoe = transformers.OlmoeConfig(**shape, num_experts=4, num_experts_per_tok=2, clip_qkv=2.0).to_dict()
    config = model_config_from_hf(olmoe)
    assert (config.architecture, config.qk_norm, config.qk_norm_whole, config.clip_qkv) == ("olmoe", True, True, 2.0)
    assert (config.num_experts, config.moe_intermediate_size, config.norm_topk_prob) == (4, 32, False)
    assert model_config_from_hf({**olmoe, "norm_topk_prob": True}).norm_topk_prob
    no_group = cast(dist.ProcessGroup, object())  # nothing runs a collective
    two_ranks = TensorParallel(rank=1, size=2, group=no_group, control_group=no_group)
    attention = PagedSelfAttention(config, torch.float32, tp=two_ranks)  # each rank its heads' columns of the norms
    q_norm, k_norm = attention.q_norm, attention.k_norm
    assert isinstance(q_norm, ShardedRMSNorm) and isinstance(k_norm, ShardedRMSNorm)
    q_full, kv_full = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    assert (q_norm.full, q_norm.kept, q_norm.weight.shape) == (q_full, range(q_full // 2, q_full), (q_full // 2,))
    assert (k_norm.full, k_norm.kept, k_norm.replicas) == (kv_full, range(kv_full // 2, kv_full), 1)


def test_moe_configs_say_which_layers_are_sparse_and_what_splits_under_tp() -> None:
    qwen2_moe = transformers.Qwen2MoeConfig(
        **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        decoder_sparse_step=2,
    )  # fmt: skip
    config = model_config_from_hf(qwen2_moe.to_dict())
    assert [config.is_moe_layer(i) for i in range(2)] == [False, True]  # every second layer is sparse
    assert config.attention_bias and not config.o_proj_bias and not config.norm_topk_prob
    assert config.mlp_widths == {
        "intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48
    }  # fmt: skip
    mixtral = model_config_from_hf(transformers.MixtralConfig(**SMALL, num_local_experts=4).to_dict())
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (4, 2, 96)
    assert mixtral.norm_topk_prob and mixtral.mlp_widths == {"moe_intermediate_size": 96}
    # Mellum: every layer sparse where its config names no MLP kinds (as transformers fills them in), else as named;
    # a list of the wrong length or with another kind is refused.
    mellum = {**SMALL, "model_type": "mellum", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    assert [model_config_from_hf(mellum).is_moe_layer(i) for i in range(2)] == [True, True]
    named = model_config_from_hf({**mellum, "mlp_layer_types": ["sparse", "dense"]})
    assert [named.is_moe_layer(i) for i in range(2)] == [True, False]
    for kinds in (["sparse"], ["sparse", "moe"]):
        with pytest.raises(ValueError, match="mlp_layer_types must name dense or sparse for each of the 2 layers"):
            model_config_from_hf({**mellum, "mlp_layer_types": kinds})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 5}, r"olmoe: num_experts_per_tok 5 must"),
        ({"model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 2, "hidden_act": "gelu"}, "olmoe: hidden"),
        ({"model_type": "gemma", "hidden_activation": "silu"}, "gemma hidden_activation 'silu' is not supported"),
        ({"model_type": "gemma2", "hidden_activation": "gelu"}, "gemma2 hidden_activation 'gelu' is not supported"),
        ({"model_type": "gemma2", "rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"model_type": "granite", "mlp_bias": True}, "granite with mlp_bias is not supported"),
        ({"model_type": "seed_oss", "mlp_bias": True}, "seed_oss with mlp_bias is not supported"),
        ({"model_type": "arcee", "mlp_bias": True}, "arcee with mlp_bias is not supported"),
        ({"model_type": "arcee", "hidden_act": "silu"}, "arcee hidden_act 'silu' is not supported"),
        ({"model_type": "apertus", "hidden_act": "silu"}, r"apertus hidden_act 'silu' is not supported \(xielu or"),
        ({"model_type": "apertus", "mlp_bias": True}, "apertus with mlp_bias is not supported"),
        ({"model_type": "bamba", "mlp_bias": True}, "bamba with mlp_bias is not supported"),
        ({"model_type": "granite_swa", "layer_rope_theta": [10000.0, 0, 500000.0]},
         r"granite_swa with layer_rope_theta of several bases \[10000.0, 500000.0\] is not supported"),
        ({"model_type": "internlm3", "bias": True}, "internlm3 with bias is not supported"),
        ({"model_type": "iquestcoder", "clip_qkv": 8.0}, "iquestcoder with clip_qkv is not supported"),
        ({"model_type": "iquestcoder", "sliding_window": 4, "use_sliding_window": True},
         "iquestcoder with use_sliding_window is not supported"),
        ({"model_type": "bamba", "attn_layer_indices": [1], "time_step_limit": [0.001, 100.0]},
         r"bamba with time_step_limit \[0.001, 100.0\] is not supported"),
        ({"model_type": "phimoe", "num_local_experts": 4, "num_experts_per_tok": 3},
         r"phimoe num_experts_per_tok 3 is not supported \(sparsemixer: 2\)"),
        ({"model_type": "phimoe", "num_local_experts": 4, "original_max_position_embeddings": 8,
          "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                              "short_mscale": 1.2, "long_mscale": 1.3}},
         "longrope short_mscale 1.2 and long_mscale 1.3 differ"),
        ({"model_type": "hunyuan_v1_moe", "num_experts": 4, "moe_topk": [2, 1]}, r"moe_topk \[2, 1\] differs"),
        ({"model_type": "hunyuan_v1_moe", "num_experts": 4, "moe_topk": 2, "num_shared_expert": 2},
         "num_shared_expert 2 is not supported"),
        ({"model_type": "hunyuan_v1_moe", "num_experts": 2, "moe_topk": 3}, "moe_topk 3 must be in"),
        ({"model_type": "hunyuan_v1_dense", "use_cla": True}, "hunyuan_v1_dense with use_qk_norm false or use_cla"),
        ({"model_type": "hunyuan_v1_moe", "use_qk_norm": False}, "hunyuan_v1_moe with use_qk_norm false or use_cla"),
        ({"model_type": "ernie4_5", "use_bias": True}, "ernie4_5 with use_bias is not supported"),
        ({"model_type": "cohere", "use_qk_norm": True}, "cohere with use_qk_norm"),
        ({"model_type": "olmo3", "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
          "rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
         "sliding_attention rope type 'yarn' is not supported"),
        ({"model_type": "ctrl"},
         r"'ctrl' \(no family of this engine implements it\); supported: ([a-z0-9_]+, )*llama, "),
        ({"model_type": "phi", "qk_layernorm": True}, "phi with qk_layernorm is not supported"),
        ({"model_type": "gpt2", "scale_attn_by_inverse_layer_idx": True},
         "gpt2 with scale_attn_by_inverse_layer_idx is not supported"),
        ({"model_type": "gpt_neox", "hidden_act": "relu", "num_attention_heads": 4, "hidden_size": 64},
         "gpt_neox hidden_act 'relu' is not supported"),
        ({"model_type": "paligemma"}, r"PaliGemma attends both ways over its whole prompt \(a prefix LM\)"),
        ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, "final_logit_softcapping is not supported"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"model_type": "gemma3_text", "sliding_window": None}, "gemma3_text without a sliding_window"),
        ({"model_type": "gemma3_text", "hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
        ({"model_type": "gemma3_text", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope type 'yarn'"),
        ({"model_type": "gemma4_text", "enable_moe_block": True}, "enable_moe_block needs num_experts"),
        ({"model_type": "gemma4_text", "sliding_window": 4, "layer_types": ["full_attention"] * 2,
          "num_kv_shared_layers": 1, "per_layer_config": {"1": {"head_dim": 32}}},
         r"per_layer_config .* only one shape, for the full-attention layers"),
        ({"model_type": "gemma4_text", "sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"],
          "num_kv_shared_layers": 1}, r"layer 1 \(sliding_attention\) has no earlier layer of its kind to share"),
        ({"model_type": "gemma4_text", "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
          "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "full_attention rope"),
        ({"model_type": "mistral", "sliding_window": 0}, "sliding_window must be a positive integer; got 0"),
        ({"model_type": "mistral", "sliding_window": 64, "layer_types": ["chunked_attention"] * 2}, "layer_types"),
        ({**LAGUNA, "num_attention_heads_per_layer": [4, 5]}, r"laguna num_attention_heads_per_layer \[4, 5\] must"),
        ({**LAGUNA, "num_attention_heads_per_layer": [4]}, r"laguna num_attention_heads_per_layer \[4\] must"),
        ({**LAGUNA, "moe_router_logit_softcapping": 30.0}, "laguna with moe_router_logit_softcapping"),
        ({**LAGUNA, "gating": "per-group"}, "laguna gating 'per-group' is not supported"),
        ({"model_type": "olmo_hybrid", "layer_types": ["linear_attention"] * 2}, "olmo_hybrid layer_types must name"),
        ({"model_type": "olmo_hybrid", "linear_num_key_heads": 2}, "olmo_hybrid with 4 linear value heads over 2"),
        ({"model_type": "zamba", "mamba_proj_bias": True}, r"zamba with biases on its projections"),
        ({"model_type": "mpt", "attn_config": {"qk_ln": True}}, "mpt with attn_config qk_ln True is not supported"),
        ({"model_type": "mpt", "attn_config": {"alibi": False}}, "mpt with attn_config alibi False is not supported"),
        ({"model_type": "mpt", "attn_config": {"attn_type": "grouped_query_attention"}},
         "mpt with attn_type 'grouped_query_attention' is not supported"),
        ({"model_type": "mpt", "no_bias": False}, "mpt with no_bias false"),
        ({"model_type": "bloom", "apply_residual_connection_post_layernorm": True},
         "bloom with apply_residual_connection_post_layernorm is not supported"),
        ({"model_type": "kolibri1_1", "num_hidden_layers": 3, "head_dim": 16,
          "layer_types": ["sliding_attention", "indexed_attention", "indexed_attention"], "index_layers": [2]},
         r"kolibri1_1: index_layers \[2\] must be indexed layers, the first among them"),
        ({"model_type": "kolibri1_1", "num_hidden_layers": 2, "head_dim": 16, "index_num_heads": 3,
          "layer_types": ["sliding_attention", "indexed_attention"]}, "3 index heads must be among key head 0's 2"),
        ({"model_type": "diffllama", "num_key_value_heads": 1}, "diffllama needs an even count of KV heads"),
        ({"model_type": "xlstm", "use_bias": True}, "xlstm with use_bias"),
        ({"model_type": "xlstm", "weight_mode": "joint"}, "xlstm with weight_mode 'joint' is not supported"),
        ({"model_type": "xlstm", "add_out_norm": False}, "xlstm without add_out_norm is not supported"),
        ({"model_type": "qwen4_exp_text", "layer_types": ["linear_attention", "indexed_attention"]},
         r"qwen4_exp: QSA needs indexer_n_heads"),
        ({**QWEN4_EXP, "model_type": "qwen4_exp_text", "output_gate_type": "sigmoid"},
         "linear attention's output gate 'sigmoid' is not served"),
        ({**QWEN4_EXP, "model_type": "qwen4_exp_text", "indexer_budget": 5}, "budget 5 must be a positive multiple"),
        ({**QWEN4_EXP, "model_type": "qwen4_exp_text", "ple_layer_ids": [2]},
         r"n-gram embeddings on layers \(1,\) \(zero-based\) need linear attention"),
    ],
)
def test_unserved_models_are_refused_saying_why(config: dict[str, Any], message: str) -> None:
    """Each refused by name, before any weight is read."""
    with pytest.raises(ValueError, match=message):
        model_config_from_hf({**SMALL, **config})


def test_olmo_hybrid_configs_turn_no_rope_where_transformers_turns_none() -> None:
    """A null rope base, in `rope_parameters` or at the top of a config.json (its released checkpoints'), is NoPE on
    every layer; none given, or null `rope_parameters`, is rope at 10,000, as transformers fills it in."""
    base = {**SMALL, "model_type": "olmo_hybrid", "layer_types": ["linear_attention", "full_attention"],
            "pad_token_id": 0, "eos_token_id": 2}
    for null in ({"rope_theta": None}, {"rope_parameters": {"rope_type": "default", "rope_theta": None}}):
        config = model_config_from_hf({**base, **null})
        assert config.nope_layers == (0, 1), null
        built = transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig.from_dict({**base, **null}))
        assert built.model.rotary_emb is None
    for rope in ({}, {"rope_parameters": None}):
        config = model_config_from_hf({**base, **rope})
        assert config.nope_layers == () and config.rope_theta == 10000.0
        assert transformers.OlmoHybridConfig.from_dict({**base, **rope}).rope_parameters["rope_theta"] == 10000.0


def test_flint_configs_without_layer_kinds_read_as_transformers_fills_them_in() -> None:
    """Flint's windows (full attention without rope on the first two layers, every fourth from the second and the
    last) and dense layers (the first two) where its config names none; its experts chosen by sigmoid score with no
    bias, beside an ungated shared expert."""
    base = {**SMALL, "model_type": "flint", "num_hidden_layers": 10, "sliding_window": 8, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
    ours, theirs = model_config_from_hf(base), transformers.FlintConfig(**base)
    assert [ours.attention_window(i) == 0 for i in range(10)] == [k == "full_attention" for k in theirs.layer_types]
    assert ours.nope_layers == (0, 1, 5, 9) and ours.attention_sinks and ours.qk_norm
    assert [ours.is_moe_layer(i) for i in range(10)] == [i not in theirs.mlp_only_layers for i in range(10)]
    assert not ours.router_score_bias and not ours.shared_expert_gated and ours.shared_expert_intermediate_size == 48


@pytest.mark.parametrize(
    "released",
    [
        {"model_type": "param2moe", "num_experts": 8, "num_shared_experts": 1, "use_qkv_bias": True},
        {"model_type": "param2moe", "n_routed_experts": 8},
        {"model_type": "minicpm5_moe", "n_routed_experts": 8},
    ],
)
def test_param2_and_minicpm5_configs_read_as_transformers_fills_them_in(released: dict[str, Any]) -> None:
    """Param2's and MiniCPM5-MoE's configs with only their shape stated (Param2's in its original names) read as
    transformers builds them: Param2's tied embeddings, q/k norms, two shared experts, scaling 2.5 and base 500,000,
    MiniCPM5's one shared expert, scaling 3.66 and base 5,000,000 and its output gate, each a dense first layer and
    rope over whole heads. MiniCPM5-MoE without its gated attention is refused by name."""
    shape = {**SMALL, "head_dim": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **released}
    config_class = transformers.Param2MoeConfig if released["model_type"] == "param2moe" else \
        transformers.MiniCPM5MoeConfig  # fmt: skip
    ours, theirs = model_config_from_hf(shape), model_config_from_hf(config_class.from_dict(shape).to_dict())
    assert ours == theirs
    param2 = released["model_type"] == "param2moe"
    assert (ours.tie_word_embeddings, ours.qk_norm, ours.attention_output_gate) == (param2, param2, not param2)
    assert ours.rope_theta == (500_000.0 if param2 else 5_000_000.0) and ours.rotary_dim == 16
    assert ours.routed_scaling_factor == (2.5 if param2 else 3.66) and ours.dense_layers == (0,)
    if not param2:
        with pytest.raises(ValueError, match="minicpm5_moe with use_gated_attention false is not supported"):
            model_config_from_hf({**shape, "use_gated_attention": False})


def test_kimi_linear_configs_read_as_released_and_as_transformers_writes_them() -> None:
    """Moonshot's released config.json (its layer kinds in `linear_attn_config`, counted from 1; its own names for
    the experts' settings) reads as transformers builds the same model; without layer kinds, full attention on every
    fourth layer from the fifth. Refused by name: latent attention with rope, softmax routing, a single kind."""
    released = {
        **SMALL, "model_type": "kimi_linear", "num_hidden_layers": 6, "kv_lora_rank": 24, "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 8, "v_head_dim": 10, "q_lora_rank": None, "num_experts": 8, "num_experts_per_token": 2,
        "num_expert_group": 4, "topk_group": 2, "moe_renormalize": True, "num_shared_experts": 1,
        "moe_intermediate_size": 32, "routed_scaling_factor": 2.5, "first_k_dense_replace": 2, "mla_use_nope": True,
        "moe_router_activation_func": "sigmoid",
        "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 3, 5, 6], "full_attn_layers": [4]},
    }  # fmt: skip
    ours = model_config_from_hf(released)
    theirs = transformers.KimiLinearConfig.from_dict(released)
    assert theirs.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2
    linear = ours.linear_attention
    assert linear is not None and linear.kimi_delta and linear.layers == (0, 1, 2, 4, 5)
    assert (linear.num_key_heads, linear.num_value_heads, linear.key_head_dim, linear.conv_kernel) == (4, 4, 16, 4)
    assert [ours.is_moe_layer(i) for i in range(6)] == [kind == "sparse" for kind in theirs.mlp_layer_types]
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_groups, ours.moe_topk_groups) == (8, 2, 4, 2)
    assert ours.latent_attention is not None and not ours.latent_attention.rope and ours.norm_topk_prob
    assert ours.shared_expert_intermediate_size == 32 and ours.routed_scaling_factor == 2.5
    plain = {key: value for key, value in released.items() if key != "linear_attn_config"}
    assert model_config_from_hf({**plain, "num_hidden_layers": 9}).linear_attention.layers == (0, 1, 2, 3, 5, 6, 7)
    for change, message in (({"mla_use_nope": False}, "rope on its latent attention"),
                            ({"moe_router_activation_func": "softmax"}, "routing by softmax"),
                            ({"num_hidden_layers": 4}, "both kinds")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            model_config_from_hf({**plain, **change})


def test_hy_v4_configs_read_as_transformers_fills_them_in() -> None:
    """An HY-V4 config.json without its layer lists, shared experts, routed scale or clamp reads as transformers
    builds the model from it (the first layer dense, an indexer on layer 0 and every fourth from layer 1, one shared
    expert, 2.827, the clamp at 10 without the up offset, four streams, rope over interleaved pairs), and as
    transformers writes it back; a clamp of 0 is none; `rope_interleave` false turns halves. Hy4's (its text model
    beside a vision tower): rope over interleaved pairs too, its latents normalised at its own epsilon. Refused by
    name: a layer kind other than indexed attention."""
    released = {
        **SMALL, "model_type": "hy_v4", "num_hidden_layers": 7, "q_lora_rank": 48, "kv_lora_rank": 24,
        "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "index_n_heads": 4, "index_head_dim": 16,
        "index_topk": 8,
    }  # fmt: skip
    theirs = transformers.HYV4Config.from_dict(released)
    for raw in (released, theirs.to_dict()):
        ours = model_config_from_hf(raw)
        assert [ours.is_moe_layer(i) for i in range(7)] == [kind == "sparse" for kind in theirs.mlp_layer_types]
        indexer = ours.sparse_indexer
        assert indexer is not None and indexer.rope_last and indexer.rope_interleave
        assert indexer.shared_layers == tuple(i for i, kind in enumerate(theirs.indexer_types) if kind == "shared")
        assert indexer.shared_layers == (2, 3, 4, 6) and indexer.key_norm_eps == theirs.rms_norm_eps
        assert ours.shared_expert_intermediate_size == 32 and ours.routed_scaling_factor == 2.827
        assert (ours.swiglu_limit, ours.swiglu_alpha, ours.swiglu_up_offset) == (10.0, 1.0, 0.0)
        assert ours.hyper_connections == HyperConnections(streams=4, post_scale=2.0, eps=1e-6)
        mla = ours.latent_attention
        assert mla is not None and mla.value_gate and mla.rope_interleave and mla.latent_norm_eps == 1e-6
        assert ours.attention_sinks and not ours.tie_word_embeddings
    assert model_config_from_hf({**released, "swiglu_limit": 0}).swiglu_limit == 0.0
    halves = model_config_from_hf({**released, "rope_interleave": False})
    assert halves.latent_attention is not None and not halves.latent_attention.rope_interleave
    text = {**released, "model_type": "hy_v4_vl_text",
            "rope_parameters": {"rope_theta": 1e4, "mrope_section": [2, 1, 1]}}  # fmt: skip
    hy4 = model_config_from_hf(transformers.HYV4VLConfig(text_config=text).to_dict())  # Hy4: interleaved pairs
    assert hy4.hyper_connections is not None and hy4.sparse_indexer is not None and hy4.latent_attention is not None
    assert hy4.sparse_indexer.rope_interleave and hy4.latent_attention.rope_interleave
    assert hy4.latent_attention.latent_norm_eps == 1e-5 and hy4.num_hidden_layers == 7
    with pytest.raises(ValueError, match="hy_v4 layer_types"):
        model_config_from_hf({**released, "layer_types": ["full_attention"] * 7})


def test_ling_3_configs_read_as_released_and_as_transformers_writes_them() -> None:
    """A Ling 3 config.json as released (its layer kinds from `layer_group_size`, `head_dim` the delta attention's,
    its own names for the experts' settings and its context) and as transformers writes it back (`layer_types`,
    `head_dim` the rope dims, the delta attention's as `linear_head_dim`) read alike, as transformers builds the
    model; transformers' defaults where keys are absent (8 groups, 4 chosen; two dense layers; the safe gate at -5).
    Without the safe gate: Kimi's unbounded decay. Refused by name: softmax scores, a bound above zero."""
    released = {
        **SMALL, "model_type": "bailing_hybrid", "num_hidden_layers": 7, "head_dim": 16, "kv_lora_rank": 24,
        "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "q_lora_rank": None, "num_experts": 16,
        "num_experts_per_token": 2, "moe_renormalize": True, "num_shared_experts": 1, "moe_intermediate_size": 32,
        "routed_scaling_factor": 2.5, "layer_group_size": 3, "model_max_length": 4096, "rope_theta": 600000.0,
        "score_function": "sigmoid",
    }  # fmt: skip
    del released["max_position_embeddings"]  # (its name for it is `model_max_length`)
    theirs = transformers.BailingHybridConfig.from_dict(released)
    for raw in (released, theirs.to_dict()):
        ours = model_config_from_hf(raw)
        linear = ours.linear_attention
        assert linear is not None and linear.kimi_delta and linear.full_rank_gates and linear.decay_bound == -5.0
        assert linear.layers == tuple(i for i, kind in enumerate(theirs.layer_types) if kind == "linear_attention")
        assert linear.layers == (0, 1, 3, 4, 6)
        assert (linear.num_value_heads, linear.key_head_dim, linear.conv_kernel) == (4, theirs.linear_head_dim, 4)
        assert [ours.is_moe_layer(i) for i in range(7)] == [kind == "sparse" for kind in theirs.mlp_layer_types]
        assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_groups, ours.moe_topk_groups) == (16, 2, 8, 4)
        assert ours.latent_attention is not None and ours.latent_attention.head_gate and ours.latent_attention.rope
        assert ours.max_position_embeddings == theirs.max_position_embeddings == 4096 and ours.rope_theta == 600000.0
        assert ours.shared_expert_intermediate_size == 32 and ours.routed_scaling_factor == 2.5
    assert theirs.linear_head_dim == 16 and theirs.head_dim == 8  # transformers' own rewrite, read through
    unbounded = model_config_from_hf({**released, "kda_safe_gate": False}).linear_attention
    assert unbounded is not None and unbounded.decay_bound == 0.0
    for change, message in (({"score_function": "softmax"}, "routing by softmax"),
                            ({"kda_lower_bound": 2.0}, "must be negative")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            model_config_from_hf({**released, **change})


def test_phi3_configs_read_partial_rotary_and_longrope_in_either_layout() -> None:
    factors = {"short_factor": [1.0] * 6, "long_factor": [2.0] * 6}
    new = transformers.Phi3Config(
        **{**SMALL, "max_position_embeddings": 1024}, pad_token_id=0, partial_rotary_factor=0.75,
        original_max_position_embeddings=64, rope_scaling={"rope_type": "longrope", **factors},
    )  # fmt: skip
    old = {  # an early Phi-3 config.json: rope_scaling of type "su", the limit at the top level
        **SMALL, "model_type": "phi3", "max_position_embeddings": 1024, "original_max_position_embeddings": 64,
        "partial_rotary_factor": 0.75, "rope_scaling": {"type": "su", **factors},
    }  # fmt: skip
    for raw in (new.to_dict(), old):
        config = model_config_from_hf(raw)
        assert (config.architecture, config.rotary_dim, config.head_dim) == ("phi3", 12, 16)
        scaling = config.rope_scaling
        assert isinstance(scaling, LongRope) and scaling.original_max_position_embeddings == 64
        assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(16) / math.log(64)))
    assert model_config_from_hf(old).layer_windows == ()
    assert model_config_from_hf({**old, "sliding_window": 256}).layer_windows == (256, 256)


def test_sliding_windows_are_read_per_layer_as_transformers_builds_them() -> None:
    """Every layer of Mistral / Mixtral / Phi-3 when `sliding_window` is set; Qwen's layers from
    `max_window_layers` on, only with `use_sliding_window`; `layer_types` where a config lists them."""
    mistral = transformers.MistralConfig(**SMALL, sliding_window=32).to_dict()
    assert model_config_from_hf(mistral).layer_windows == (32, 32)
    assert model_config_from_hf({**mistral, "sliding_window": None}).layer_windows == ()
    qwen = transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=32, max_window_layers=1)
    config = model_config_from_hf(qwen.to_dict())
    assert config.layer_windows == (0, 32) and [config.attention_window(i) for i in range(3)] == [0, 32, 0]
    for raw in (transformers.Qwen2Config(**SMALL, sliding_window=32).to_dict(),  # use_sliding_window unset
                {**qwen.to_dict(), "use_sliding_window": False}):
        assert model_config_from_hf(raw).layer_windows == ()
    listed = {**mistral, "layer_types": ["full_attention", "sliding_attention"]}
    assert model_config_from_hf(listed).layer_windows == (0, 32)


def test_exaone4_configs_read_their_windows_and_nope_layers() -> None:
    """EXAONE 4's windows from `layer_types`, or from `sliding_window_pattern` as a string of L and G or every n-th
    layer global; its global layers turn no rope, and without a window every layer turns it; its q/k norms are per
    head."""
    base = {**SMALL, "model_type": "exaone4", "num_hidden_layers": 8, "sliding_window": 16}
    for pattern in ("LLLG", 4):
        config = model_config_from_hf({**base, "sliding_window_pattern": pattern})
        assert config.layer_windows == (16, 16, 16, 0) * 2 and config.nope_layers == (3, 7)
        assert config.qk_norm and not config.qk_norm_whole and config.post_norms
    listed = model_config_from_hf({**base, "layer_types": ["sliding_attention", "full_attention"] * 4})
    assert listed.layer_windows == (16, 0) * 4 and listed.nope_layers == (1, 3, 5, 7)
    plain = model_config_from_hf({**base, "sliding_window": None})
    assert plain.layer_windows == () and plain.nope_layers == ()
    with pytest.raises(ValueError, match="not a string of L and G"):
        model_config_from_hf({**base, "sliding_window_pattern": "LLXG"})


def test_cohere2_configs_read_their_windows_from_the_pattern_without_layer_types() -> None:
    """Command R7B's released config.json has `sliding_window_pattern` (4) and no `layer_types`: every 4th layer is
    global and turns no rope, as transformers builds it; the layers `layer_types` lists where it has them."""
    base = {**SMALL, "model_type": "cohere2", "num_hidden_layers": 8, "sliding_window": 16}
    for config in ({**base, "sliding_window_pattern": 4}, base):
        model = model_config_from_hf(config)
        assert model.layer_windows == (16, 16, 16, 0) * 2 and model.nope_layers == (3, 7)
    built = transformers.Cohere2Config(**{**SMALL, "num_hidden_layers": 8, "sliding_window": 16}).to_dict()
    assert model_config_from_hf(built).layer_windows == (16, 16, 16, 0) * 2


def test_lfm2_configs_read_as_transformers_builds_them() -> None:
    """LFM2's released config.json (LFM2-1.2B's and LFM2-350M's keys): the MLP's width from `block_ff_dim`, cut to two
    thirds and rounded up to `block_multiple_of` as transformers' `Lfm2MLP` builds it, convolutions on the layers not
    in `full_attn_idxs`, `norm_eps`, `tie_embedding`; a convolution with biases and a model of convolutions only are
    refused by name."""
    released = {"model_type": "lfm2", "vocab_size": 65536, "num_attention_heads": 32, "num_key_value_heads": 8,
                "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
                "conv_L_cache": 3, "conv_bias": False, "norm_eps": 1e-05, "tie_embedding": True,
                "max_position_embeddings": 128000, "rope_theta": 1000000.0, "bos_token_id": 1, "eos_token_id": 7,
                "pad_token_id": 0}  # fmt: skip
    for hidden, width, attending in ((2048, 12288, [2, 5, 8, 10, 12, 14]), (1024, 6656, [2, 5, 8, 10, 12, 14])):
        raw = {**released, "hidden_size": hidden, "block_ff_dim": width, "num_hidden_layers": 16,
               "full_attn_idxs": attending}  # fmt: skip
        config = model_config_from_hf(raw)
        theirs = transformers.Lfm2Config(**{k: v for k, v in raw.items() if k != "model_type"})
        with torch.device("meta"):
            mlp = transformers.models.lfm2.modeling_lfm2.Lfm2MLP(theirs)
        assert config.intermediate_size == mlp.w1.out_features
        assert config.short_convolution is not None
        assert config.short_convolution.layers == tuple(i for i in range(16) if i not in attending)
        assert (config.short_convolution.channels, config.short_convolution.conv_kernel) == (hidden, 3)
        assert config.rms_norm_eps == 1e-5 and config.tie_word_embeddings and config.qk_norm
        assert model_config_from_hf(theirs.to_dict()) == config  # transformers' own dict of it
    with pytest.raises(ValueError, match="lfm2 with conv_bias is not supported"):
        model_config_from_hf({**raw, "conv_bias": True})
    with pytest.raises(ValueError, match="convolution layers only"):
        model_config_from_hf({**raw, "full_attn_idxs": []})


def test_granite4_configs_read_their_layers_as_released_and_refuse_what_is_not_built() -> None:
    """Granite 4.0 H's released config.json names its layers "mamba" and "attention" (transformers 5: linear_attention
    and full_attention), its position embedding "nope", its heads' width "auto" or a number: the same shape either
    way, NoPE on every layer; its dense forms (every layer attention, rope) have no Mamba-2. Biases on the Mamba-2
    projections, a clamped time step and a model of Mamba-2 layers only are refused by name."""
    released = {**SMALL, "model_type": "granitemoehybrid", "num_hidden_layers": 4, "mamba_n_heads": 8,
                "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_expand": 2, "mamba_d_head": "auto",
                "position_embedding_type": "nope", "layer_types": ["mamba", "mamba", "attention", "mamba"],
                "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 64, "bos_token_id": 1,
                "eos_token_id": 2}  # fmt: skip
    config = model_config_from_hf(released)
    built = transformers.GraniteMoeHybridConfig(**{k: v for k, v in released.items() if k != "model_type"})
    assert model_config_from_hf(built.to_dict()) == config
    assert config.mamba2 is not None and config.mamba2.layers == (0, 1, 3)
    assert (config.mamba2.num_heads, config.mamba2.head_dim, config.mamba2.groups) == (8, 16, 1)
    assert config.nope_layers == (0, 1, 2, 3) and config.num_experts == 4
    assert config.shared_expert_intermediate_size == 64 and not config.shared_expert_gated
    dense = model_config_from_hf({**released, "layer_types": ["attention"] * 4, "num_local_experts": 0,
                                        "position_embedding_type": "rope"})  # fmt: skip
    assert dense.mamba2 is None and dense.nope_layers == () and dense.intermediate_size == 64
    for changed, refusal in (({"mamba_proj_bias": True}, "mamba_proj_bias"),
                             ({"time_step_limit": [0.001, 0.1]}, "time_step_limit"),
                             ({"layer_types": ["mamba"] * 4}, "Mamba-2 layers only")):  # fmt: skip
        with pytest.raises(ValueError, match=refusal):
            model_config_from_hf({**released, **changed})


def test_granite_swa_configs_without_a_window_or_layer_types_read_as_transformers_fills_them_in() -> None:
    """Granite SWA's and Granite-MoE SWA's config.json may leave out `sliding_window` and `layer_types`: transformers
    then windows every layer but every 4th (from the first) at 128 tokens, and so does ladle; a base per layer of
    several values is refused by name."""
    for model_type, config_class in (("granite_swa", transformers.GraniteSWAConfig),
                                     ("granitemoe_swa", transformers.GraniteMoeSWAConfig)):  # fmt: skip
        bare = {**SMALL, "model_type": model_type, "num_hidden_layers": 8, "bos_token_id": 1, "eos_token_id": 2,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
        if model_type == "granitemoe_swa":
            bare.update(num_local_experts=4, num_experts_per_tok=2)
        config = model_config_from_hf(bare)
        assert config.layer_windows == (0, 128, 128, 128, 0, 128, 128, 128) and config.attention_sinks
        built = config_class(**{k: v for k, v in bare.items() if k != "model_type"}).to_dict()
        assert model_config_from_hf(built) == config
        with pytest.raises(ValueError, match=f"{model_type} with layer_rope_theta of several bases"):
            model_config_from_hf({**bare, "layer_rope_theta": [1e4, 0, 5e5, 1e4, 1e4, 1e4, 1e4, 1e4]})


def test_cohere2_moe_configs_read_their_layers_as_transformers_builds_them() -> None:
    """A Cohere2-MoE config.json with `first_k_dense_replace` in place of `layer_types` and `mlp_layer_types` reads as
    transformers' config builds it (the dense prefix windowed by its own pattern, the rest by theirs); RMSNorms
    where `rms_norm_eps` is set; the shared experts averaged with the routed ones by halving each, summed without.
    Another router or combination is refused by name."""
    raw = {**SMALL, "model_type": "cohere2_moe", "num_hidden_layers": 8, "head_dim": 16, "first_k_dense_replace": 2,
           "prefix_dense_sliding_window_pattern": 2, "sliding_window_pattern": 3, "sliding_window": 32,
           "prefix_dense_intermediate_size": 128, "intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2,
           "num_shared_experts": 2, "layer_norm_eps": 1e-5, "logit_scale": 0.25, "tie_word_embeddings": True,
           "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    config = model_config_from_hf(raw)
    built = transformers.Cohere2MoeConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert model_config_from_hf(built.to_dict()) == config
    assert config.layer_windows == (32, 0, 32, 32, 0, 32, 32, 0)  # prefix: every 2nd global; then every 3rd
    assert config.nope_layers == (1, 4, 7) and config.dense_layers == (0, 1) and config.layer_norm
    assert (config.intermediate_size, config.moe_intermediate_size, config.shared_expert_intermediate_size) == (
        128, 48, 96)  # fmt: skip
    assert (config.routed_scaling_factor, config.shared_expert_scale) == (0.5, 0.5)
    summed = model_config_from_hf({**raw, "shared_expert_combination_strategy": "sum", "rms_norm_eps": 1e-6})
    assert (summed.routed_scaling_factor, summed.shared_expert_scale, summed.layer_norm) == (1.0, 1.0, False)
    for changed in ({"expert_selection_fn": "softplus"}, {"shared_expert_combination_strategy": "max"}):
        with pytest.raises(ValueError, match="cohere2_moe with expert_selection_fn"):
            model_config_from_hf({**raw, **changed})


def test_lfm3_configs_read_as_transformers_builds_them() -> None:
    """LFM3's default config (LFM3-1.7B's shape: 24 layers, a full-attention layer in every 4 from the third and a
    windowed one from the fifth, convolutions between; proportional rope over half of the full layers' angles) reads
    as transformers builds it, and so does a config.json without its layer kinds or ropes; its attention gate or
    sandwich norms off are refused by name."""
    raw = transformers.Lfm3Config().to_dict()
    config = model_config_from_hf(raw)
    full, windowed = tuple(range(2, 24, 4)), tuple(range(4, 24, 4))
    assert config.short_convolution is not None
    assert config.short_convolution.layers == tuple(i for i in range(24) if i not in full + windowed)
    assert config.layer_windows == tuple(256 if i in windowed else 0 for i in range(24))
    assert (config.rope_theta, config.local_rope_theta, config.rope_rotated_angles, config.rotary_dim) == (
        1e6, 1e4, 32, 128)  # fmt: skip
    assert config.sandwich_norms and config.attention_output_gate and config.qk_norm and config.tie_word_embeddings
    bare = {k: v for k, v in raw.items() if k not in ("layer_types", "rope_parameters", "sliding_window")}
    assert model_config_from_hf(bare) == config
    for key in ("use_attention_gate", "use_sandwich_norm"):
        with pytest.raises(ValueError, match=f"lfm3 with {key} false is not supported"):
            model_config_from_hf({**raw, key: False})


def test_mimo_v2_flash_configs_read_as_transformers_builds_them() -> None:
    """MiMo-V2-Flash's default config (its release's shape: 48 layers, the first and every 6th full attention with 4 KV
    heads and rope base 5e6, the rest windowed over 129 positions with 8 KV heads, sinks and base 1e4; heads 192 wide,
    values 128, a third of each head turned; the first layer dense) reads as transformers builds it, and so does a
    config.json that states none of what transformers fills in; `sliding_window_size` is the positions before the
    query (the window one more)."""
    raw = transformers.MiMoV2FlashConfig().to_dict()
    config = model_config_from_hf(raw)
    full = tuple(i for i in range(48) if i == 0 or (i + 1) % 6 == 0)
    assert config.layer_kv_head_counts == tuple(4 if i in full else 8 for i in range(48))
    assert config.layer_windows == tuple(0 if i in full else 129 for i in range(48)) and config.attention_sinks
    assert (config.head_dim, config.value_head_dim, config.value_scale, config.rotary_dim) == (192, 128, 0.707, 64)
    assert (config.rope_theta, config.local_rope_theta, config.dense_layers) == (5e6, 1e4, (0,))
    bare = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters",
                                                       "sliding_window")}  # fmt: skip
    assert model_config_from_hf(bare) == config
    assert model_config_from_hf({**raw, "sliding_window_size": 127}).layer_windows[1] == 128
    from engine_server.models.mimo_v2_flash import mimo_weights

    extra = torch.ones(config.num_key_value_heads * 128, config.hidden_size)  # a prediction layer's, past the last
    out = dict(mimo_weights(config, [("model.layers.48.self_attn.v_proj.weight", extra)]))
    assert out["model.layers.48.self_attn.v_proj.weight"] is extra and len(out) == 1 + len(full)  # (+ full sinks)


def test_sparse_attention_configs_read_as_transformers_builds_them() -> None:
    """DeepSeek-V3.2's and GLM-5's default configs (their releases' shapes) read as transformers builds them: latent
    attention whose cache row also holds a 128-wide index key (512 + 128 against 512 + 64), 2,048 positions per
    query, rope over halves of the index key's first 64 dims for DeepSeek and over interleaved pairs for GLM, three
    dense layers first; so does a config.json that states none of what transformers fills in. GLM-5's shared layers
    follow `indexer_types`, else its `index_topk_pattern`, else `index_topk_freq` from `index_skip_topk_offset`; a
    first layer without an indexer of its own is refused."""
    for made, rope_interleave, heads in ((transformers.DeepseekV32Config(), False, 64),
                                         (transformers.GlmMoeDsaConfig(), True, 32)):  # fmt: skip
        raw = made.to_dict()
        config = model_config_from_hf(raw)
        indexer = config.sparse_indexer
        assert indexer is not None and config.architecture == "deepseek_v3"
        assert (indexer.heads, indexer.head_dim, indexer.topk, indexer.rope_interleave) == (heads, 128, 2048,
                                                                                             rope_interleave)
        assert indexer.shared_layers == () and (config.head_dim, config.num_key_value_heads) == (640, 1)
        assert config.dense_layers == (0, 1, 2)
        bare = {k: v for k, v in raw.items() if k not in ("mlp_layer_types", "first_k_dense_replace", "indexer_types",
                                                           "layer_types")}  # fmt: skip
        assert model_config_from_hf(bare) == config
    glm = {**transformers.GlmMoeDsaConfig(num_hidden_layers=6).to_dict(), "indexer_types": None}
    schedules: list[dict[str, Any]] = [
        {"index_topk_pattern": "FFSFSS"}, {"index_topk_freq": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1}
    ]
    for schedule in schedules:
        kinds = transformers.GlmMoeDsaConfig(num_hidden_layers=6, **schedule).indexer_types
        shared = model_config_from_hf({**glm, **schedule}).sparse_indexer
        assert shared is not None and shared.shared_layers == tuple(i for i, k in enumerate(kinds) if k == "shared")
    with pytest.raises(ValueError, match="layer 0's indexer is shared"):
        model_config_from_hf({**glm, "indexer_types": ["shared"] + ["full"] * 5})


def test_jamba_configs_read_their_layers_as_transformers_builds_them() -> None:
    """Jamba's default config (Jamba-v0.1's shape: 32 layers, attention on every 8th from the 5th, 16 experts on every
    other layer, Mamba-1 of 8,192 channels with a rank-256 time step) reads as transformers builds it; the same from
    an explicit `layers_block_type`; refused by name: biases on Mamba's projections, Mamba layers only."""
    raw = transformers.JambaConfig().to_dict()
    config = model_config_from_hf(raw)
    mamba = config.mamba1
    assert mamba is not None and (mamba.inner, mamba.state_dim, mamba.dt_rank, mamba.conv_kernel) == (8192, 16, 256, 4)
    assert mamba.layers == tuple(i for i in range(32) if i % 8 != 4) and config.attention_layers == 4
    assert config.dense_layers == tuple(range(0, 32, 2)) and (config.num_experts, config.num_experts_per_tok) == (16, 2)
    assert config.nope_layers == tuple(range(32)) and not config.norm_topk_prob
    kinds = ["attention" if i % 8 == 4 else "mamba" for i in range(32)]
    assert model_config_from_hf({**raw, "attn_layer_period": 3, "layers_block_type": kinds}) == config
    for changed, refusal in (({"mamba_proj_bias": True}, "jamba with mamba_proj_bias"),
                             ({"layers_block_type": ["mamba"] * 32}, "Mamba layers only")):  # fmt: skip
        with pytest.raises(ValueError, match=refusal):
            model_config_from_hf({**raw, **changed})


def test_state_space_configs_read_as_transformers_builds_them_and_refuse_what_is_not_built() -> None:
    """Mamba's default config (mamba-130m's shape: 24 layers of 1,536 channels, a rank-48 time step, 16-wide states,
    embeddings tied), Falcon Mamba's (its time step, B and C normalised without a weight at `mixer_rms_eps`) and
    Mamba-2's (Mamba-Codestral's shape: 128 heads 64 wide in 8 groups of 128-wide states): every layer a mixer, none
    attending or with an MLP, no K/V; no position limit of their own (`MAX_POSITIONS`, or the config's). Mamba's
    inner width is its `intermediate_size` where given, its time step's rank hidden / 16 where "auto". Refused by
    name: biases on the projections, another activation, a clamped time step, Mamba-2 heads not `expand` times the
    stream wide."""
    mamba = model_config_from_hf(transformers.MambaConfig(hidden_size=768, num_hidden_layers=24).to_dict())
    assert mamba.architecture == "mamba" and mamba.mamba1 is not None and mamba.mamba2 is None
    shape = mamba.mamba1
    assert (shape.inner, shape.dt_rank, shape.state_dim, shape.conv_kernel, shape.conv_bias) == (1536, 48, 16, 4, True)
    assert shape.inner_norms == "none" and shape.layers == tuple(range(24)) == mamba.mlp_free_layers
    assert mamba.attention_layers == 0 and mamba.tie_word_embeddings and mamba.rms_norm_eps == 1e-5
    assert mamba.max_position_embeddings == MAX_POSITIONS and mamba.mlp_widths == {}
    raw = {**transformers.MambaConfig(hidden_size=64, num_hidden_layers=2).to_dict(), "intermediate_size": 96}
    untold = {key: value for key, value in raw.items() if key != "tie_word_embeddings"}  # as mamba-130m-hf's file
    assert model_config_from_hf(untold).tie_word_embeddings
    assert not model_config_from_hf({**untold, "model_type": "mamba2", "num_heads": 2}).tie_word_embeddings
    assert model_config_from_hf({**raw, "max_position_embeddings": 4096}).max_position_embeddings == 4096
    assert model_config_from_hf(raw).mamba1 == replace(shape, inner=96, dt_rank=4, layers=(0, 1))
    falcon = model_config_from_hf(transformers.FalconMambaConfig(hidden_size=64, mixer_rms_eps=1e-5).to_dict())
    assert falcon.mamba1 is not None
    assert (falcon.mamba1.inner_norms, falcon.mamba1.inner_norm_eps) == ("weightless", 1e-5)
    codestral = transformers.Mamba2Config(num_hidden_layers=64).to_dict()
    mamba2 = model_config_from_hf(codestral)
    assert mamba2.architecture == "mamba" and mamba2.mamba2 is not None and mamba2.mamba1 is None
    heads = mamba2.mamba2
    assert (heads.num_heads, heads.head_dim, heads.groups, heads.state_dim, heads.gated_norm) == (128, 64, 8, 128, True)
    assert heads.layers == tuple(range(64)) and mamba2.attention_layers == 0
    for limit in ([0.0, math.inf], [0.0, {"__float__": "Infinity"}]):  # as transformers 5 writes infinity
        assert model_config_from_hf({**codestral, "time_step_limit": limit}) == mamba2
    for config, refusal in (
        ({**raw, "use_bias": True}, "mamba with use_bias"),
        ({**raw, "hidden_act": "gelu"}, "mamba hidden_act 'gelu' is not supported"),
        ({**codestral, "time_step_limit": [0.001, 0.1]}, r"mamba2 with time_step_limit \[0.001, 0.1\]"),
        ({**codestral, "num_heads": 64}, "mamba2 of 64 heads 64 wide is not expand"),
    ):
        with pytest.raises(ValueError, match=refusal):
            model_config_from_hf(config)


def test_falcon_h1_configs_read_their_layers_and_multipliers_and_refuse_what_is_not_built() -> None:
    """A config in the shape of Falcon-H1 0.5B's release (heads 64 wide beside a 1,024-wide stream, Mamba-2's inner
    width `mamba_d_ssm` rather than `mamba_expand` times the stream, one group, no norm in Mamba-2): Mamba-2 beside
    attention in every layer, each keeping K/V too; the multipliers read in place; what transformers' own config
    writes reads the same. Refused by name: the norm before the gate, biases on the projections, a clamped time
    step, ssm_multipliers of another length."""
    released = {
        "model_type": "falcon_h1", "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 2048,
        "num_hidden_layers": 36, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "rope_theta": 1e11, "max_position_embeddings": 16384, "mamba_d_ssm": 1536, "mamba_n_heads": 24,
        "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_chunk_size": 128,
        "mamba_rms_norm": False, "mamba_norm_before_gate": False, "embedding_multiplier": 5.656854249492381,
        "lm_head_multiplier": 0.0390625, "key_multiplier": 0.390625, "attention_out_multiplier": 0.9375,
        "attention_in_multiplier": 1.0, "mlp_multipliers": [0.8838834764831844, 0.5859375], "ssm_in_multiplier": 1.25,
        "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
        "ssm_out_multiplier": 0.23570226039551587, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 11,
    }  # fmt: skip
    config = model_config_from_hf(released)
    built = transformers.FalconH1Config(**{k: v for k, v in released.items() if k != "model_type"})
    assert model_config_from_hf(built.to_dict()) == config
    mamba = config.mamba2
    assert mamba is not None and mamba.layers == tuple(range(36)) and mamba.beside_attention and not mamba.gated_norm
    assert (mamba.num_heads, mamba.head_dim, mamba.state_dim, mamba.groups, mamba.inner) == (24, 64, 128, 1, 1536)
    assert config.state_beside_attention == tuple(range(36)) and config.attention_layers == 36
    assert not any(config.is_recurrent_layer(i) for i in range(36)) and config.recurrent is mamba
    assert (config.embedding_multiplier, config.logit_scale) == (5.656854249492381, 0.0390625)
    scales = config.falcon_h1
    assert scales is not None and (scales.key, scales.attention_out, scales.ssm_in) == (0.390625, 0.9375, 1.25)
    assert scales.ssm[1] == 0.25 and (scales.mlp_gate, scales.mlp_down) == (0.8838834764831844, 0.5859375)
    assert model_config_from_hf({**released, "mamba_rms_norm": True}).mamba2.gated_norm  # type: ignore[union-attr]
    for changed, refusal in (
        ({"mamba_rms_norm": True, "mamba_norm_before_gate": True}, "mamba_rms_norm and mamba_norm_before_gate"),
        ({"mamba_rms_norm": True, "mamba_norm_before_gate": "absent"}, "mamba_rms_norm and mamba_norm_before_gate"),
        ({"projectors_bias": True}, "falcon_h1 with projectors_bias is not supported"),
        ({"mamba_proj_bias": True}, "falcon_h1 with mamba_proj_bias is not supported"),
        ({"mlp_bias": True}, "falcon_h1 with mlp_bias is not supported"),
        ({"time_step_limit": [0.0, 0.1]}, "time_step_limit"),
        ({"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers must be 5 numbers"),
    ):
        with pytest.raises(ValueError, match=refusal):  # ("absent": the key left out, transformers' default True)
            model_config_from_hf({k: v for k, v in {**released, **changed}.items() if v != "absent"})


def test_nemotron_h_configs_pair_their_blocks_into_layers_and_refuse_what_is_not_built() -> None:
    """Nemotron Nano 2's released config.json keys (its `hybrid_override_pattern` of M, - and * blocks) and transformers
    5's own dict of it (`layers_block_type`) read the same: a Mamba-2 or attention block and the MLP after it are one
    layer, a mixer followed by another mixer a layer without an MLP; every attention layer without rope. Latent expert
    projections, an MLP after no mixer, biases, a window and a clamped time step are refused by name."""
    released = {**SMALL, "model_type": "nemotron_h", "hybrid_override_pattern": "M-MM*-M-", "num_hidden_layers": 8,
                "head_dim": 16, "attention_head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 16,
                "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "use_conv_bias": True, "mlp_hidden_act": "relu2",
                "layer_norm_epsilon": 1e-5, "time_step_limit": [0.0, math.inf], "use_bias": False,
                "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 12}  # fmt: skip
    config = model_config_from_hf(released)
    built = transformers.NemotronHConfig(**{k: v for k, v in released.items() if k != "model_type"})
    assert model_config_from_hf(built.to_dict()) == config
    assert config.block_pattern == "M-MM*-M-" and config.num_hidden_layers == 5 and config.head_dim == 16
    assert config.mamba2 is not None and config.mamba2.layers == (0, 1, 2, 4) and config.mlp_free_layers == (1, 2)
    assert (config.mamba2.num_heads, config.mamba2.head_dim, config.mamba2.groups) == (8, 16, 2)
    assert config.nope_layers == tuple(range(5)) and config.hidden_act == "relu2" and config.rms_norm_eps == 1e-5
    for changed, refusal in (({"hybrid_override_pattern": "M-*E", "n_routed_experts": 4, "num_experts_per_tok": 2,
                               "moe_latent_size": 16}, "moe_latent_size"),
                             ({"hybrid_override_pattern": "-M*"}, "block 0 is an MLP that follows no"),
                             ({"hybrid_override_pattern": "M--*"}, "block 2 is an MLP that follows no"),
                             ({"hybrid_override_pattern": "M-M-"}, "a hybrid of Mamba-2 and attention"),
                             ({"mamba_proj_bias": True}, "mamba_proj_bias"), ({"sliding_window": 8}, "sliding_window"),
                             ({"time_step_limit": [0.001, math.inf]}, "time_step_limit"),
                             ({"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu'")):  # fmt: skip
        with pytest.raises(ValueError, match=refusal):
            model_config_from_hf({**released, **changed})


def test_lfm2_moe_routes_as_transformers_where_the_chosen_scores_are_small() -> None:
    """LFM2-MoE renormalises the chosen sigmoid scores by their sum plus 1e-6 (DeepSeek-V3's router: 1e-20): with
    logits near -9 the scores are ~1e-4, where the two differ by parts in a thousand. Weights and experts equal
    transformers' router's."""
    hf, ours = build_pair("lfm2-moe")
    theirs, router = hf.model.layers[1].feed_forward, ours.model.layers[1].mlp.gate
    target = -9.0 + torch.randn(6, 8, generator=torch.Generator().manual_seed(0))  # each token's logits
    x = target @ torch.linalg.pinv(theirs.gate.weight.detach()).T
    with torch.no_grad():
        _, expected, experts = theirs.gate(x, theirs.expert_bias)
    weights, chosen = router.route(x)
    ours_sorted, theirs_sorted = chosen.sort(-1), experts.sort(-1)
    assert torch.equal(ours_sorted.values, theirs_sorted.values)
    assert expected.sum(-1).max() < 0.9999  # renormalised by a sum where 1e-6 counts
    torch.testing.assert_close(weights.gather(1, ours_sorted.indices), expected.gather(1, theirs_sorted.indices),
                               rtol=1e-5, atol=0.0)  # fmt: skip


def test_gemma3_configs_read_in_either_layout() -> None:
    """transformers 5's `rope_parameters` by layer type and `layer_types`, and an earlier config.json's
    `rope_theta`, `rope_local_base_freq`, `rope_scaling` and `sliding_window_pattern`, give the same config."""
    shape = {**SMALL, "num_hidden_layers": 6, "head_dim": 16, "query_pre_attn_scalar": 32, "sliding_window": 8}
    new = transformers.Gemma3TextConfig(
        **shape, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    ).to_dict()  # fmt: skip
    old = {**shape, "model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 6,
           "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1}  # fmt: skip
    configs = [model_config_from_hf(raw) for raw in (new, old)]
    assert configs[0] == configs[1]
    config = configs[0]
    assert config.architecture == "gemma3" and config.layer_windows == (8, 8, 8, 8, 8, 0)
    assert (config.rope_theta, config.local_rope_theta, config.rope_linear_factor) == (1e6, 1e4, 8.0)
    assert config.attention_scale == 32**-0.5 and config.embedding_multiplier == 64**0.5
    assert config.norm_offset == 1.0 and config.sandwich_norms and config.qk_norm and config.hidden_act == "gelu_tanh"


def test_gemma2_configs_read_in_either_layout() -> None:
    """transformers 5's `layer_types` and `rope_parameters`, and an earlier config.json's `rope_theta` with the even
    layers local, give the same config: soft-capping, Gemma's norms and embeddings, one rope base, no q/k norms."""
    shape = {**SMALL, "num_hidden_layers": 4, "head_dim": 16, "query_pre_attn_scalar": 32, "sliding_window": 8,
             "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # fmt: skip
    new = transformers.Gemma2Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": 1e4}).to_dict()
    old = {**shape, "model_type": "gemma2", "rope_theta": 1e4, "tie_word_embeddings": True, "bos_token_id": 2,
           "eos_token_id": 1}  # fmt: skip
    configs = [model_config_from_hf(raw) for raw in (new, old)]
    assert configs[0] == configs[1]
    config = configs[0]
    assert config.architecture == "gemma2" and config.layer_windows == (8, 0, 8, 0)
    assert (config.attention_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert (config.rope_theta, config.local_rope_theta, config.rope_linear_factor) == (1e4, 0.0, 1.0)
    assert config.attention_scale == 32**-0.5 and config.embedding_multiplier == 64**0.5
    assert config.norm_offset == 1.0 and config.sandwich_norms and not config.qk_norm
    no_caps = model_config_from_hf({**old, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (no_caps.attention_softcap, no_caps.final_logit_softcap) == (0.0, 0.0)


def test_a_fused_checkpoint_tensor_of_the_wrong_size_is_refused() -> None:
    hf, _ = build_pair("phi3")
    config = model_config_from_hf(hf.config.to_dict())
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(100, 64)
    with pytest.raises(ValueError, match=r"qkv_proj.weight.*has 100 rows, expected the 128 of its parts"):
        get_model_class(config.architecture)(config).load_weights(state.items())


def test_smollm3_configs_read_their_nope_layers_and_windows_only_when_asked() -> None:
    base = {**SMALL, "model_type": "smollm3", "num_hidden_layers": 8}
    assert model_config_from_hf(base).nope_layers == (3, 7)  # every 4th layer by default, as transformers
    listed = model_config_from_hf({**base, "no_rope_layers": [1, 0, 1, 1, 1, 1, 0, 0]})
    assert listed.nope_layers == (1, 6, 7) and not listed.uses_rope(6) and listed.uses_rope(0)
    windows = {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 4}
    assert model_config_from_hf({**base, **windows}).layer_windows == ()  # use_sliding_window is off
    assert model_config_from_hf({**base, **windows, "use_sliding_window": True}).layer_windows == (16, 0) * 4
    with pytest.raises(ValueError, match="one entry for each of the 8 layers"):
        model_config_from_hf({**base, "no_rope_layers": [1, 0]})


def test_sarvam_configs_read_as_released_or_as_transformers_writes_them() -> None:
    """Sarvam's released configs (written for its own code) name the experts `num_experts` / `num_shared_experts`,
    q/k/v biases `use_qkv_bias` and YaRN "deepseek_yarn", and store the 105B's cache row as `head_dim`: each reads
    as transformers' own form of it does."""
    moe = {"model_type": "sarvam_moe", "num_hidden_layers": 2, "n_routed_experts": 8, "n_shared_experts": 1,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "attention_bias": True, "head_dim": 16}  # fmt: skip
    released_moe = {k: v for k, v in moe.items() if k not in ("n_routed_experts", "n_shared_experts", "attention_bias")}
    released_moe.update(num_experts=8, num_shared_experts=1, use_qkv_bias=True)
    assert model_config_from_hf({**SMALL, **released_moe}) == model_config_from_hf({**SMALL, **moe})
    served = model_config_from_hf({**SMALL, **moe})
    assert served.qk_norm and served.attention_bias and served.rotary_dim == 16 and served.dense_layers == (0,)
    yarn = {"factor": 4.0, "original_max_position_embeddings": 64, "mscale_all_dim": 1.0, "mscale": 1.0,
            "beta_fast": 32, "beta_slow": 1}  # fmt: skip
    mla = {"model_type": "sarvam_mla", "kv_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
           "v_head_dim": 10, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, **yarn}}
    released_mla = {**{k: v for k, v in mla.items() if k not in ("n_routed_experts", "n_shared_experts")},
                    "num_experts": 8, "num_shared_experts": 1, "head_dim": 32, "q_head_dim": 20,
                    "rope_scaling": {"type": "deepseek_yarn", **yarn}, "rope_theta": 10000.0}  # fmt: skip
    del released_mla["rope_parameters"]
    assert model_config_from_hf({**SMALL, **released_mla}) == model_config_from_hf({**SMALL, **mla})


def test_mistral3_configs_read_their_text_model() -> None:
    """A multimodal Mistral 3 checkpoint's config is its text model's: Mistral Small 3.1's `mistral` (no query
    scale), Ministral 3's `ministral3` (its `llama_4_scaling_beta` over the rope's original context); the top
    level's word-embedding tie wins; another text family is refused. Its images (a Pixtral tower) are Mistral 3's."""
    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16384,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
    ministral3 = {**SMALL, "model_type": "ministral3", "rope_parameters": rope, "max_position_embeddings": 262144}
    config = model_config_from_hf({"model_type": "mistral3", "text_config": ministral3, "vision_config": {}})
    assert config.architecture == "llama" and (config.query_scale_beta, config.query_scale_positions) == (0.1, 16384)
    assert config.rope_scaling is not None and config.max_position_embeddings == 262144
    assert config.multimodal is not None and config.multimodal.images is not None  # (its Pixtral tower's images)
    assert config.multimodal.images.encoder == "mistral3"
    assert replace(config, multimodal=None) == model_config_from_hf(ministral3)
    small = {**SMALL, "model_type": "mistral", "tie_word_embeddings": True}
    config = model_config_from_hf({"model_type": "mistral3", "text_config": small, "tie_word_embeddings": False})
    assert config.query_scale_beta == 0.0 and not config.tie_word_embeddings
    with pytest.raises(ValueError, match="mistral3 text_config model_type 'qwen2' is not supported"):
        model_config_from_hf({"model_type": "mistral3", "text_config": {**SMALL, "model_type": "qwen2"}})


def test_llama4_configs_read_their_layers() -> None:
    text = {**SMALL, "model_type": "llama4_text", "num_hidden_layers": 8, "intermediate_size": 32,
            "intermediate_size_mlp": 96, "num_local_experts": 4, "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 2, "attention_chunk_size": 8192}  # fmt: skip
    config = model_config_from_hf(text)
    assert config.architecture == "llama4" and config.nope_layers == (3, 7)  # every 4th, as transformers
    assert config.dense_layers == (0, 2, 4, 6) and config.moe_input_scaled and not config.shared_expert_gated
    assert (config.intermediate_size, config.moe_intermediate_size, config.shared_expert_intermediate_size) == (
        96, 32, 32)  # fmt: skip
    assert config.qk_unit_norm and (config.nope_temperature_scale, config.nope_temperature_floor) == (0.1, 8192)
    assert config.attention_chunk == 8192 and config.o_proj_bias is False
    untuned = model_config_from_hf({**text, "attn_temperature_tuning": False, "use_qk_norm": False})
    assert untuned.nope_temperature_scale == 0.0 and not untuned.qk_unit_norm
    multimodal = {"model_type": "llama4", "text_config": text, "vision_config": {}}
    assert model_config_from_hf(multimodal) == config


def test_the_first_gpt2_checkpoints_bare_names_and_mask_buffers_load() -> None:
    """gpt2's own checkpoint names its tensors without `transformer.` (`h.0.attn.c_attn.weight`, `wte.weight`) and
    holds each attention's causal-mask buffers (`attn.bias`, `attn.masked_bias`): read as transformers reads them, the
    model is the one loaded from transformers' names."""
    hf, ours = build_pair("gpt2")
    bare = {name.removeprefix("transformer."): tensor for name, tensor in hf.state_dict().items()
            if name != "lm_head.weight"}  # fmt: skip
    for layer in range(2):
        bare[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8, dtype=torch.bool))
        bare[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    first = get_model_class(ours.config.architecture)(ours.config).eval()
    first.load_weights(bare.items())
    tokens = random_tokens(9, 3)
    torch.testing.assert_close(PagedRunner(first).step([(0, tokens)]), hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_deepseek_v4_configs_read_as_transformers_fills_them_in() -> None:
    """A DeepSeek-V4 config in the released keys (per-layer `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
    the compressing layers' YaRN as a flat `rope_scaling`, `compress_rope_theta`) and as transformers writes it back
    read the same: its layer kinds and rates, hash layers, rope share and both ropes as transformers builds them
    (YaRN's attention factor 1); without layer kinds, V4-Pro's default schedule. Refused by name: another
    activation, another rope type, heads that do not split into `o_groups`."""
    released = {
        **SMALL, "model_type": "deepseek_v4", "num_hidden_layers": 5, "head_dim": 16, "qk_rope_head_dim": 8,
        "q_lora_rank": 24, "compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 2, "compress_rope_theta": 40000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1},
        "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "hc_mult": 3,
        "hc_sinkhorn_iters": 7, "routed_scaling_factor": 2.5,
    }  # fmt: skip
    theirs = transformers.DeepseekV4Config.from_dict(copy.deepcopy(released))  # (it adds keys to `rope_scaling`)
    kinds = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
             "heavily_compressed_attention": "hca"}  # fmt: skip
    assert theirs.rope_parameters["compress"]["rope_type"] == "yarn"
    for raw in (released, theirs.to_dict()):
        ours = model_config_from_hf(raw)
        layout = ours.compressed_attention
        assert layout is not None and layout.kinds == tuple(kinds[kind] for kind in theirs.layer_types)
        assert layout.rates == (0, 4, 128, 4, 0) and layout.rope_dim == theirs.qk_rope_head_dim == 8
        assert layout.hash_layers == tuple(i for i, kind in enumerate(theirs.mlp_layer_types) if kind == "hash_moe")
        assert layout.hash_layers == (0, 1) and all(ours.is_moe_layer(i) for i in range(5))
        assert ours.rope_theta == 10000.0 and layout.compress_rope_theta == 40000.0
        yarn = layout.compress_yarn
        assert yarn is not None and (yarn.factor, yarn.original_max_position_embeddings) == (16.0, 64)
        assert yarn.attention_factor == theirs.rope_parameters["compress"]["attention_factor"] == 1.0
        assert ours.hyper_connections == HyperConnections(streams=3, eps=1e-6, sinkhorn_iters=7)
        assert (ours.moe_scoring, ours.swiglu_limit, ours.swiglu_up_offset) == ("sqrtsoftplus", 10.0, 0.0)
        # (`intermediate_size`, 96, is transformers' other name of `moe_intermediate_size`, and wins)
        assert ours.moe_intermediate_size == ours.shared_expert_intermediate_size == theirs.moe_intermediate_size == 96
        assert not ours.shared_expert_gated
        assert [ours.layer_head_dim(i) for i in range(5)] == [16, 112, 32, 112, 16]  # each layer's cache rows
    plain = {key: value for key, value in released.items() if key != "compress_ratios"}
    pro = model_config_from_hf(plain).compressed_attention
    assert pro is not None
    pro_layers = transformers.DeepseekV4Config.from_dict(copy.deepcopy(plain)).layer_types
    assert pro.kinds == tuple(kinds[kind] for kind in pro_layers)
    for change, message in (({"hidden_act": "gelu"}, "hidden_act"), ({"rope_scaling": {"type": "linear"}}, "linear"),
                            ({"o_groups": 3}, "o_groups")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            model_config_from_hf({**released, **change})


def test_deepseek_v4_reads_deepseeks_released_names() -> None:
    """A DeepSeek-V4 checkpoint under DeepSeek's released names (no `model.` prefix; `embed`, `head`, `attn` and
    `ffn` blocks, `wq_a` ... `wo_b`, `hc_*_fn`, `ape`, per-expert `w1` / `w2` / `w3`, the indexer's compressor under
    `indexer.compressor`) and its prediction layers (`mtp.`) loads into the model transformers' names load."""
    hf, ours = build_pair("deepseek-v4")
    layers = ours.config.num_hidden_layers
    released = {}
    for name, tensor in hf.state_dict().items():
        for theirs, deepseeks in ((".self_attn.compressor.indexer.scorer.weights_proj.", ".attn.indexer.weights_proj."),
                                  (".self_attn.compressor.indexer.q_b_proj.", ".attn.indexer.wq_b."),
                                  (".compressor.indexer.", ".indexer.compressor."), (".self_attn.", ".attn."),
                                  (".mlp.", ".ffn."), (".input_layernorm.", ".attn_norm."),
                                  (".post_attention_layernorm.", ".ffn_norm."), (".attn_hc.", ".hc_attn_"),
                                  (".ffn_hc.", ".hc_ffn_"), (".sinks", ".attn_sink"), (".kv_norm.", ".norm."),
                                  (".position_bias", ".ape"), (".q_a_proj.", ".wq_a."), (".q_b_proj.", ".wq_b."),
                                  (".kv_proj.", ".wkv."), (".gate_proj.", ".wgate."), (".o_a_proj.", ".wo_a."),
                                  (".o_b_proj.", ".wo_b."), (".q_a_norm.", ".q_norm."),
                                  (".gate.e_score_correction_bias", ".gate.bias"),
                                  ("model.hc_head.hc_", "hc_head_"), ("model.embed_tokens.", "embed."),
                                  ("lm_head.", "head."), ("model.", "")):  # fmt: skip
            name = name.replace(theirs, deepseeks)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stem = name.rpartition(".")[0]
            for expert, weight in enumerate(tensor):
                if name.endswith("gate_up_proj"):
                    gate, up = weight.chunk(2)
                    released |= {f"{stem}.{expert}.w1.weight": gate, f"{stem}.{expert}.w3.weight": up}
                else:
                    released[f"{stem}.{expert}.w2.weight"] = weight
            continue
        released[name.replace("shared_experts.wgate.", "shared_experts.w1.").replace(
            "shared_experts.up_proj.", "shared_experts.w3.").replace("shared_experts.down_proj.", "shared_experts.w2.")
        ] = tensor  # fmt: skip
    assert "layers.1.attn.indexer.compressor.wkv.weight" in released and "hc_head_fn" in released
    released[f"mtp.0.layers.{layers}.attn.wq_a.weight"] = torch.zeros(1)
    again = get_model_class("deepseek_v4")(ours.config)
    again.load_weights(released.items())
    tokens = random_tokens(21, 4)
    torch.testing.assert_close(PagedRunner(again.eval()).step([(0, tokens)]), hf_logits(hf, tokens), atol=1e-4,
                               rtol=1e-4)  # fmt: skip


def test_longcat_flash_configs_read_as_released_and_as_transformers_writes_them() -> None:
    """A LongCat-Flash config in its released keys (`num_layers`, `ffn_hidden_size`, `expert_ffn_hidden_size`,
    `moe_topk`, `zero_expert_num`, the flags of its latents' LoRA scales) and as transformers writes it back reads as
    transformers builds the model: a layer a block (twice `num_layers`), every MLP dense, the experts beside each
    pair, zero experts, the latents' norms at 1e-6. Refused by name: zero experts other than the identity, latents
    without their scales, a biased router."""
    released = {
        **SMALL, "model_type": "longcat_flash", "num_layers": 3, "num_key_value_heads": 4, "ffn_hidden_size": 48,
        "expert_ffn_hidden_size": 32, "n_routed_experts": 8, "zero_expert_num": 4, "zero_expert_type": "identity",
        "moe_topk": 3, "routed_scaling_factor": 6.0, "q_lora_rank": 48, "kv_lora_rank": 24, "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 8, "v_head_dim": 10, "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
        "rms_norm_eps": 1e-5, "rope_theta": 10000000.0,
    }  # fmt: skip
    # (its configs count `num_layers` and name the widths their own way; transformers' other names win)
    del released["num_hidden_layers"], released["intermediate_size"]
    theirs = transformers.LongcatFlashConfig.from_dict(copy.deepcopy(released))
    assert model_config_from_hf({**released, "num_hidden_layers": 4}).num_hidden_layers == 4
    assert model_config_from_hf({**released, "intermediate_size": 96}).intermediate_size == 96
    for raw in (released, theirs.to_dict()):
        ours = model_config_from_hf(raw)
        assert ours.num_hidden_layers == theirs.num_hidden_layers == 6 and ours.shortcut_experts
        assert not any(ours.is_moe_layer(i) for i in range(6)) and ours.intermediate_size == 48
        assert (ours.num_experts, ours.zero_experts, ours.num_experts_per_tok) == (8, 4, theirs.moe_topk)
        assert ours.moe_intermediate_size == 32 and not ours.norm_topk_prob and ours.routed_scaling_factor == 6.0
        assert ours.mlp_widths == {"intermediate_size": 48, "moe_intermediate_size": 32}
        mla = ours.latent_attention
        assert mla is not None and mla.rope_interleave and mla.latent_norm_eps == 1e-6 and ours.rms_norm_eps == 1e-5
        assert ours.rope_theta == 10000000.0
    for change, message in (({"zero_expert_type": "zero"}, "zero_expert_type"),
                            ({"mla_scale_q_lora": False}, "mla_scale_q_lora"),
                            ({"router_bias": True}, "router_bias")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            model_config_from_hf({**released, **change})


@pytest.mark.parametrize("unified", [False, True])
def test_gemma4_assistant_configs_read_as_drafters_over_their_targets_k_v(unified: bool) -> None:
    """A Gemma 4 assistant's config (Gemma 4 12B's `gemma4_unified_assistant` too) reads as its text model's, every
    layer attending over the target's K/V (`kv_sources` -1: queries alone), its windows one key wider, its drafting
    shape from the assistant's keys (transformers' defaults where absent); its text model must be Gemma 4's."""
    text_class = transformers.Gemma4UnifiedTextConfig if unified else transformers.Gemma4TextConfig
    assistant_class = transformers.Gemma4UnifiedAssistantConfig if unified else transformers.Gemma4AssistantConfig
    text = text_class(**{**SMALL, "head_dim": 16, "sliding_window": 6, "num_hidden_layers": 2,
                         "layer_types": ["sliding_attention", "full_attention"]},
                      **({} if unified else {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                             "use_double_wide_mlp": False}))  # fmt: skip
    released = assistant_class(text_config=text.to_dict(), use_ordered_embeddings=True, num_centroids=8).to_dict()
    del released["backbone_hidden_size"]
    config = model_config_from_hf(released)
    assert config.architecture == "gemma4" and config.gemma4 is not None and config.gemma4.kv_sources == (-1, -1)
    assert config.layer_windows == (7, 0) and config.tie_word_embeddings
    assert config.assistant == Gemma4Assistant(backbone_hidden_size=3840 if unified else 1536, centroids=8,
                                               centroid_top_k=32)  # fmt: skip
    with pytest.raises(ValueError, match="text model must be Gemma 4's, not 'llama'"):
        model_config_from_hf({**released, "text_config": {**released["text_config"], "model_type": "llama"}})


def test_beam_scales_its_nope_queries_as_transformers_does() -> None:
    """Beam's full (NoPE) layers scale each query by `(1 + (p + 1) / 2048) ** 0.1` (transformers'
    `compute_attention_scaling`: too close to 1 at the other tests' positions for them to see), read from one table
    at positions to 128k; its windowed layers' queries are not scaled."""
    from transformers.models.beam.modeling_beam import compute_attention_scaling

    config = model_config_from_hf(transformers.BeamConfig(**{**SMALL, **BEAM, "max_position_embeddings": 1 << 17})
                                  .to_dict())  # fmt: skip
    assert config.nope_layers == (1, 3)
    full = PagedSelfAttention(config, torch.float32, window=0, rope=False, index=1)
    positions = torch.arange(0, 1 << 17, 997)
    theirs = compute_attention_scaling(positions[None])[0, 0, :, 0]
    torch.testing.assert_close(full._temperature(positions, torch.float32)[:, 0, 0], theirs, rtol=1e-6, atol=0)
    assert not PagedSelfAttention(config, torch.float32, window=6, rope=True, index=0).temperature


def test_minimax_configs_read_as_released_and_as_transformers_writes_them() -> None:
    """A MiniMax-01 config in its released keys (`attn_type_list` with 1 for softmax attention, `layernorm_*_alpha` /
    `_beta`, `postnorm`, `rotary_dim` over half of each head) and transformers' (`layer_types`, `*_alpha_factor`)
    read alike: the lightning layers, the blocks' scales, Mixtral's experts. Refused by name: `postnorm` false, a
    sliding window, another activation."""
    released = {
        **SMALL, "model_type": "minimax", "num_hidden_layers": 4, "head_dim": 16, "rotary_dim": 8,
        "attn_type_list": [0, 0, 0, 1], "layernorm_full_attention_alpha": 3.5, "layernorm_full_attention_beta": 1.0,
        "layernorm_linear_attention_alpha": 3.5, "layernorm_linear_attention_beta": 1.0, "layernorm_mlp_alpha": 3.5,
        "layernorm_mlp_beta": 1.0, "postnorm": True, "num_local_experts": 4, "num_experts_per_tok": 2,
        "block_size": 256,
    }  # fmt: skip
    ours = model_config_from_hf(released)
    lightning, scales = ours.lightning, ours.normed_residuals
    assert lightning is not None and lightning.layers == (0, 1, 2) and lightning.heads == 4
    assert scales is not None and scales.full == scales.linear == scales.mlp == (3.5, 1.0)
    assert ours.rotary_dim == 8 and (ours.num_experts, ours.num_experts_per_tok) == (4, 2) and ours.norm_topk_prob
    named = {**SMALL, "num_hidden_layers": 4, "head_dim": 16, "full_attn_alpha_factor": 2.0, "mlp_beta_factor": 0.5,
             "layer_types": ["linear_attention", "full_attention"] * 2, "num_local_experts": 4}  # fmt: skip
    theirs = transformers.MiniMaxConfig(**named).to_dict()
    ours = model_config_from_hf(theirs)
    assert ours.lightning is not None and ours.lightning.layers == (0, 2)
    assert ours.normed_residuals == NormedResiduals(full=(2.0, 1.0), mlp=(1.0, 0.5))
    for change, message in (({"postnorm": False}, "postnorm"), ({"sliding_window": 64}, "sliding_window"),
                            ({"hidden_act": "gelu"}, "hidden_act")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            model_config_from_hf({**released, **change})
