"""A whole model sharded over 2 and 3 gloo ranks gives TP=1's logits, for every family and head layout.

The test builds a tiny random Hugging Face model (seeded) and hands every rank its full state dict; each rank loads
its shards into our model (`CausalLM(config, tp=...)`, each layer keeping its slice of the full tensors), allocates
its KV cache of its own heads and runs the same paged steps: a mixed prefill of three sequences, then a step where
one continues its prompt in a chunk beside two decodes. Rank 0 compares its gathered logits with the unsharded
model's (the same steps on one process) and with transformers'. The other ranks must get None from
`sharded_logits`. The ranks run tests/unit/parallel/tp_model_ranks.py, which spares them importing transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from engine_server.attention_metadata import allocate_kv_cache, kv_cache_bytes_per_block
from engine_server.hf_config import model_config_from_hf
from tests.unit.parallel.ranks import run_ranks
from tests.unit.parallel.tp_model_ranks import BLOCK_SIZE, first_prompt, rank_main

# name -> (config class, config, group size). Head layouts: KV heads split one per rank, replicated over ranks,
# several per rank; a vocabulary that 3 does not divide (padded); biases on q/k/v and o (Llama, Qwen3), q/k norms
# (Qwen3's per head; OLMo 2's and MiniMax-M2's over the whole projection, their squares summed over the ranks, with
# MiniMax-M2's one KV head replicated on three).
CASES: dict[str, tuple[type[Any], dict[str, Any], int]] = {
    "llama-bias-2": (
        transformers.LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False),
        2,
    ),
    "qwen2-tied-replicated-kv-2": (
        transformers.Qwen2Config,
        dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
        2,
    ),
    "qwen3-qk-norm-bias-2": (
        transformers.Qwen3Config,
        dict(num_attention_heads=8, num_key_value_heads=4, head_dim=24, attention_bias=True),
        2,
    ),
    "llama-tied-odd-vocab-3": (
        transformers.LlamaConfig,
        dict(num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True, vocab_size=127),
        3,
    ),
    "qwen2-replicated-kv-3": (
        transformers.Qwen2Config,
        dict(num_attention_heads=6, num_key_value_heads=1, tie_word_embeddings=False),
        3,
    ),
    "olmo2-whole-qk-norm-2": (
        transformers.Olmo2Config,
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
        2,
    ),
    "minimax-m2-whole-qk-norm-replicated-kv-3": (
        transformers.MiniMaxM2Config,
        dict(num_attention_heads=6, num_key_value_heads=1, head_dim=8, rotary_dim=4, num_local_experts=4,
             num_experts_per_tok=2, intermediate_size=48, tie_word_embeddings=False),
        3,
    ),
}
SMALL: dict[str, Any] = dict(
    vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128
)
MODEL_CLASSES = {
    transformers.LlamaConfig: transformers.LlamaForCausalLM,
    transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
    transformers.Qwen3Config: transformers.Qwen3ForCausalLM,
    transformers.Olmo2Config: transformers.Olmo2ForCausalLM,
    transformers.MiniMaxM2Config: transformers.MiniMaxM2ForCausalLM,
}


def _hf_model(case: str) -> transformers.PreTrainedModel:
    config_cls, extra, _ = CASES[case]
    torch.manual_seed(0)
    hf = MODEL_CLASSES[config_cls](config_cls(**{**SMALL, **extra})).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0; perturb them so they are tested
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return hf


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_a_sharded_model_gives_the_unsharded_logits(case: str, tmp_path: Path) -> None:
    size = CASES[case][2]
    hf = _hf_model(case)
    config = model_config_from_hf(hf.config.to_dict())
    with torch.inference_mode():
        hf_logits = hf(torch.tensor([first_prompt(config.vocab_size)])).logits[0].float()
    args = (size, f"file://{tmp_path / 'rendezvous'}", config, dict(hf.state_dict()), hf_logits)
    run_ranks(rank_main, args, size)


def test_each_rank_caches_only_its_kv_heads() -> None:
    config = model_config_from_hf(transformers.Qwen2Config(**{**SMALL, "num_key_value_heads": 2}).to_dict())
    full = kv_cache_bytes_per_block(config, BLOCK_SIZE, torch.float32)
    assert kv_cache_bytes_per_block(config, BLOCK_SIZE, torch.float32, tp_size=2) == full // 2
    assert kv_cache_bytes_per_block(config, BLOCK_SIZE, torch.float32, tp_size=4) == full // 2  # replicated heads
    caches = allocate_kv_cache(config, 3, BLOCK_SIZE, torch.float32, "cpu", tp_size=2)
    assert caches[0].shape == (2, 3, BLOCK_SIZE, 1, config.head_dim)
