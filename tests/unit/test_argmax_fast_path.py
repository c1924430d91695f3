"""The runner's plain-greedy path: a batch whose rows ask only for the argmax skips the sampler's per-row set-up
and gives the same tokens as the full sampler."""

from __future__ import annotations

import pytest

from engine_server.core.request import Request
from engine_server.core.scheduler import Scheduler
from engine_server.sampling import Sampler
from engine_server.sampling_params import SamplingParams
from tests.unit.runner_factories import MAX_MODEL_LEN, VOCAB, tiny_engine_config, tiny_runner


def _request(request_id: str, params: SamplingParams) -> Request:
    prompt = [(sum(map(ord, request_id)) * 7 + i) % VOCAB for i in range(5 + len(request_id))]
    return Request(request_id, prompt, params, max_model_len=MAX_MODEL_LEN)


def _generate(requests: list[Request], monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, list[int]], list[str]]:
    """Greedy outputs of `requests` on the tiny model, and which sampler entry served each step."""
    config = tiny_engine_config()
    runner = tiny_runner(config)
    scheduler = Scheduler(config.scheduler, config.cache, runner.num_blocks, MAX_MODEL_LEN)
    calls: list[str] = []
    full, argmax = Sampler.sample, Sampler.argmax
    with monkeypatch.context() as patch:
        patch.setattr(Sampler, "sample", lambda self, *a: calls.append("full") or full(self, *a))
        patch.setattr(Sampler, "argmax", lambda self, *a: calls.append("argmax") or argmax(self, *a))
        for request in requests:
            scheduler.add_request(request)
        while scheduler.has_unfinished():
            output = scheduler.schedule(now=0.0)
            sampled = runner.execute(output)
            scheduler.update_from_output(output, [s.token_id for s in sampled.values()])
    return {r.request_id: list(r.output_token_ids) for r in requests}, calls


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize(
    "params",
    [GREEDY, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True),
     SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={3: 5.0}),
     SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3),
     SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, min_tokens=2)],
    ids=["greedy", "logprobs", "logit_bias", "penalty", "min_tokens"],
)  # fmt: skip
def test_only_batches_of_plain_greedy_rows_take_the_argmax_path(
    params: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = [_request("a", GREEDY), _request("bb", GREEDY), _request("ccc", params)]
    _, calls = _generate(requests, monkeypatch)
    plain = params is GREEDY
    assert requests[2].argmax_only is plain
    assert set(calls) == ({"argmax"} if plain else {"full"})


def test_the_argmax_path_gives_the_full_samplers_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = ["a", "bb", "ccc", "dddd", "e"]
    fast, fast_calls = _generate([_request(i, GREEDY) for i in ids], monkeypatch)
    slow_requests = [_request(i, GREEDY) for i in ids]
    for request in slow_requests:
        request.argmax_only = False
    slow, slow_calls = _generate(slow_requests, monkeypatch)
    assert set(fast_calls) == {"argmax"} and set(slow_calls) == {"full"}
    assert fast == slow and all(len(tokens) == 6 for tokens in fast.values())
