"""Beam search (`SamplingParams.beam_width`, `engine_server.beam_search`) against transformers'
`generate(num_beams=...)` on a small random Llama whose end token is one it often picks, so that beams end on it and
at the length cap: the offline engine and the gRPC servicer answer transformers' beams token for token, with their
log-probabilities."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_server.errors import ValidationError
from engine_server.llm import LLM
from engine_server.sampling_params import SamplingParams
from tests.families import VOCAB_SIZE, load_reference, save_family
from tests.unit.test_family_engines import engine
from tests.unit.test_whisper import grpc_served

pytestmark = pytest.mark.slow  # an engine and transformers' model of their own

END = 41704  # a token this model (seed 0, head spread 1) often picks: its end token, so beams end on it


def prompts() -> list[list[int]]:
    """Six prompts of 1 to 40 tokens."""
    rng = random.Random(3)
    return [[rng.randrange(10, VOCAB_SIZE) for _ in range(length)] for length in (5, 17, 33, 1, 40, 9)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_family(tmp_path_factory.mktemp("beams"), "llama", head_spread=1.0, eos_token_id=END)


@pytest.fixture(scope="module")
def reference(folder: Path) -> Any:
    return load_reference(folder)


@pytest.fixture(scope="module")
def llm(folder: Path) -> Any:
    with engine(folder) as offline:
        yield offline


def theirs(
    reference: Any, prompt: list[int], params: SamplingParams, stops: list[int], device: str = "cpu"
) -> tuple[list[list[int]], Any]:
    """transformers' n best beams for `prompt` under `params` (each cut after its end token) and its output."""
    found = reference.generate(
        torch.tensor([prompt], device=device), num_beams=params.beam_width, num_return_sequences=params.n,
        do_sample=False,
        max_new_tokens=params.max_tokens, min_new_tokens=params.min_tokens, length_penalty=params.length_penalty,
        early_stopping=params.early_stopping, eos_token_id=stops, pad_token_id=0, output_scores=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    beams = []
    for row in found.sequences[:, len(prompt):].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
        beams.append(row[:end])
    return beams, found


CASES = [  # beam_width, n, length_penalty, early_stopping, max_tokens, min_tokens
    (4, 4, 1.0, False, 20, 0),
    (3, 2, 0.5, True, 16, 0),
    (5, 1, 2.0, False, 24, 0),
    (2, 2, -1.0, False, 12, 0),
    (4, 3, 1.0, False, 20, 12),  # no beam may end before 12 tokens
]


@pytest.mark.parametrize("case", CASES, ids=[f"w{c[0]}-n{c[1]}-lp{c[2]}-early{c[3]}-min{c[5]}" for c in CASES])
def test_beams_equal_transformers(llm: LLM, reference: Any, case: tuple[Any, ...]) -> None:
    width, n, penalty, early, max_tokens, min_tokens = case
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, beam_width=width, n=n,
                            length_penalty=penalty, early_stopping=early, logprobs=True, top_logprobs=2)  # fmt: skip
    stops = sorted(llm.inputs.eos_token_ids)
    assert END in stops
    reasons = set()
    for prompt, result in zip(prompts(), llm.generate(prompts(), params, use_tqdm=False), strict=True):
        beams, found = theirs(reference, prompt, params, stops)
        assert [choice.token_ids for choice in result.choices] == beams
        # Each token's log-probability is transformers' step score for the beam that chose it.
        scores = reference.compute_transition_scores(found.sequences, found.scores, found.beam_indices)
        for choice, row in zip(result.choices, scores, strict=True):
            assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids)
            ours = torch.tensor([token.logprob for token in choice.logprobs])
            torch.testing.assert_close(ours, row[: len(ours)].float(), atol=1e-4, rtol=0)
            assert all(len(token.top_logprobs) == 2 and token.rank >= 1 for token in choice.logprobs)
            stopped = choice.token_ids[-1] in stops
            assert choice.finish_reason == ("stop" if stopped else "length")
            assert stopped or len(choice.token_ids) == max_tokens
            assert len(choice.token_ids) >= min_tokens
            reasons.add(choice.finish_reason)
        assert result.usage.completion_tokens == sum(len(c.token_ids) for c in result.choices)
    if min_tokens == 0:
        assert reasons == {"stop", "length"}, "the prompts end beams both ways"


