"""`--kv-cache-dtype fp8` on a real GPU: the Triton kernels writing and reading e4m3 rows, CUDA graphs included.

Skipped without CUDA (the kernels are held to their references through Triton's interpreter in tests/unit/kernels).
The reference is the bf16 engine whose KV write rounds every key and value as an FP8 row holds it into its bf16
cache (`round_writes_like_fp8`): the FP8 kernels decode each tile to exactly those values before the same products,
so the two must decode the same tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_server import LLM
from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from tests.gpu.test_decode_graphs_gpu import MODEL, PROMPTS, _first_divergence, _greedy
from tests.unit.test_fp8_kv_cache import round_writes_like_fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CACHE = CacheConfig(memory_bytes=2 * 1024**3)
# No step-time target: the scheduler's prefill chunks and decode rows would follow each engine's measured step times
# (the FP8 engine's first steps compile its kernels), and on a GPU a GEMM's bits depend on its row count, so the two
# engines must batch alike for their tokens to be compared.
SCHEDULER = SchedulerConfig(batch_step_target_s=0)


def test_an_fp8_cache_decodes_with_graphs_as_its_bf16_rounding_does() -> None:
    fp8_cache = dataclasses.replace(CACHE, dtype="fp8")
    fp8 = LLM(config=EngineConfig(model=MODEL, device="cuda", cache=fp8_cache, scheduler=SCHEDULER))
    runner = fp8.core.runner
    assert runner.decode_graphs is not None
    assert all(c.dtype == torch.uint8 and c.shape[-1] == runner.loaded.model_config.head_dim + 4
               for c in runner.kv_caches)
    ours = _greedy(fp8)
    del fp8, runner
    torch.cuda.empty_cache()
    bf16 = LLM(config=EngineConfig(model=MODEL, device="cuda", enforce_eager=True, cache=CACHE, scheduler=SCHEDULER))
    theirs = _greedy(round_writes_like_fp8(bf16))  # eager: its ops are swapped after start-up
    divergences = {p: _first_divergence(a, b) for p, a, b in zip(PROMPTS, ours, theirs, strict=True)}
    assert {p: i for p, i in divergences.items() if i is not None} == {}
