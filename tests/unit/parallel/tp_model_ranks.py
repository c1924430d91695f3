"""What each gloo rank of tests/unit/parallel/test_tp_model.py runs, in a module of its own.

The ranks are forks of the engine's worker forkserver (tests/unit/parallel/ranks.py); this module imports torch
and the engine but not transformers, which would double what a rank imports. The test builds the Hugging Face model
and hands every rank its config, its full state dict and transformers' logits.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from engine_server.attention_metadata import AttentionMetadata, allocate_kv_cache
from engine_server.config import ModelConfig
from engine_server.models import CausalLM, get_model_class
from engine_server.parallel.group import SINGLE, TensorParallel, destroy_tensor_parallel, init_tensor_parallel

BLOCK_SIZE = 4


def ours(config: ModelConfig, state: dict[str, torch.Tensor], tp: TensorParallel) -> CausalLM:
    """Our model of `config` on `tp`, each layer loading its slice of the full tensors in `state`."""
    model = get_model_class(config.architecture)(config, tp=tp)
    model.load_weights(state.items())
    return model.eval()


def first_prompt(vocab: int) -> list[int]:
    """The first sequence of `run_steps`' first step."""
    tokens: list[int] = torch.randint(0, vocab, (5,), generator=torch.Generator().manual_seed(5)).tolist()
    return tokens


def run_steps(model: CausalLM) -> list[torch.Tensor | None]:
    """Two paged steps (the test's module docstring); each step's logits of every new token (None off rank 0)."""
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


def rank_main(
    rank: int,
    size: int,
    init_method: str,
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    hf_logits: torch.Tensor,
) -> None:
    """Run the steps sharded; on rank 0 compare with the unsharded model and with transformers' `hf_logits` (the
    logits of `first_prompt`)."""
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, init_method, torch.device("cpu"), timeout=timedelta(seconds=60))
    try:
        sharded = run_steps(ours(config, state, tp))
        if not tp.is_driver:
            assert all(logits is None for logits in sharded)
            return
        reference = run_steps(ours(config, state, SINGLE))
        for got, expected in zip(sharded, reference, strict=True):
            assert got is not None and expected is not None
            assert got.shape == expected.shape == (expected.shape[0], config.vocab_size)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        first = sharded[0]
        assert first is not None  # the first step's first sequence, against transformers as well
        torch.testing.assert_close(first[:5], hf_logits, rtol=1e-4, atol=1e-4)
    finally:
        destroy_tensor_parallel(tp)
