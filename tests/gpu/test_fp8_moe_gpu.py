"""`--quantization fp8` on a mixture of experts on a real GPU: the FP8 fused-MoE kernel inside the engine.

Skipped without CUDA or below compute capability 8.9 (the kernel itself is held to its reference through Triton's
interpreter in tests/unit/kernels/test_fp8_fused_moe_kernel.py). A small random Qwen3-MoE (tests/families.py) in
float32 on both sides: the CPU engine under fp8 (dequantized banks, rows rounded in torch: the reference's
arithmetic) is the reference, the GPU engine's banks stay e4m3 and run on the kernel. The two differ only by the
order of float32 sums (which can flip an e4m3 rounding, and at a near-tie a token's experts), so they must agree
as closely as the CPU tests hold FP8 to its float model on these random models.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.quality import QUALITY_PROMPTS, compare, reference_of
from engine_server import LLM
from engine_server.config import CacheConfig, EngineConfig
from engine_server.layers.fp8_experts import Fp8Experts
from ladle_kernels.reference import FP8_DTYPE
from tests.families import save_family

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an sm_89+ GPU"
    ),
]
MIN_TOP1, MAX_MEAN_KL = 0.9, 0.3


def _engine(folder: Path, device: str) -> LLM:
    config = EngineConfig(model=str(folder), device=device, quantization="fp8", dtype="float32",
                          cache=CacheConfig(memory_bytes=256 * 1024**2))  # fmt: skip
    return LLM(config=config)


def test_gpu_fp8_experts_agree_with_the_cpus(tmp_path: Path) -> None:
    folder = save_family(tmp_path / "moe", "qwen3-moe", head_spread=1.0)
    with _engine(folder, "cpu") as cpu:
        sequences, log_probs = reference_of(cpu, QUALITY_PROMPTS[:8], 16)
    with _engine(folder, "cuda") as gpu:
        banks = [m for m in gpu.core.runner.model.modules() if isinstance(m, Fp8Experts)]
        assert banks and all(b.w13.is_cuda and b.w13.dtype == FP8_DTYPE and b.w13_scale is not None for b in banks)
        result = compare(log_probs, gpu, "fp8 gpu", QUALITY_PROMPTS[:8], 16, sequences, free_running=False)
    print(result)
    assert result.top1_agreement >= MIN_TOP1 and result.mean_kl <= MAX_MEAN_KL, result
