"""Mixture-of-experts decode steps recorded in CUDA graphs: the evidence for letting MoE models capture them.

`model_loading._captures_decode_graphs` keeps every MoE model eager: its reason (an expert's GEMM sized by the tokens
routed to it) was the CPU path's, and the Triton fused-MoE kernels that CUDA runs align the pairs with fixed shapes
and no host sync, so they should record. This test lifts the guard for one engine and checks that decode steps
replay graphs and give exactly the eager engine's greedy tokens, float and FP8 experts alike: in float32 every
row's sums are its own (padding rows add pairs to a block, not to a row's sums). When it passes on a GPU, the guard
can go. Skipped without CUDA (FP8 below compute capability 8.9).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine_server import LLM, SamplingParams, model_loading
from engine_server.config import CacheConfig, EngineConfig
from tests.families import save_family

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = [[17, 3000, 45, 902, 12], [5, 77], [40000, 123, 9, 9, 9, 801, 2024, 7], [300, 301]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [r.choices[0].token_ids for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_moe_decode_graphs_replay_the_eager_steps(
    quantization: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    folder = save_family(tmp_path / "moe", "qwen3-moe", head_spread=1.0)
    config = EngineConfig(
        model=str(folder), device="cuda", dtype="float32", quantization=quantization,  # type: ignore[arg-type]
        cache=CacheConfig(memory_bytes=256 * 1024**2),
    )
    with LLM(config=dataclasses.replace(config, enforce_eager=True)) as eager:
        assert eager.core.runner.decode_graphs is None
        theirs = _tokens(eager)
    monkeypatch.setattr(model_loading, "_captures_decode_graphs", lambda loaded, config: not config.enforce_eager)
    with LLM(config=config) as llm:
        graphs = llm.core.runner.decode_graphs
        assert graphs is not None
        ours = _tokens(llm)
        assert sum(graphs.replays.values()) > 0
    assert ours == theirs
