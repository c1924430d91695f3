"""Images and audio as input on a real GPU: the vision encoders and Qwen2-Audio's tower (transformers' modules in the
engine's dtype on the device), their rows laid over the placeholders' embeddings, Qwen-VL's M-RoPE rows and the decode
rows' shifted positions inside real CUDA graphs, Qwen3-VL's DeepStack adds and Gemma 3's second, two-way attention over
an image's tokens (torch, on the device), in the engine whole and prefilled in chunks.

Skipped without CUDA. The tiny checkpoints of tests/unit/test_image_input.py and test_audio_input.py in float32: the
GPU engine's greedy tokens equal transformers' (on the CPU) for prompts with one image (or clip), two and none,
batched; under bf16 (the GPU's default) they agree with the CPU's float path as closely as bf16 allows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_server import LLM
from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_server.frontend import ChatPrompt
from tests.unit.test_audio_input import audio_prompts, save_qwen2_audio
from tests.unit.test_audio_input import processor_inputs as audio_inputs
from tests.unit.test_image_input import (
    GREEDY,
    gemma3_inputs,
    image_prompts,
    processor_inputs,
    qwen_inputs,
    save_gemma3,
    save_llava,
    save_qwen_vl,
    transformers_greedy,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Each kind's checkpoint, the processor inputs transformers answers from and its prompts.
_KINDS: dict[str, tuple[Callable[[Path], Any], Callable[[Path, ChatPrompt], dict[str, torch.Tensor]]]] = {
    "qwen2_audio": (save_qwen2_audio, audio_inputs),
    "llava": (save_llava, processor_inputs),
    "qwen2_5_vl": (lambda folder: save_qwen_vl(folder, "qwen2_5_vl"), qwen_inputs),
    "qwen3_vl": (lambda folder: save_qwen_vl(folder, "qwen3_vl"), qwen_inputs),
    "gemma3": (save_gemma3, gemma3_inputs),
}


def _engine(folder: Path, device: str, dtype: str = "float32", chunk: int = 2048) -> LLM:
    config = EngineConfig(model=str(folder), device=device, quantization="none", dtype=dtype,  # type: ignore[arg-type]
                          cache=CacheConfig(memory_bytes=256 * 1024**2),
                          scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=16))  # fmt: skip
    return LLM(config=config)


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_media_prompts_on_the_gpu_answer_as_transformers_does(tmp_path: Path, kind: str) -> None:
    save, inputs_of = _KINDS[kind]
    model = save(tmp_path)
    prompts = audio_prompts() if kind == "qwen2_audio" else image_prompts()
    expected = [transformers_greedy(model, inputs_of(tmp_path, prompt)) for prompt in prompts]
    for chunk in (2048, 20):  # (20: a Gemma 3 chunk ends before or after an image, never inside)
        with _engine(tmp_path, "cuda", chunk=chunk) as llm:
            results = llm.chat(prompts, GREEDY, use_tqdm=False)
            graphs = llm.core.runner.decode_graphs
        assert [result.choices[0].token_ids for result in results] == expected, chunk
        assert graphs is not None and sum(graphs.replays.values()) > 0  # (decoded inside real CUDA graphs)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "gemma3", "qwen2_audio"])
def test_bf16_media_prompts_on_the_gpu_agree_with_the_cpus_float_path(tmp_path: Path, kind: str) -> None:
    _KINDS[kind][0](tmp_path)
    prompts = audio_prompts() if kind == "qwen2_audio" else image_prompts()
    with _engine(tmp_path, "cpu") as cpu:
        theirs = [result.choices[0].token_ids for result in cpu.chat(prompts, GREEDY, use_tqdm=False)]
    with _engine(tmp_path, "cuda", dtype="bfloat16") as gpu:
        ours = [result.choices[0].token_ids for result in gpu.chat(prompts, GREEDY, use_tqdm=False)]
    first_tokens = sum(a[0] == b[0] for a, b in zip(ours, theirs, strict=True))
    assert first_tokens >= len(prompts) - 1, (ours, theirs)
