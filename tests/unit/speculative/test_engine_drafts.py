"""Speculative decoding through the engine core on a tiny random-weight model: the same tokens as without it.

The drafts come from an oracle that knows each request's output from a run without speculation and proposes it
with mistakes at chosen places, so every outcome of verification happens: all drafts kept, the first refused,
one refused in the middle, several steps in a row. Greedy and seeded requests must produce exactly the tokens
(and log-probabilities, within float noise) they produce without speculation, through penalties, min_tokens,
eos, max_tokens, chunked prefill beside the drafts, and preemption.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine_server.core.engine_core import EngineCore
from engine_server.core.request import Request, RequestStatus
from engine_server.sampling_params import SamplingParams
from engine_server.speculative.speculator import SpeculationStats
from tests.unit.factories import VOCAB
from tests.unit.runner_factories import BLOCK_SIZE, MAX_MODEL_LEN, TINY_LLAMA, tiny_engine_config, tiny_source

Outcome = tuple[list[int], list[float], RequestStatus | None]


class OracleProposer:
    """Proposes a request's known continuation, wrong at every `wrong_every`-th proposal's `wrong_at` position."""

    def __init__(self, outputs: dict[str, list[int]], prompts: dict[str, list[int]], wrong_every: int, wrong_at: int):
        self.outputs, self.prompts = outputs, prompts
        self.wrong_every, self.wrong_at = wrong_every, wrong_at
        self.calls = 0

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        self.calls += 1
        known = self.prompts[request_id] + self.outputs[request_id]
        drafts = list(known[len(token_ids) : len(token_ids) + max_tokens])
        if self.calls % self.wrong_every == 0 and self.wrong_at < len(drafts):
            drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % VOCAB
        return drafts

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        pass


def _requests() -> list[Request]:
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=37, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=33),
        SamplingParams(temperature=0.0, min_tokens=12, max_tokens=28, frequency_penalty=0.4),
        SamplingParams(temperature=0.8, top_k=20, seed=9, max_tokens=41, logprobs=True),
    ]
    requests = []
    for i, params in enumerate(kinds):
        prompt = [(37 * i + 11 * j + 3) % VOCAB for j in range(5 + 9 * i)]  # long enough to prefill in chunks
        requests.append(
            Request(f"r{i}", prompt, params, max_model_len=MAX_MODEL_LEN, eos_token_ids=(7, 8), arrival_time=i)
        )
    return requests


def _run(
    config: EngineConfig, proposer: OracleProposer | None = None, stagger: bool = True
) -> tuple[dict[str, Outcome], EngineCore]:
    core = EngineCore(config, tiny_source())
    if proposer is not None:
        assert core.speculator is not None
        core.speculator.proposer = proposer
    waiting = _requests()
    seen: dict[str, Outcome] = {}
    while waiting or core.has_unfinished():
        if waiting:  # one new request per step: prefill chunks beside other requests' drafts
            for _ in range(1 if stagger else len(waiting)):
                core.add_request(waiting.pop(0))
        for output in core.step():
            tokens, logprobs, status = seen.get(output.request_id, ([], [], None))
            assert status is None, f"{output.request_id} reported after its finish"
            tokens += [t.token_id for t in output.new_tokens]
            logprobs += [t.logprobs.logprob for t in output.new_tokens if t.logprobs is not None]
            seen[output.request_id] = (tokens, logprobs, output.status)
    assert core.scheduler.kv_cache.num_used_blocks == 0
    return seen, core


def _stats(core: EngineCore) -> SpeculationStats:
    assert core.speculator is not None
    return core.speculator.stats


def _speculative(config: EngineConfig, max_drafts: int = 5) -> EngineConfig:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=max_drafts, adaptive=False)
    return dataclasses.replace(config, speculative=spec)


def _assert_same(got: dict[str, Outcome], expected: dict[str, Outcome]) -> None:
    assert set(got) == set(expected)
    for request_id, (tokens, logprobs, status) in got.items():
        assert tokens == expected[request_id][0], request_id
        assert status is expected[request_id][2], request_id
        assert logprobs == pytest.approx(expected[request_id][1], abs=1e-4), request_id


@pytest.mark.parametrize(("wrong_every", "wrong_at"), [(1, 0), (1, 2), (2, 4), (3, 1), (1000, 0)])
def test_every_outcome_of_verification_gives_the_tokens_of_plain_decoding(wrong_every: int, wrong_at: int) -> None:
    config = tiny_engine_config(max_num_seqs=8)
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_num_batched_tokens=24))
    expected, _ = _run(config)
    outputs = {rid: tokens for rid, (tokens, _, _) in expected.items()}
    prompts = {r.request_id: r.prompt_token_ids for r in _requests()}
    oracle = OracleProposer(outputs, prompts, wrong_every, wrong_at)
    got, core = _run(_speculative(config), oracle)
    _assert_same(got, expected)
    stats = _stats(core)
    assert stats.proposed_tokens > 0
    assert (stats.accepted_tokens == 0) == (wrong_every == 1 and wrong_at == 0)  # that oracle is always wrong
    assert (stats.accepted_tokens == stats.proposed_tokens) == (wrong_every == 1000)  # that one never is


def test_speculating_requests_preempted_for_blocks_give_the_same_tokens() -> None:
    block_bytes = 2 * BLOCK_SIZE * TINY_LLAMA.num_key_value_heads * TINY_LLAMA.head_dim * 4 * 2
    config = EngineConfig(
        device="cpu",
        cache=CacheConfig(block_size=BLOCK_SIZE, memory_bytes=40 * block_bytes, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=MAX_MODEL_LEN),
    )
    expected, _ = _run(config, stagger=False)
    outputs = {rid: tokens for rid, (tokens, _, _) in expected.items()}
    prompts = {r.request_id: r.prompt_token_ids for r in _requests()}
    core_config = _speculative(config, max_drafts=6)
    got, core = _run(core_config, OracleProposer(outputs, prompts, 3, 2), stagger=False)
    _assert_same(got, expected)
    assert core.scheduler.total_preemptions > 0 and _stats(core).accepted_tokens > 0


def test_without_a_proposal_nothing_changes() -> None:
    config = tiny_engine_config(max_num_seqs=8)
    expected, _ = _run(config)
    _assert_same(_run(_speculative(config))[0], expected)  # the real n-gram proposer: random weights rarely repeat


@pytest.mark.parametrize("draft_seed", [0, 1])
def test_a_draft_model_gives_the_tokens_of_plain_decoding(draft_seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft is the target itself (seed 0: the same random weights) or another random model (seed 1); either
    way the tokens are the target's own. (A tiny random model's greedy choice mostly repeats its input token, so
    both drafts are often kept: acceptance tells them apart little here.)"""
    config = tiny_engine_config(max_num_seqs=8)
    expected, _ = _run(config)
    monkeypatch.setattr(
        "engine_server.model_loading.resolve_model",
        lambda spec, cache_dir=None, seed=0: dataclasses.replace(tiny_source(), seed=draft_seed),
    )
    spec = SpeculativeConfig(method="draft_model", model="tiny", num_speculative_tokens=4, adaptive=False)
    got, core = _run(dataclasses.replace(config, speculative=spec))
    _assert_same(got, expected)
    stats = _stats(core)
    assert stats.proposed_tokens > 0
    assert stats.proposed_tokens > 0 and stats.accepted_tokens > 0
