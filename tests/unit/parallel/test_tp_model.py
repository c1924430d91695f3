"""A whole model sharded over 2 and 3 gloo ranks gives TP=1's logits, for every family and head layout.

Each rank builds the same tiny random Hugging Face model (seeded), loads its shards of the state dict into our
model (`CausalLM(config, tp=...)`, each layer keeping its slice of the full tensors), allocates its KV cache of
its own heads and runs the same paged steps: a mixed prefill of three sequences, then a step where one continues
its prompt in a chunk beside two decodes. Rank 0 compares its gathered logits with the unsharded model's (the
same steps on one process) and with transformers'. The other ranks must get None from `compute_logits`.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from engine_server.attention_metadata import AttentionMetadata, allocate_kv_cache, kv_cache_bytes_per_block
from engine_server.config import ModelConfig
from engine_server.models import CausalLM, get_model_class
from engine_server.parallel.group import SINGLE, TensorParallel, destroy_tensor_parallel, init_tensor_parallel

BLOCK_SIZE = 4
# name -> (config class, config, group size). Head layouts: KV heads split one per rank, replicated over ranks,
# several per rank; a vocabulary that 3 does not divide (padded); biases on q/k/v and o (Llama, Qwen3), q/k norms
# (Qwen3).
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
}
SMALL: dict[str, Any] = dict(
    vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128
)
MODEL_CLASSES = {
    transformers.LlamaConfig: transformers.LlamaForCausalLM,
    transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
    transformers.Qwen3Config: transformers.Qwen3ForCausalLM,
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


def _ours(hf: transformers.PreTrainedModel, tp: TensorParallel) -> CausalLM:
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    model = get_model_class(config.architecture)(config, tp=tp)
    model.load_weights(hf.state_dict().items())
    return model.eval()


def _run_steps(model: CausalLM) -> list[torch.Tensor | None]:
    """Two paged steps (module docstring); each step's logits of every new token (None off rank 0)."""
    vocab = model.config.vocab_size
    tokens = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 7)]
    caches = allocate_kv_cache(model.config, 16, BLOCK_SIZE, torch.float32, "cpu", tp_size=model.tp.size)
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    steps = [
        # (query tokens per sequence, tokens already cached per sequence)
        ([tokens[0], tokens[1][:4], tokens[2]], [0, 0, 0]),
        ([[11], tokens[1][4:], [12]], [5, 4, 7]),
    ]
    results = []
    for queries, cached in steps:
        ids = [t for query in queries for t in query]
        positions = [p for query, start in zip(queries, cached, strict=True) for p in range(start, start + len(query))]
        seq_lens = [start + len(query) for query, start in zip(queries, cached, strict=True)]
        meta = AttentionMetadata.build([len(q) for q in queries], seq_lens, tables, BLOCK_SIZE, "cpu")
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
            results.append(model.sharded_logits(hidden))
    return results


def _rank_main(rank: int, size: int, init_method: str, case: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, init_method, torch.device("cpu"), timeout=timedelta(seconds=60))
    try:
        hf = _hf_model(case)
        sharded = _run_steps(_ours(hf, tp))
        if not tp.is_driver:
            assert all(logits is None for logits in sharded)
            return
        reference = _run_steps(_ours(hf, SINGLE))
        for got, expected in zip(sharded, reference, strict=True):
            assert got is not None and expected is not None
            assert got.shape == expected.shape == (expected.shape[0], hf.config.vocab_size)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        with torch.inference_mode():  # the first step's first sequence, against transformers as well
            hf_logits = hf(torch.tensor([_first_prompt(hf.config.vocab_size)])).logits[0].float()
        first = sharded[0]
        assert first is not None
        torch.testing.assert_close(first[:5], hf_logits, rtol=1e-4, atol=1e-4)
    finally:
        destroy_tensor_parallel(tp)


def _first_prompt(vocab: int) -> list[int]:
    tokens: list[int] = torch.randint(0, vocab, (5,), generator=torch.Generator().manual_seed(5)).tolist()
    return tokens


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_a_sharded_model_gives_the_unsharded_logits(case: str, tmp_path: Path) -> None:
    size = CASES[case][2]
    mp.spawn(_rank_main, args=(size, f"file://{tmp_path / 'rendezvous'}", case), nprocs=size, join=True)


def test_each_rank_caches_only_its_kv_heads() -> None:
    config = ModelConfig.from_hf_config(transformers.Qwen2Config(**{**SMALL, "num_key_value_heads": 2}).to_dict())
    full = kv_cache_bytes_per_block(config, BLOCK_SIZE, torch.float32)
    assert kv_cache_bytes_per_block(config, BLOCK_SIZE, torch.float32, tp_size=2) == full // 2
    assert kv_cache_bytes_per_block(config, BLOCK_SIZE, torch.float32, tp_size=4) == full // 2  # replicated heads
    caches = allocate_kv_cache(config, 3, BLOCK_SIZE, torch.float32, "cpu", tp_size=2)
    assert caches[0].shape == (2, 3, BLOCK_SIZE, 1, config.head_dim)
