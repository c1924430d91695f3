"""The whole engine on the embedded model: token-exact with transformers, batch-invariant, cache and preemption.

These load SmolLM2-135M-Instruct (fp32, CPU) once per session; see the `llm` fixture in tests/conftest.py.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from benchmarks.quality import QUALITY_PROMPTS
from engine_server import LLM, ChatPrompt, SamplingParams
from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_server.loader import resolve_model
from engine_server.tokenizer.chat import ChatMessage
from tests.families import GreedyReference, float_checkpoint

pytestmark = pytest.mark.slow  # the embedded model, and transformers' on the same weights

CHAT_PROMPTS = list(QUALITY_PROMPTS)  # also what `ladle bench quality` measures quantized weights on
NUM_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _chat(text: str) -> ChatPrompt:
    return ChatPrompt([ChatMessage(role="user", content=text)])


@pytest.fixture(scope="module")
def hf_model() -> Any:
    """transformers' own model on the weights the engine loads (the GGUF file's tensors dequantized, every one
    transformers' own GGUF loader's to 1e-6, in the converted config, which runs in transformers as the GGUF does:
    tests/unit/test_loader.py), fp32 on the CPU. Reading them as ladle does rather than the GGUF again leaves no
    rounding between the two models' weights and skips transformers' slow GGUF dequantization."""
    from transformers import AutoModelForCausalLM

    with float_checkpoint(resolve_model("default")) as folder:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()


def test_greedy_matches_transformers_token_for_token(float_reference: Any, hf_model: Any) -> None:
    # The session engine's greedy continuations of the chat prompts, 64 tokens each (tests/conftest.py: computed
    # once for this file and the quality measurements).
    # transformers' own, each prompt decoded alone (`GreedyReference`: one forward pass a prompt checks ours).
    (prompts, continuations), _ = float_reference
    theirs_alone = GreedyReference(hf_model, prompts, NUM_TOKENS).of(continuations)
    mismatches = []
    for prompt, ours, theirs in zip(CHAT_PROMPTS, continuations, theirs_alone, strict=True):
        if ours != theirs:
            first = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
            mismatches.append(f"{prompt!r}: first difference at token {first}")
    assert mismatches == []
    assert all(len(ours) == NUM_TOKENS for ours in continuations)


def test_greedy_is_the_same_alone_and_in_a_batch_of_32(llm: LLM) -> None:
    rng = random.Random(1)
    batch = [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 200))] for _ in range(31)]
    target = _chat("Describe a sunset over the ocean.")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    alone = llm.generate(target, params, use_tqdm=False)[0].choices[0].token_ids
    mixed = llm.generate([*batch[:15], target, *batch[15:]], params, use_tqdm=False)
    assert mixed[15].choices[0].token_ids == alone


def test_shared_prefix_is_served_from_the_cache(llm: LLM) -> None:
    rng = random.Random(2)
    prefix = [rng.randrange(100, 40000) for _ in range(500)]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first = llm.generate([*prefix, 11, 12, 13], params, use_tqdm=False)[0]
    second = llm.generate([*prefix, 21, 22], params, use_tqdm=False)[0]
    assert first.usage.prompt_tokens == 503
    assert second.usage.cached_prompt_tokens >= 480


def test_a_small_kv_pool_preempts_and_still_gives_the_same_tokens(llm: LLM) -> None:
    small = LLM(
        config=EngineConfig(
            quantization="none",
            cache=CacheConfig(block_size=16, memory_bytes=24 * 16 * 30 * 2 * 3 * 64 * 4),  # 24 blocks
            scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=16),
        )
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(40, 80))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    expected = [r.choices[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    got = small.generate(prompts, params, use_tqdm=False)
    assert [r.choices[0].token_ids for r in got] == expected
    assert small.core.scheduler.total_preemptions > 0
    assert small.core.scheduler.kv_cache.num_free_blocks == small.core.runner.num_blocks


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    target = _chat("Invent a name for a new color.")
    alone = llm.generate(target, seeded, use_tqdm=False)[0].choices[0].token_ids
    crowd = [_chat(f"Count to {i}.") for i in range(6)]
    mixed = llm.generate([*crowd[:3], target, *crowd[3:]], [other] * 3 + [seeded] + [other] * 3, use_tqdm=False)
    assert mixed[3].choices[0].token_ids == alone
    unseeded = llm.generate([target, target], other, use_tqdm=False)
    assert unseeded[0].choices[0].token_ids != alone or unseeded[1].choices[0].token_ids != alone


def test_n_choices_share_the_prompt_and_differ(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    result = llm.generate(_chat("Name an animal."), params, use_tqdm=False)[0]
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in result.choices}) > 1
    assert result.usage.completion_tokens == 64


def test_stop_string_across_tokens_is_never_emitted(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = _chat("Write two sentences about the moon.")
    full = llm.generate(prompt, greedy, use_tqdm=False)[0].choices[0]
    stop = full.text[20:27]
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,)), use_tqdm=False)
    choice = stopped[0].choices[0]
    assert choice.text == full.text[: full.text.index(stop)]
    assert choice.finish_reason is not None and choice.finish_reason.value == "stop"
    assert choice.matched_stop == stop


def test_logprobs_are_consistent_with_greedy_choice(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=True, top_logprobs=5)
    choice = llm.generate(_chat("Say hello."), params, use_tqdm=False)[0].choices[0]
    assert choice.logprobs is not None and len(choice.logprobs) == 8
    for entry, token_id in zip(choice.logprobs, choice.token_ids, strict=True):
        assert entry.token_id == token_id
        assert len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].token_id == token_id
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
