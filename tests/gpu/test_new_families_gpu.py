"""Qwen3.5, Qwen3-Next and Gemma 4 on a real GPU: the linear-attention layers (the torch reference's chunked form
and one-token form, over state slots on the device) and the gated attention in the Triton kernels, inside the engine;
Gemma 4's full-attention layers (heads 32 wide beside the windowed layers' 16, one KV head) and the layers that
attend over earlier layers' K/V in the same kernels; Mamba-2 and Falcon Mamba alone, an engine with no KV cache
(its states in slots on the device, decoded eagerly as every model with states is); DeepSeek-V4's compressed
attention (torch, sequence by sequence, on the device), LongCat-Flash's paired blocks and shortcut experts, MiniMax-01's
lightning attention in its block form (the CPU runs it token by token); BLOOM's and MPT's ALiBi (torch, decoded
eagerly), Dory's unrolled passes in the Triton kernels under CUDA graphs, Zamba2's shared blocks between Mamba-2
layers, Qwen4-Exp's streams, QSA attention (torch past its dense length) and n-gram layers (decoded eagerly).

Skipped without CUDA. Small random models (tests/families.py) in float32: on their float path the GPU engine's greedy
tokens equal transformers' alone, batched and prefilled 16 tokens a step (as the CPU engine's do,
tests/unit/test_hybrid_engines.py); under bf16 (the GPU's default) they agree with the CPU's float path as closely
as bf16 allows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.quality import QUALITY_PROMPTS, compare, reference_of
from engine_server import LLM, SamplingParams
from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from tests.families import hf_greedy, load_reference, save_family

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MIN_TOP1, MAX_MEAN_KL = 0.9, 0.3


def _engine(folder: Path, device: str, dtype: str = "float32", chunk: int = 2048) -> LLM:
    config = EngineConfig(model=str(folder), device=device, quantization="none", dtype=dtype,  # type: ignore[arg-type]
                          cache=CacheConfig(memory_bytes=256 * 1024**2),
                          scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=16))  # fmt: skip
    return LLM(config=config)


@pytest.mark.parametrize(
    "family",
    ["qwen3.5", "qwen3-next", "gemma4", "mamba2", "falcon-mamba", "deepseek-v4", "longcat-flash", "minimax", "bloom",
     "mpt", "dory", "zamba2", "qwen4-exp"],
)
def test_the_float_path_on_the_gpu_equals_transformers(tmp_path: Path, family: str) -> None:
    folder = save_family(tmp_path / family, family)
    prompts = [[(7 * i + 3 * j) % 40000 + 10 for j in range(n)] for i, n in enumerate((5, 33, 70, 1, 130))]
    theirs = [hf_greedy(load_reference(folder), [prompt], 16)[0] for prompt in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for chunk in (2048, 16):
        with _engine(folder, "cuda", chunk=chunk) as llm:
            ours = [result.choices[0].token_ids for result in llm.generate(prompts, greedy, use_tqdm=False)]
        assert ours == theirs, chunk


@pytest.mark.parametrize("family", ["qwen3.5", "gemma4"])
def test_bf16_on_the_gpu_agrees_with_the_cpus_float_path(tmp_path: Path, family: str) -> None:
    folder = save_family(tmp_path / family, family, head_spread=1.0)
    with _engine(folder, "cpu") as cpu:
        sequences, log_probs = reference_of(cpu, QUALITY_PROMPTS[:8], 16)
    with _engine(folder, "cuda", dtype="bfloat16") as gpu:
        result = compare(log_probs, gpu, "bf16 gpu", QUALITY_PROMPTS[:8], 16, sequences, free_running=False)
    print(result)
    assert result.top1_agreement >= MIN_TOP1 and result.mean_kl <= MAX_MEAN_KL, result
