"""`dummy:<preset>` models: named architectures with seeded random weights, for benchmarks without weights.

Weights are generated lazily, one tensor at a time, each from its own generator seeded by a digest of (seed, name), so a
tensor's values do not depend on iteration order or on which other tensors were generated.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import replace

import torch

from engine_server.config import ModelConfig, RopeScaling
from engine_server.hf_config import model_config_from_hf
from engine_server.loader.layout import is_norm_weight, parameter_shapes

INIT_STD = 0.02

# Dummy models reuse the embedded SmolLM2 tokenizer, so their special ids are SmolLM2's.
_BOS, _EOS = 1, 2

# Gemma 4's presets as transformers' `Gemma4TextConfig` arguments (`benchmarks.common.hf_model` builds the peer from
# them). Neither is a released model's shape: each has every Gemma 4 feature (windowed layers 4 to each full one, the
# full-attention layers' heads twice as wide with values from the keys' projection, the last layers over earlier
# ones' K/V with double-wide MLPs, per-layer inputs, soft-capped logits) at a test's scale (`gemma4-tiny`) and a
# 2-core CPU benchmark's (`gemma4-small`: 15 layers, 1,024 wide, one KV head, ~0.5B parameters).
_GEMMA4_LAYER_TYPES = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(15)]
_GEMMA4_FEATURES: dict[str, object] = {
    "model_type": "gemma4_text", "vocab_size": 49152, "attention_k_eq_v": True, "use_double_wide_mlp": True,
    "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "sliding_window": 512,
    "layer_types": _GEMMA4_LAYER_TYPES,
}  # fmt: skip
GEMMA4_HF_CONFIGS: dict[str, dict[str, object]] = {
    "gemma4-tiny": {
        **_GEMMA4_FEATURES, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 10,
        "layer_types": _GEMMA4_LAYER_TYPES[:10], "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "global_head_dim": 128, "num_global_key_value_heads": 1, "num_kv_shared_layers": 3,
        "hidden_size_per_layer_input": 64, "vocab_size_per_layer_input": 49152, "max_position_embeddings": 8192,
    },
    "gemma4-small": {
        **_GEMMA4_FEATURES, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 15,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
        "num_global_key_value_heads": 1, "num_kv_shared_layers": 5, "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 49152, "max_position_embeddings": 32768,
    },
}  # fmt: skip
# Gemma 3n's presets as transformers' `Gemma3nTextConfig` arguments: a test's (`gemma3n-tiny`: 10 layers 256 wide,
# AltUp's four streams, the first two MLPs sparse, the last three layers over earlier ones' K/V) and the released
# E2B's and E4B's text models (`gemma-3n-e2b`, `gemma-3n-e4b`: 30 and 35 layers 2,048 wide, 262,400 tokens, the
# per-layer table 262,144 rows of 256 per layer).
_GEMMA3N_FEATURES: dict[str, object] = {
    "model_type": "gemma3n_text", "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "sliding_window": 512, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
    "hidden_size_per_layer_input": 256, "laurel_rank": 64, "altup_num_inputs": 4, "tie_word_embeddings": True,
}  # fmt: skip
GEMMA3N_HF_CONFIGS: dict[str, dict[str, object]] = {
    "gemma3n-tiny": {
        **_GEMMA3N_FEATURES, "vocab_size": 49152, "vocab_size_per_layer_input": 49152, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 10, "num_attention_heads": 4, "head_dim": 64,
        "num_kv_shared_layers": 3, "hidden_size_per_layer_input": 64, "laurel_rank": 16,
        "activation_sparsity_pattern": [0.95, 0.95] + [0.0] * 8, "max_position_embeddings": 8192,
    },
    "gemma-3n-e2b": {
        **_GEMMA3N_FEATURES, "vocab_size": 262_400, "vocab_size_per_layer_input": 262_144, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 30, "num_kv_shared_layers": 10,
    },
    "gemma-3n-e4b": {
        **_GEMMA3N_FEATURES, "vocab_size": 262_400, "vocab_size_per_layer_input": 262_144, "hidden_size": 2048,
        "intermediate_size": 16_384, "num_hidden_layers": 35, "num_kv_shared_layers": 15,
    },
}  # fmt: skip
# The state space models alone (`hf_mamba`) as transformers' config arguments (the peer is built from them): a
# test's Mamba and Mamba-2 (`mamba-tiny`, `mamba2-tiny`), mamba-130m's and mamba2-130m's shapes (the CPU benchmark's,
# over this tokenizer's vocabulary), Falcon Mamba 7B's and Mamba-Codestral 7B's (the GPU's: 64 layers 4,096 wide,
# their own vocabularies).
STATE_SPACE_HF_CONFIGS: dict[str, dict[str, object]] = {
    "mamba-tiny": {"model_type": "mamba", "vocab_size": 49152, "hidden_size": 64, "num_hidden_layers": 3,
                   "state_size": 8, "time_step_rank": 32, "tie_word_embeddings": True},
    "mamba2-tiny": {"model_type": "mamba2", "vocab_size": 49152, "hidden_size": 64, "num_hidden_layers": 3,
                    "num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 2, "tie_word_embeddings": True},
    "mamba-130m": {"model_type": "mamba", "vocab_size": 49152, "hidden_size": 768, "num_hidden_layers": 24,
                   "state_size": 16, "tie_word_embeddings": True},
    "mamba2-130m": {"model_type": "mamba2", "vocab_size": 49152, "hidden_size": 768, "num_hidden_layers": 24,
                    "num_heads": 24, "head_dim": 64, "state_size": 128, "n_groups": 1, "tie_word_embeddings": True},
    "falcon-mamba-7b": {"model_type": "falcon_mamba", "vocab_size": 65024, "hidden_size": 4096,
                        "num_hidden_layers": 64, "state_size": 16, "time_step_rank": 256, "mixer_rms_eps": 1e-6,
                        "tie_word_embeddings": False},
    "mamba-codestral-7b": {"model_type": "mamba2", "vocab_size": 32768, "hidden_size": 4096, "num_hidden_layers": 64,
                           "num_heads": 128, "head_dim": 64, "state_size": 128, "n_groups": 8,
                           "tie_word_embeddings": False},
}  # fmt: skip

DUMMY_PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:smollm2-135m",
    ),
    "qwen2.5-0.5b": ModelConfig(
        architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        attention_bias=True, bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:qwen2.5-0.5b",
    ),
    # Qwen2's layout (biases on q/k/v, tied head, 2 KV heads: one per rank at TP=2) at a toy size, for tests that
    # run it end to end on the CPU, where only the plumbing and the sums matter, not the size.
    "qwen2-tiny": ModelConfig(
        architecture="qwen2", vocab_size=49152, hidden_size=256, intermediate_size=768,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        attention_bias=True, bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:qwen2-tiny",
    ),
    "llama-3.2-1b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=RopeScaling(
            factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
        bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:llama-3.2-1b",
    ),
    # The 8B class people deploy (Llama 3.1 8B's shapes, untied head): the GPU benchmark's large model.
    "llama-3.1-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
        bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:llama-3.1-8b",
    ),
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
        qk_norm=True, bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:qwen3-0.6b",
    ),
    # Qwen3-30B-A3B's shapes: 128 experts of 768, 8 active per token (3.3B of 30.5B parameters active).
    "qwen3-30b-a3b": ModelConfig(
        architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:qwen3-30b-a3b",
    ),
    # Gemma 3 4B's language model (its config.json's text_config; the vision tower is not served): 34 layers, five
    # windowed (1,024 positions, rope base 1e4) to each global one (rope base 1e6, linear scaling x8). Read through
    # `hf_config.model_config_from_hf`, so the preset gets Gemma's quirks exactly as a checkpoint folder would.
    "gemma-3-4b": replace(
        model_config_from_hf({
            "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240,
            "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        }),
        bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:gemma-3-4b",
    ),
    # Moonlight-16B-A3B's shapes (DeepSeek-V3's architecture, its config.json): latent attention (a 512 latent,
    # 128 + 64 key dims, 128 value dims per head, one q_proj), one dense layer, then 64 experts of 1,408, 6 active,
    # and 2 shared ones.
    "moonlight-16b-a3b": replace(
        model_config_from_hf({
            "model_type": "deepseek_v3", "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264,
            "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "n_routed_experts": 64, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "n_shared_experts": 2,
            "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "routed_scaling_factor": 2.446,
            "norm_topk_prob": True, "rope_theta": 50000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "rope_interleave": True,
        }),
        bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:moonlight-16b-a3b",
    ),
    # Kimi-Linear-48B-A3B's shapes (Moonshot's config.json, read as a folder's would be): 27 layers, Kimi Delta
    # Attention (32 heads of 128) on all but layers 4, 8, ..., 24 and 27 (counted from 1), latent attention without
    # rope on those (a 512 latent, 128 + 64 key dims, 128 value dims per head, one q_proj); one dense layer, then
    # 256 experts of 1,024, 8 active, beside a shared one.
    "kimi-linear-48b-a3b": replace(
        model_config_from_hf({
            "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32, "q_lora_rank": None,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
            "moe_intermediate_size": 1024, "first_k_dense_replace": 1, "routed_scaling_factor": 2.446,
            "moe_renormalize": True, "num_expert_group": 1, "topk_group": 1, "moe_router_activation_func": "sigmoid",
            "linear_attn_config": {"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
                                   "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                                   "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]},
            "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        }),
        bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:kimi-linear-48b-a3b",
    ),
    # gpt-oss-20b's shapes (its config.json, read as a folder's would be): 24 layers alternating a 128-position
    # window and full attention, sinks, YaRN x32, 32 experts of 2,880 with biases, 4 active (3.6B of 21B active).
    "gpt-oss-20b": replace(
        model_config_from_hf({
            "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
            "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
            "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
            "num_local_experts": 32, "num_experts_per_tok": 4, "swiglu_limit": 7.0, "attention_bias": True,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        }),
        bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:gpt-oss-20b",
    ),
    # Qwen3.5's layout (three Gated DeltaNet layers, then a gated attention one) at a toy size, for tests that run a
    # dummy hybrid end to end on the CPU.
    "qwen3.5-tiny": replace(
        model_config_from_hf({
            "model_type": "qwen3_5_text", "vocab_size": 49152, "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
            "linear_value_head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0},
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        }),
        bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:qwen3.5-tiny",
    ),
    # A Qwen3.5 of 0.75B parameters (1,024 wide, 24 layers: 18 Gated DeltaNet ones of 16 key and 16 value heads of
    # 128, 6 attention ones of 8 query heads of 256 and 2 KV heads; tied embeddings of Qwen3.5's vocabulary): the
    # CPU benchmark's hybrid (benchmarks/results/offline_cpu_hybrid.jsonl), over a 32k context (a default KV pool
    # holds a whole sequence's).
    "qwen3.5-0.8b": replace(
        model_config_from_hf({
            "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
            "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "full_attention_interval": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        }),
        bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:qwen3.5-0.8b",
    ),
    # Qwen3.5-9B's language model (its config.json's text_config): 32 layers, three Gated DeltaNet layers (16 key
    # heads of 128, 32 value heads of 128) to each gated full-attention one (16 query heads of 256, 4 KV heads, rope
    # over a quarter of each head).
    "qwen3.5-9b": replace(
        model_config_from_hf({
            "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        }),
        bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:qwen3.5-9b",
    ),
    # Qwen3.5-35B-A3B's: 40 layers of that pattern (2 KV heads), each MLP 256 experts of 512, 8 active, beside a
    # gated shared expert of 512 (its config.json has no dense intermediate_size).
    "qwen3.5-35b-a3b": replace(
        model_config_from_hf({
            "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "num_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        }),
        bos_token_id=_BOS, eos_token_ids=(_EOS,), name="dummy:qwen3.5-35b-a3b",
    ),
    **{
        preset: replace(model_config_from_hf(hf), bos_token_id=_BOS, eos_token_ids=(_EOS,),
                        name=f"dummy:{preset}")
        for preset, hf in (GEMMA4_HF_CONFIGS | GEMMA3N_HF_CONFIGS | STATE_SPACE_HF_CONFIGS).items()
    },
}  # fmt: skip


def dummy_config(preset: str, spec: str) -> ModelConfig:
    """The config of a named preset; `ValueError` naming `spec` and the known presets otherwise."""
    if preset not in DUMMY_PRESETS:
        raise ValueError(f"model {spec!r}: unknown dummy preset {preset!r}; known: {sorted(DUMMY_PRESETS)}")
    return DUMMY_PRESETS[preset]


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """One fp32 parameter: ones for norm scales, else N(0, INIT_STD²), seeded by (seed, name)."""
    if is_norm_weight(name):
        return torch.ones(shape)
    # torch's CPU generator keeps only 32 bits of its seed, so fold seed and name into one 32-bit digest.
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}\0{name}".encode()))
    return torch.randn(shape, generator=generator).mul_(INIT_STD)


def iter_random_weights(cfg: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every parameter of `cfg` (see `parameter_shapes`), generating each only when reached."""
    for name, shape in parameter_shapes(cfg).items():
        yield name, random_tensor(name, shape, seed)