def test_beams_beside_sampled_requests(llm: LLM) -> None:
    """A batch mixing beam searches and plain requests answers each as it would alone."""
    batch = prompts()[:3]
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    beams = SamplingParams(max_tokens=10, beam_width=3, n=2)
    mixed = llm.generate(batch, [greedy, beams, greedy], use_tqdm=False)
    alone_greedy = llm.generate([batch[0], batch[2]], greedy, use_tqdm=False)
    alone_beams = llm.generate([batch[1]], beams, use_tqdm=False)
    assert [c.token_ids for c in mixed[0].choices] == [c.token_ids for c in alone_greedy[0].choices]
    assert [c.token_ids for c in mixed[2].choices] == [c.token_ids for c in alone_greedy[1].choices]
    assert [c.token_ids for c in mixed[1].choices] == [c.token_ids for c in alone_beams[0].choices]
    assert len(mixed[1].choices) == 2 and mixed[1].choices[0].token_ids != mixed[1].choices[1].token_ids


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": ("x",)}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"logit_bias": {5: 1.0}}, "logit_bias"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"n": 4}, "n"),
        ({"beam_width": 17}, "beam_width"),
        ({"length_penalty": float("nan")}, "length_penalty"),
    ],
)
def test_refusals(llm: LLM, fields: dict[str, Any], param: str) -> None:
    params = SamplingParams(**{"max_tokens": 4, "beam_width": 3, **fields})
    with pytest.raises(ValidationError) as refused:
        llm.generate([prompts()[0]], params, use_tqdm=False)
    assert refused.value.param == param


def test_default_penalty_left_out() -> None:
    """A model's default repetition_penalty is not taken by a beam search (it would be refused); a sampled request
    still takes it."""
    from engine_server.generation_defaults import GenerationDefaults

    defaults = GenerationDefaults(repetition_penalty=1.1)
    assert defaults.sampling_params(beam_width=4).repetition_penalty == 1.0
    assert defaults.sampling_params().repetition_penalty == 1.1


def test_grpc_generate_stream_and_batch(folder: Path, reference: Any, llm: LLM) -> None:
    """Over gRPC, Generate, Stream (the choices whole, in its one message with choices) and Batch answer the beams
    transformers finds."""
    from ladle.v1 import engine_pb2, types_pb2

    prompt = prompts()[0]
    sampling = types_pb2.SamplingParams(max_tokens=16, beam_width=4, n=3, length_penalty=0.8)
    params = SamplingParams(max_tokens=16, beam_width=4, n=3, length_penalty=0.8)
    beams, _ = theirs(reference, prompt, params, sorted(llm.inputs.eos_token_ids))
    message = types_pb2.Input(token_ids=types_pb2.TokenIds(ids=prompt))

    async def served() -> tuple[Any, list[Any], list[Any]]:
        async with grpc_served(folder) as (stub, _):
            whole = await stub.Generate(engine_pb2.GenerateRequest(input=message, sampling=sampling), timeout=60)
            stream = [m async for m in stub.Stream(engine_pb2.StreamRequest(input=message, sampling=sampling),
                                                   timeout=60)]  # fmt: skip
            items = [engine_pb2.BatchRequest(item_id=str(i), request=engine_pb2.GenerateRequest(
                input=message, sampling=sampling)) for i in range(2)]  # fmt: skip
            batch = [m async for m in stub.Batch(iter(items), timeout=60)]
        return whole, stream, batch

    whole, stream, batch = asyncio.run(served())
    assert [list(c.token_ids) for c in whole.choices] == beams
    with_choices = [m for m in stream if m.choices]
    assert len(with_choices) == 1
    assert [list(c.token_ids) for c in with_choices[0].choices] == beams
    answered = [m for m in batch if m.WhichOneof("outcome") == "result"]
    assert len(answered) == 2
    assert all([list(c.token_ids) for c in m.result.choices] == beams for m in answered)


