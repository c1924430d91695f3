"""The FP8 KV cache (`--kv-cache-dtype fp8`): its rows, its size, the flag, and engines serving over it on the CPU.

The Triton kernels that write and read it are held to the reference in tests/unit/kernels (test_kv_cache_kernel.py,
test_paged_attention_kernel.py), the C++ ones in tests/unit/kernels/test_cpu_ops.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections.abc import Iterator

import pytest
import torch

from benchmarks.quality import QUALITY_PROMPTS, measure, reference_of
from engine_server import LLM, ChatPrompt, SamplingParams
from engine_server.attention_metadata import kv_cache_bytes_per_block, kv_cache_layout
from engine_server.config import CacheConfig, EngineConfig
from engine_server.layers.kernel_choice import select_ops
from engine_server.loader import resolve_model
from engine_server.tokenizer.chat import ChatMessage
from ladle_cli.main import kv_cache_dtype
from ladle_kernels import cpu_ops as cpu
from ladle_kernels import reference

needs_kernels = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")
CACHE = 256 * 1024**2


def test_a_row_holds_e4m3_values_then_their_scale() -> None:
    x = torch.randn(3, 2, 64) * torch.tensor([1e-3, 1.0, 1e3]).view(3, 1, 1)
    x[1, 1] = 0.0
    rows = reference.fp8_kv_rows(x)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 2, 68)
    scales = rows[..., 64:].contiguous().view(torch.float32).squeeze(-1)
    expected = (x.abs().amax(-1) / 448).clamp(min=reference.FP8_MIN_SCALE)
    assert torch.equal(scales, expected)
    assert torch.equal(rows[..., :64].contiguous().view(reference.FP8_DTYPE).float(), (x / expected[..., None])
                       .clamp(-448, 448).to(reference.FP8_DTYPE).float())  # fmt: skip
    decoded = reference.fp8_kv_values(rows)
    assert torch.equal(decoded[1, 1], torch.zeros(64))
    assert ((decoded - x).abs() <= x.abs() / 16 + expected[..., None] * 2**-9).all()
    assert reference.fp8_kv_values(rows, torch.bfloat16).dtype == torch.bfloat16


def test_an_fp8_cache_takes_about_a_quarter_of_float32s_bytes() -> None:
    config = resolve_model("default").config
    assert kv_cache_layout(config, torch.float32, "auto") == (torch.float32, 64)
    assert kv_cache_layout(config, torch.bfloat16, "fp8") == (torch.uint8, 68)
    fp8 = kv_cache_bytes_per_block(config, 16, torch.float32, cache_dtype="fp8")
    assert fp8 * 256 == kv_cache_bytes_per_block(config, 16, torch.float32) * 68
    assert fp8 * 128 == kv_cache_bytes_per_block(config, 16, torch.bfloat16) * 68
    with pytest.raises(ValueError, match="multiple of 4"):
        kv_cache_layout(dataclasses.replace(config, head_dim=66), torch.float32, "fp8")
    with pytest.raises(ValueError, match="expected auto or fp8"):
        kv_cache_layout(config, torch.float32, "fp8_e5m2")  # type: ignore[arg-type]


def test_the_flag_takes_vllms_names_and_refuses_e5m2() -> None:
    assert kv_cache_dtype("fp8") == kv_cache_dtype("fp8_e4m3") == "fp8"
    assert kv_cache_dtype("auto") == "auto"
    with pytest.raises(argparse.ArgumentTypeError, match="fp8_e5m2"):
        kv_cache_dtype("fp8_e5m2")


def round_writes_like_fp8(llm: LLM) -> LLM:
    """`llm` (an engine over a float cache, running its layers: no graphs, no C++ decode stack) made to round every
    key and value it writes as an FP8 row holds it (`reference.fp8_kv_rows`, then `fp8_kv_values` back to the
    model's dtype): what an FP8 cache's readers decode, held in a float cache."""
    model = llm.core.runner.model
    ops = model.ops or select_ops(llm.core.runner.device)
    write = ops.write_kv_cache

    def rounded(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        write(*(reference.fp8_kv_values(reference.fp8_kv_rows(x), x.dtype) for x in (k, v)), cache, slots)

    model.ops = dataclasses.replace(ops, write_kv_cache=rounded)
    return llm


@pytest.fixture(scope="module")
def fp8_engine() -> Iterator[LLM]:
    """The embedded model as `ladle serve` runs it (its GGUF blocks on the C++ kernels), over an FP8 cache."""
    config = EngineConfig(device="cpu", quantization="auto", cache=CacheConfig(memory_bytes=CACHE, dtype="fp8"))
    with LLM(config=config) as llm:
        yield llm


@needs_kernels
@pytest.mark.slow  # an engine on the embedded model
def test_the_engine_allocates_fp8_rows_and_more_blocks(fp8_engine: LLM) -> None:
    runner = fp8_engine.core.runner
    source = resolve_model("default").config
    assert all(cache.dtype == torch.uint8 and cache.shape[-1] == 68 for cache in runner.kv_caches)
    assert runner.num_blocks == CACHE // kv_cache_bytes_per_block(source, 16, torch.float32, cache_dtype="fp8")
    assert runner.model.model.decode_stack is not None  # the C++ stack writes and reads FP8 rows too


@needs_kernels
@pytest.mark.slow  # an engine on the embedded model
def test_greedy_over_an_fp8_cache_is_the_same_alone_batched_and_from_the_prefix_cache(fp8_engine: LLM) -> None:
    rng = random.Random(5)
    batch = [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 120))] for _ in range(11)]
    target = ChatPrompt([ChatMessage(role="user", content="Describe a sunset over the ocean.")])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = fp8_engine.generate(target, params, use_tqdm=False)[0]
    mixed = fp8_engine.generate([*batch[:5], target, *batch[5:]], params, use_tqdm=False)[5]
    assert mixed.usage.cached_prompt_tokens > 0  # the second time, its prompt's blocks come from the cache
    assert mixed.choices[0].token_ids == alone.choices[0].token_ids
    assert len(set(alone.choices[0].token_ids)) > 5  # words, not one token over and over


@needs_kernels
@pytest.mark.slow  # two engines on the embedded model
def test_an_fp8_cache_stays_close_to_the_float_one(llm: LLM) -> None:
    """The float weights over an FP8 cache against the float engine: `ladle bench quality --formats none
    --kv-cache-dtype fp8` on half its prompts (docs/models.md has the whole run: 96.5% / 0.0058)."""
    prompts = QUALITY_PROMPTS[:8]
    (result,) = measure(formats=("none",), prompts=prompts, num_tokens=32, free_running=False,
                        float_reference=reference_of(llm, prompts, 32), kv_cache_dtype="fp8")  # fmt: skip
    assert result.positions == 8 * 32
    assert result.top1_agreement >= 0.93, result
    assert result.mean_kl <= 0.01, result


@needs_kernels
@pytest.mark.slow  # two engines on the embedded model
def test_float_weights_over_an_fp8_cache_decode_as_their_rounding_does() -> None:
    """Token for token: the C++ attention over an FP8 cache reads the values a float cache holding each row's
    rounding gives it (tests/gpu/test_fp8_kv_gpu.py holds the Triton kernels to the same)."""
    prompts = [ChatPrompt([ChatMessage(role="user", content=p)]) for p in QUALITY_PROMPTS[:6]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = []
    for cache_dtype in ("fp8", "auto"):
        cache = CacheConfig(memory_bytes=512 * 1024**2, dtype=cache_dtype)  # type: ignore[arg-type]
        with LLM(config=EngineConfig(device="cpu", quantization="none", cache=cache)) as llm:
            engine = llm if cache_dtype == "fp8" else round_writes_like_fp8(llm)
            outputs.append([r.choices[0].token_ids for r in engine.generate(prompts, params, use_tqdm=False)])
    assert outputs[0] == outputs[1]
