"""Speculative decoding on the embedded model: greedy output equal to decoding without it, on the float path (the
token-exactness prompts, so equal to transformers' as well) and on the quantized default (whose kernels give a
token the same bits whatever its batch, so a row verifying drafts computes exactly what decoding them one by one
computes); seeded sampling with n > 1 and logprobs, structured outputs and stop strings too.

Uses the session `llm` fixture (fp32, no speculation) and engines of its own with `speculative_config`.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.quality import QUALITY_PROMPTS
from engine_server import LLM, ChatPrompt, SamplingParams
from engine_server.config import CacheConfig, EngineConfig
from engine_server.structured import Constraint
from engine_server.tokenizer.chat import ChatMessage

pytestmark = pytest.mark.slow  # the embedded model with drafts

PASSAGE = (
    "Our library opens at nine on weekdays and at ten on Saturdays. Members may borrow up to six books at a time "
    "for three weeks, and renew them twice online or at the front desk. Late returns cost twenty cents a day per "
    "book, up to a limit of five dollars. The reading room on the second floor is quiet at all times."
)
COPYING = [
    f"Repeat the following text word for word:\n\n{PASSAGE}",
    f"Fix the spelling and return the full text:\n\n{PASSAGE.replace('weekdays', 'weekdayz')}",
    f"Quote the sentence of this text that mentions a price:\n\n{PASSAGE}",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 6, "adaptive": False}  # verify every proposal


def _chat(text: str) -> ChatPrompt:
    return ChatPrompt([ChatMessage(role="user", content=text)])


def _tokens(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [r.choices[0].token_ids for r in llm.generate([_chat(p) for p in prompts], params, use_tqdm=False)]


@pytest.fixture(scope="module")
def quantized() -> LLM:
    return LLM(config=EngineConfig(device="cpu", cache=CacheConfig(memory_bytes=512 * 1024**2)))


@pytest.fixture(scope="module")
def quantized_ngram() -> LLM:
    config = EngineConfig(device="cpu", cache=CacheConfig(memory_bytes=512 * 1024**2))
    return LLM(config=config, speculative_config=NGRAM)


def test_float_path_greedy_is_unchanged_on_the_exactness_prompts(llm: LLM) -> None:
    config = EngineConfig(device="cpu", quantization="none", cache=CacheConfig(memory_bytes=512 * 1024**2))
    speculative = LLM(config=config, speculative_config={**NGRAM, "method": "suffix"})
    prompts = [*QUALITY_PROMPTS[::2], *COPYING]
    assert _tokens(speculative, prompts) == _tokens(llm, prompts)
    stats = speculative.core.speculator.stats  # type: ignore[union-attr]
    assert stats.accepted_tokens > 50  # the copying prompts did keep drafts


def test_quantized_default_greedy_is_unchanged(quantized: LLM, quantized_ngram: LLM) -> None:
    prompts = [*QUALITY_PROMPTS[:6], *COPYING]
    assert _tokens(quantized_ngram, prompts) == _tokens(quantized, prompts)
    assert quantized_ngram.core.speculator.stats.accepted_tokens > 50  # type: ignore[union-attr]


def test_seeded_sampling_with_n_and_logprobs_is_unchanged(quantized: LLM, quantized_ngram: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=32, n=2, logprobs=True)

    def choices(llm: LLM) -> list[tuple[list[int], list[float]]]:
        results = llm.generate([_chat(p) for p in COPYING[:2]], params, use_tqdm=False)
        return [(c.token_ids, [t.logprob for t in c.logprobs or []]) for r in results for c in r.choices]

    ours, plain = choices(quantized_ngram), choices(quantized)
    assert len(ours) == 4 and [tokens for tokens, _ in ours] == [tokens for tokens, _ in plain]
    assert all(got == pytest.approx(want, abs=1e-4) and got for (_, got), (_, want) in zip(ours, plain, strict=True))


def test_a_constrained_output_is_unchanged_and_parses(quantized: LLM, quantized_ngram: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"opens": {"type": "string", "maxLength": 30}, "fine": {"type": "string", "maxLength": 30}},
        "required": ["opens", "fine"],
    }
    params = SamplingParams(temperature=0.0, max_tokens=64, constraint=Constraint.json_schema(json.dumps(schema)))
    prompt = [f"{PASSAGE}\n\nAnswer in JSON: when does it open, and what is the late fine?"]
    ours = quantized_ngram.generate([_chat(p) for p in prompt], params, use_tqdm=False)[0].choices[0]
    assert ours.token_ids == _tokens(quantized, prompt, params)[0]
    assert set(json.loads(ours.text)) == {"opens", "fine"}


def test_a_stop_string_inside_a_run_ends_the_text_there(quantized: LLM, quantized_ngram: LLM) -> None:
    full = quantized.generate(_chat(COPYING[0]), GREEDY, use_tqdm=False)[0].choices[0].text
    stop = full[40:47]
    params = SamplingParams(temperature=0.0, max_tokens=64, stop=(stop,))
    ours = quantized_ngram.generate(_chat(COPYING[0]), params, use_tqdm=False)[0].choices[0]
    assert ours.text == full[: full.index(stop)] and ours.matched_stop == stop