def test_search_keeps_twice_its_width_and_stops_when_no_beam_can_win() -> None:
    """The search on scripted candidates (stop token 0): a step keeps 2 x width candidates, so a beam that ends does
    not take a running place; the search ends, long before its length cap, once no running beam at its present
    length beats the worst finished one (transformers' heuristic)."""
    from engine_server.beam_search import BeamSearch

    search = BeamSearch(2, [0], max_new_tokens=10)
    assert search.wanted == 4
    search.advance([[(0, -0.1), (5, -1.0), (6, -1.2), (7, -3.0)]])
    assert [beam.token_ids for beam in search.running] == [(5,), (6,)]  # 0 ended: it finished, it does not run
    assert not search.done
    search.advance([[(0, -0.2), (8, -2.0), (9, -2.5), (10, -2.6)], [(0, -0.3), (8, -2.1), (9, -2.2), (10, -3.0)]])
    assert search.done and search.length == 2  # the best running beam, -3.0 / 2, cannot beat -1.2 / 2
    assert [found.beam.token_ids for found in search.best(2)] == [(0,), (5, 0)]
    assert [found.score for found in search.best(2)] == pytest.approx([-0.1, -0.6])


def test_min_tokens_asks_room_for_the_dropped_stop_tokens() -> None:
    from engine_server.beam_search import BeamSearch

    search = BeamSearch(3, [0, 1], max_new_tokens=10, min_new_tokens=1)
    assert search.kept == 9 and search.wanted == 11  # (1 + 2 stop tokens) x 3, and the 2 dropped under min_tokens
    search.advance([[(0, -0.1), (1, -0.2), *((t, -1.0 - t / 100) for t in range(2, 11))]])
    assert all(beam.token_ids[0] > 1 for beam in search.running)
    assert search.wanted == 9


def test_a_cancelled_search_leaves_nothing_running(folder: Path) -> None:
    """A caller that goes away mid-search (its RPC cancelled) ends it: the step's requests are aborted in the core and
    no later step starts."""
    import grpc

    from ladle.v1 import engine_pb2, types_pb2

    message = types_pb2.Input(token_ids=types_pb2.TokenIds(ids=prompts()[0]))
    sampling = types_pb2.SamplingParams(max_tokens=200, beam_width=4, ignore_eos=True)

    async def served() -> tuple[int, bool]:
        async with grpc_served(folder) as (stub, engine):
            call = stub.Generate(engine_pb2.GenerateRequest(input=message, sampling=sampling), timeout=60)
            for _ in range(500):  # (until a step runs)
                if engine.loop._streams:
                    break
                await asyncio.sleep(0.005)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            for _ in range(200):
                if not engine.loop._streams:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # (a step that would still start after the cancel)
            return len(engine.loop._streams), await call.code() == grpc.StatusCode.CANCELLED

    left, cancelled = asyncio.run(served())
    assert cancelled and left == 0


def test_best_of_answers_the_sampled_choices_with_the_best_mean_logprob(folder: Path, llm: LLM) -> None:
    """OpenAI's best_of: best_of choices sampled (seeded: reproducible), the n whose tokens' mean raw log-probability
    is highest answered, best first; usage counts every sampled token; log-probabilities only where asked. Offline and
    over gRPC alike; below n, or with beam search, it is refused."""
    from ladle.v1 import engine_pb2, types_pb2

    prompt = prompts()[1]
    sampled = llm.generate([prompt], SamplingParams(n=5, seed=11, max_tokens=12, logprobs=True), use_tqdm=False)[0]

    def mean(choice: Any) -> float:
        return sum(t.logprob for t in choice.logprobs) / len(choice.logprobs)

    expected = [c.token_ids for c in sorted(sampled.choices, key=mean, reverse=True)[:2]]
    assert len({tuple(ids) for ids in expected}) == 2
    (best,) = llm.generate([prompt], SamplingParams(n=2, best_of=5, seed=11, max_tokens=12), use_tqdm=False)
    assert [c.token_ids for c in best.choices] == expected and [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == sampled.usage.completion_tokens
    cases: list[tuple[dict[str, Any], str]] = [({"n": 3, "best_of": 2}, "best_of"),
                                               ({"beam_width": 3, "best_of": 3}, "best_of")]  # fmt: skip
    for fields, param in cases:
        with pytest.raises(ValidationError) as refused:
            llm.generate([prompt], SamplingParams(max_tokens=4, **fields), use_tqdm=False)
        assert refused.value.param == param

    async def served() -> Any:
        async with grpc_served(folder) as (stub, _):
            return await stub.Generate(engine_pb2.GenerateRequest(
                input=types_pb2.Input(token_ids=types_pb2.TokenIds(ids=prompt)),
                sampling=types_pb2.SamplingParams(n=2, best_of=5, seed=11, max_tokens=12)), timeout=60)  # fmt: skip

    assert [list(c.token_ids) for c in asyncio.run(served()).choices] == expected
