"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`, vLLM's): on the float path each prompt token's
log-probability given the tokens before it, and the k best alternatives, equal transformers' log_softmax over the
same prompt; the same in one prefill or in chunks, alone or beside other requests, and when the prompt is in the
prefix cache (such a request computes its prompt); only the first of n choices carries them; an out-of-range k is
refused."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_server import model_runner
from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_server.errors import ValidationError
from engine_server.llm import LLM
from engine_server.sampling_params import SamplingParams
from tests.families import save_family

PROMPT_LENGTH = 40
TOP = 3


@pytest.fixture(scope="module", params=["llama", "gemma4"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama, and Gemma 4, whose K/V-sharing layers run for a step's last tokens alone unless the step reads more
    (`AttentionMetadata.last_rows_only`): a step that reads its prompt runs them for every row."""
    return save_family(tmp_path_factory.mktemp(request.param), request.param, head_spread=1.0)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(100, 20_000) for _ in range(PROMPT_LENGTH)]


def expected(folder: Path, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """transformers' log-probabilities of prompt tokens 1.., the TOP best token ids at positions 0..n-2, and each
    prompt token's rank (1 + the tokens more likely)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(prompt[1:])[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    return chosen[:, 0], logprobs.topk(TOP, dim=-1).indices, ranks


def engine(folder: Path, chunk: int) -> LLM:
    config = EngineConfig(model=str(folder), device="cpu", quantization="none",
                          cache=CacheConfig(memory_bytes=64 * 1024**2),
                          scheduler=SchedulerConfig(max_num_batched_tokens=chunk))  # fmt: skip
    return LLM(config=config)


def read(llm: LLM, prompts: list[list[int]], **params: Any) -> list[Any]:
    sampling = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP, **params)
    return llm.generate(prompts, sampling, use_tqdm=False)


@pytest.mark.parametrize(("chunk", "slice_rows"), [(2048, 256), (16, 256), (2048, 7)])
def test_prompt_logprobs_equal_transformers(
    folder: Path, prompt: list[int], chunk: int, slice_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one prefill, in 16-token chunks, and read 7 rows at a time (the runner's slices of a long chunk)."""
    monkeypatch.setattr(model_runner, "_PROMPT_LOGPROB_ROWS", slice_rows)
    want, want_top, want_ranks = expected(folder, prompt)
    other = [7, 8, 9, *prompt[:20]]
    with engine(folder, chunk) as llm:
        alone = read(llm, [prompt])[0]
        cached, beside = read(llm, [prompt, other])  # the prompt's blocks are in the cache now
        plain = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    for result in (alone, cached):
        assert result.prompt_logprobs is not None and result.prompt_logprobs.first_token_id == prompt[0]
        assert result.prompt_logprobs.first_token
        found = result.prompt_logprobs.tokens
        assert len(found) == PROMPT_LENGTH - 1
        assert [entry.token_id for entry in found] == prompt[1:]
        # float32 sums in another order than transformers': the error grows with a logprob's size (a random model
        # puts its prompt's tokens near -26), and with the machine's vector width (1.2e-4 on an AVX2-only CPU)
        torch.testing.assert_close(torch.tensor([entry.logprob for entry in found]), want, atol=1e-4, rtol=1e-5)
        assert [[top.token_id for top in entry.top_logprobs] for entry in found] == want_top.tolist()
        assert [entry.rank for entry in found] == want_ranks
        assert all(entry.token and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6 for entry in found)
        assert result.choices[0].token_ids == plain.choices[0].token_ids  # the output is what it would be
    assert beside.prompt_logprobs is not None and len(beside.prompt_logprobs.tokens) == len(other) - 1
    assert plain.prompt_logprobs is None


def test_only_the_first_choice_reads_the_prompt_and_k_is_checked(folder: Path, prompt: list[int]) -> None:
    with engine(folder, 2048) as llm:
        [result] = read(llm, [prompt], n=2, seed=1)
        assert result.prompt_logprobs is not None and len(result.prompt_logprobs.tokens) == PROMPT_LENGTH - 1
        [single] = read(llm, [prompt[:1]])
        assert single.prompt_logprobs is not None and single.prompt_logprobs.tokens == []  # nothing before it
    with pytest.raises(ValidationError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate_values()
