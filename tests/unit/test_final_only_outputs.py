"""Final-only requests: the core reports them once, at the finish, with every token; the rest per step.

The offline API and the engine's non-streaming calls mark requests `final_only` so the core builds no output
per step for them. What they receive must be what a per-step reader would have assembled: the same tokens in
order, the same log-probabilities, the same finish, whether the request ends by length, by eos, by an abort in
the middle, or with async scheduling (tokens arriving one call later).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from engine_server.core.engine_core import CoreOutput, EngineCore, coalesce
from engine_server.core.request import Request, RequestStatus
from engine_server.model_runner import SampledToken
from engine_server.sampling_params import SamplingParams
from engine_server.server.engine_loop import RequestStream
from tests.unit.factories import VOCAB
from tests.unit.runner_factories import MAX_MODEL_LEN, tiny_engine_config, tiny_source

Outcome = tuple[list[int], list[float], RequestStatus | None, int]  # tokens, logprobs, finish, outputs seen


def _requests(final_only: bool, count: int = 6) -> list[Request]:
    requests = []
    for i in range(count):
        params = SamplingParams(
            temperature=0.0 if i % 2 == 0 else 0.8,
            seed=i,
            max_tokens=3 + 2 * i,
            logprobs=i % 3 == 0,
            top_logprobs=2 if i % 3 == 0 else 0,
        )
        prompt = [(31 * i + 7 * j) % VOCAB for j in range(5 + i)]
        request = Request(f"r{i}", prompt, params, max_model_len=MAX_MODEL_LEN, eos_token_ids=(7,))
        request.final_only = final_only
        requests.append(request)
    return requests


def _run(final_only: bool, async_scheduling: bool, abort_at: int | None = None) -> dict[str, Outcome]:
    config = dataclasses.replace(tiny_engine_config(max_num_seqs=8), async_scheduling=async_scheduling)
    core = EngineCore(config, tiny_source())
    for request in _requests(final_only):
        core.add_request(request)
    seen: dict[str, Outcome] = {}
    calls = 0
    while core.has_unfinished():
        outputs = core.step()
        calls += 1
        if calls == abort_at:
            outputs += core.abort_requests(["r4", "r5"])
        for output in outputs:
            tokens, logprobs, status, count = seen.get(output.request_id, ([], [], None, 0))
            assert status is None, f"{output.request_id} reported after its finish"
            tokens += [t.token_id for t in output.new_tokens]
            logprobs += [t.logprobs.logprob for t in output.new_tokens if t.logprobs is not None]
            seen[output.request_id] = (tokens, logprobs, output.status, count + 1)
    assert core.scheduler.kv_cache.num_used_blocks == 0
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("abort_at", [None, 3])
def test_final_only_requests_get_one_output_equal_to_the_per_step_ones(
    async_scheduling: bool, abort_at: int | None
) -> None:
    per_step = _run(False, async_scheduling, abort_at)
    final = _run(True, async_scheduling, abort_at)
    assert set(final) == set(per_step)
    for request_id, (tokens, logprobs, status, count) in final.items():
        assert (tokens, logprobs, status) == per_step[request_id][:3], request_id
        assert status is not None and count == 1, f"{request_id}: {count} outputs"
    assert any(per_step[rid][3] > 1 for rid in per_step)  # the per-step run did report per step
    if abort_at is not None:
        assert final["r5"][2] is RequestStatus.FINISHED_ABORTED and final["r5"][0]  # tokens before the abort


def _output(request_id: str, tokens: list[int], status: RequestStatus | None = None) -> CoreOutput:
    return CoreOutput(request_id, [SampledToken(t) for t in tokens], status, None, 0)


def test_coalesce_merges_steps_per_request_in_order() -> None:
    merged = coalesce(
        [
            _output("a/0", [1]),
            _output("b/0", [5]),
            _output("a/0", [2]),
            _output("a/0", [3], RequestStatus.FINISHED_STOPPED),
        ]
    )
    assert [(o.request_id, [t.token_id for t in o.new_tokens], o.status) for o in merged] == [
        ("a/0", [1, 2, 3], RequestStatus.FINISHED_STOPPED),
        ("b/0", [5], None),
    ]


def test_a_stream_that_fell_behind_reads_its_steps_as_one_then_the_error() -> None:
    async def read() -> None:
        stream = RequestStream("a", ["a/0", "a/1"])
        stream._put([_output("a/0", [1])])
        assert [t.token_id for t in (await stream.next())[0].new_tokens] == [1]  # one step: as it came
        stream._put([_output("a/0", [2]), _output("a/1", [8])])
        stream._put([_output("a/0", [3], RequestStatus.FINISHED_LENGTH)])
        stream._put(RuntimeError("engine failed"))
        stream._put([_output("a/1", [9])])
        merged = await stream.next()
        assert [(o.request_id, [t.token_id for t in o.new_tokens], o.status) for o in merged] == [
            ("a/0", [2, 3], RequestStatus.FINISHED_LENGTH),
            ("a/1", [8], None),
        ]
        with pytest.raises(RuntimeError, match="engine failed"):
            await stream.next()  # after the outputs that came before it
        assert [t.token_id for t in (await stream.next())[0].new_tokens] == [9]

    asyncio.run(read())
