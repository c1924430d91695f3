"""gpt-oss on a real GPU: attention sinks in the Triton attention kernel and biased experts with the clamped SwiGLU
in the Triton fused-MoE kernels, inside the engine.

Skipped without CUDA (FP8 below compute capability 8.9); the kernels themselves are held to their references through
Triton's interpreter in tests/unit/kernels. A small random gpt-oss (tests/families.py) in float32: on its float path
the GPU engine's greedy tokens equal the CPU engine's (which equal transformers', tests/unit/test_family_engines.py);
under fp8 its e4m3 experts agree with the CPU engine's fp8 (dequantized banks: the reference's arithmetic) as
closely as tests/gpu/test_fp8_moe_gpu.py holds Qwen3-MoE's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.quality import QUALITY_PROMPTS, compare, reference_of
from engine_server import LLM, SamplingParams
from engine_server.config import CacheConfig, EngineConfig
from tests.families import save_family

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MIN_TOP1, MAX_MEAN_KL = 0.9, 0.3


def _engine(folder: Path, device: str, quantization: str) -> LLM:
    config = EngineConfig(model=str(folder), device=device, quantization=quantization, dtype="float32",  # type: ignore[arg-type]
                          cache=CacheConfig(memory_bytes=256 * 1024**2))  # fmt: skip
    return LLM(config=config)


def test_gpt_oss_float_path_on_the_gpu_equals_the_cpus(tmp_path: Path) -> None:
    """The CPU engine's float path is the oracle here, not transformers: tests/unit/test_family_engines.py holds it
    equal to the transformers the project installs, while the GPU image's may be older (5.17's gpt-oss ignores the
    config's `swiglu_limit` / `swiglu_alpha`, which the test model sets)."""
    folder = save_family(tmp_path / "gpt-oss", "gpt-oss")
    prompts = [[(7 * i + 3 * j) % 40000 + 10 for j in range(n)] for i, n in enumerate((5, 33, 70, 1, 130))]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for device in ("cpu", "cuda"):
        with _engine(folder, device, "none") as llm:
            tokens[device] = [r.choices[0].token_ids for r in llm.generate(prompts, greedy, use_tqdm=False)]
    assert tokens["cuda"] == tokens["cpu"]


def test_gpt_oss_fp8_experts_on_the_gpu_agree_with_the_cpus(tmp_path: Path) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    folder = save_family(tmp_path / "gpt-oss", "gpt-oss", head_spread=1.0)
    with _engine(folder, "cpu", "fp8") as cpu:
        sequences, log_probs = reference_of(cpu, QUALITY_PROMPTS[:8], 16)
    with _engine(folder, "cuda", "fp8") as gpu:
        result = compare(log_probs, gpu, "fp8 gpu", QUALITY_PROMPTS[:8], 16, sequences, free_running=False)
    print(result)
    assert result.top1_agreement >= MIN_TOP1 and result.mean_kl <= MAX_MEAN_KL, result
