"""Mixture-of-experts decode steps recorded in CUDA graphs: the evidence for letting MoE models capture them.

`model_loading._captures_decode_graphs` keeps every MoE model eager: its reason (an expert's GEMM sized by the tokens
routed to it) was the CPU path's, and the Triton fused-MoE kernels that CUDA runs align the pairs with fixed shapes
and no host sync, so they should record. This test lifts the guard for one engine and checks that decode steps
replay graphs and give exactly the eager engine's greedy tokens, float and FP8 experts alike: in float32 every
row's sums are its own (padding rows add pairs to a block, not to a row's sums). When it passes on a GPU, the guard
can go. Skipped without CUDA (FP8 below compute capability 8.9).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_server.config import CacheConfig, EngineConfig
from tests.families import save_family
from tests.unit.test_cuda_graphs import moe_tokens_eager_and_through_graphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_moe_decode_graphs_replay_the_eager_steps(
    quantization: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")  # e4m3 tensor cores: `--quantization fp8` is refused below
    folder = save_family(tmp_path / "moe", "qwen3-moe", head_spread=1.0)
    config = EngineConfig(
        model=str(folder), device="cuda", dtype="float32", quantization=quantization,  # type: ignore[arg-type]
        cache=CacheConfig(memory_bytes=256 * 1024**2),
    )
    theirs, ours, replays = moe_tokens_eager_and_through_graphs(config, monkeypatch)
    assert replays > 0
    assert ours == theirs
