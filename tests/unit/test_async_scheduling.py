"""Async scheduling: step N+1 is scheduled and launched before step N's tokens reach the host.

On the CPU every op is synchronous, so nothing overlaps here, but the bookkeeping is the same as on a GPU:
pending tokens, inputs taken from the previous launch's sampled tensor, requests that end while the next step
is already launched, preemption and aborts in between. Every test compares against the synchronous engine on
the same tiny random-weight model: the outputs must be the same, token for token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine_server.attention_metadata import DecodeLayout
from engine_server.core.engine_core import CoreOutput, EngineCore
from engine_server.core.request import Priority, Request, RequestStatus
from engine_server.core.scheduler_output import SchedulerOutput
from engine_server.core.step_timing import StepTimeModel
from engine_server.cuda_graphs import EagerCapture
from engine_server.sampling_params import SamplingParams
from tests.unit.factories import VOCAB
from tests.unit.runner_factories import MAX_MODEL_LEN, TINY_LLAMA, tiny_engine_config, tiny_source

PROMPT_LENS = [3, 17, 5, 40, 9, 12, 1, 33, 7, 21, 4, 15, 28, 2, 11, 19]


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: RequestStatus | None = None
    stop_token_id: int | None = None


def _core(async_scheduling: bool, **cache: int) -> EngineCore:
    config = tiny_engine_config(max_num_seqs=32)
    if cache:
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, **cache))
    return EngineCore(dataclasses.replace(config, async_scheduling=async_scheduling), tiny_source())


def _prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % VOCAB for j in range(PROMPT_LENS[i % len(PROMPT_LENS)])]


def _requests(params: Callable[[int], SamplingParams], count: int = len(PROMPT_LENS)) -> list[Request]:
    return [
        Request(f"r{i}", _prompt(i), params(i), max_model_len=MAX_MODEL_LEN, eos_token_ids=(7,)) for i in range(count)
    ]


def _run(
    core: EngineCore, requests: list[Request], on_step: Callable[[int, EngineCore], None] | None = None
) -> tuple[dict[str, Result], list[list[CoreOutput]]]:
    """Step until done; per request its tokens, logprobs and finish; and the outputs of every call."""
    for request in requests:
        core.add_request(request)
    results = {request.request_id: Result() for request in requests}
    calls: list[list[CoreOutput]] = []
    while core.has_unfinished():
        if on_step is not None:
            on_step(len(calls), core)
        outputs = core.step()
        calls.append(outputs)
        for output in outputs:
            result = results.setdefault(output.request_id, Result())  # or one `on_step` added
            assert result.status is None, f"{output.request_id} produced after it finished"
            for token in output.new_tokens:
                result.tokens.append(token.token_id)
                if token.logprobs is not None:
                    result.logprobs.append(token.logprobs.logprob)
            if output.finished:
                result.status, result.stop_token_id = output.status, output.stop_token_id
        assert len(calls) < 1000, "the engine did not finish"
    assert core.scheduler.kv_cache.num_used_blocks == 0
    return results, calls


def _compare(params: Callable[[int], SamplingParams], **cache: int) -> dict[str, Result]:
    expected, _ = _run(_core(False, **cache), _requests(params))
    actual, _ = _run(_core(True, **cache), _requests(params))
    assert actual == expected
    return actual


def test_async_defaults_follow_the_device() -> None:
    assert not EngineCore(tiny_engine_config(), tiny_source()).async_scheduling  # the CPU: off
    assert _core(True).async_scheduling


def test_outputs_arrive_one_call_later_and_equal_the_synchronous_ones() -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    sync_results, sync_calls = _run(_core(False), _requests(lambda i: greedy, count=4))
    async_results, async_calls = _run(_core(True), _requests(lambda i: greedy, count=4))
    assert async_results == sync_results
    assert all(len(r.tokens) == 6 and r.status is RequestStatus.FINISHED_LENGTH for r in async_results.values())
    assert async_calls[0] == []  # the first step's tokens are still on the way
    assert async_calls[1:] == sync_calls  # the same outputs, one call later
    assert len(async_calls) == len(sync_calls) + 1


def test_greedy_seeded_and_logprobs_with_varied_lengths_and_stops() -> None:
    """Requests end at different steps by length, eos and stop ids, so a launched step often holds a row of a
    request the step before ended: that row's token must be dropped, never reported."""

    def params(i: int) -> SamplingParams:
        sampled = i % 2 == 1
        return SamplingParams(
            temperature=0.9 if sampled else 0.0,
            top_p=0.9 if i % 4 == 1 else 1.0,
            seed=1000 + i if sampled else None,
            max_tokens=3 + (i * 5) % 11,
            stop_token_ids=(i % 50, 100 + i) if i % 3 == 0 else (),
            logprobs=i % 5 == 0,
        )

    results = _compare(params)
    statuses = {r.status for r in results.values()}
    assert RequestStatus.FINISHED_LENGTH in statuses


def test_preemption_with_a_token_on_the_way() -> None:
    """A pool of 24 four-token blocks for 16 requests forces preemptions, some of a request whose token is
    pending; it re-prefills once the token lands and ends as the synchronous engine does."""
    block_bytes = 2 * 4 * TINY_LLAMA.num_key_value_heads * TINY_LLAMA.head_dim * 4 * 2
    _compare(lambda i: SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), memory_bytes=40 * block_bytes)


def test_penalties_and_min_tokens_complete_their_steps_at_once() -> None:
    """Requests whose sampling needs every output on the host never run ahead; the others still do."""

    def params(i: int) -> SamplingParams:
        if i % 4 == 0:
            return SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.3)
        if i % 4 == 1:
            return SamplingParams(temperature=0.0, max_tokens=6, presence_penalty=0.5, frequency_penalty=0.5)
        if i % 4 == 2:
            return SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4)
        return SamplingParams(temperature=0.0, max_tokens=6)

    _compare(params)
    core = _core(True)
    for request in _requests(lambda i: SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2), count=2):
        core.add_request(request)
    assert core.step() != []  # completed within the call


@pytest.mark.parametrize("when", [0, 1, 2, 3])
def test_abort_while_a_step_is_in_flight(when: int) -> None:
    """An abort between calls: the aborted request reports its abort and nothing after it; the others are
    unaffected and every block comes back."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    aborted: list[CoreOutput] = []

    def abort(call: int, core: EngineCore) -> None:
        if call == when + 1:
            aborted.extend(core.abort_requests(["r1"]))

    expected, _ = _run(_core(False), _requests(lambda i: greedy, count=4), abort)
    aborted.clear()
    actual, _ = _run(_core(True), _requests(lambda i: greedy, count=4), abort)
    assert [o.status for o in aborted] == [RequestStatus.FINISHED_ABORTED]
    assert actual["r1"].status is None  # its abort came from abort_requests, not from a step
    for request_id in ("r0", "r2", "r3"):
        assert actual[request_id] == expected[request_id]
    # What r1 reported is a prefix of its synchronous tokens: at most what was collected before the abort.
    assert expected["r1"].tokens[: len(actual["r1"].tokens)] == actual["r1"].tokens


def test_pending_tokens_reach_the_decode_graphs() -> None:
    """With the decode graphs' static buffers (eager stand-in), pending inputs are patched into the buffer."""
    greedy = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    expected, _ = _run(_core(False), _requests(lambda i: greedy))
    core = _core(True)
    graphs = core.runner.capture_decode_graphs(EagerCapture())
    actual, _ = _run(core, _requests(lambda i: greedy))
    assert actual == expected
    assert sum(graphs.replays.values()) >= 7


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sampling_metadata_reused_across_steps_samples_what_a_fresh_build_does(async_scheduling: bool) -> None:
    """A batch of the same requests reuses its sampling metadata (the seeded rows' keys redone at their new
    positions); the batch changes as requests end, and penalty rows keep it from being reused at all."""

    def params(i: int) -> SamplingParams:
        return SamplingParams(
            temperature=2.0 if i % 3 else 0.0,  # flat: a wrong key would show
            top_p=0.9 if i % 2 else 1.0,
            seed=77 + i if i % 3 else None,
            max_tokens=12 + i % 2,  # steady batches, changing twice at the end
            repetition_penalty=1.2 if i == 5 and async_scheduling else 1.0,
            logprobs=i % 4 == 0,
        )

    def rebuild_every_step(_: int, core: EngineCore) -> None:
        core.runner._sampling_cache = None

    fresh, _ = _run(_core(async_scheduling), _requests(params), rebuild_every_step)
    reused, _ = _run(_core(async_scheduling), _requests(params))
    assert reused == fresh


@pytest.mark.parametrize(("graphs", "budget"), [(False, None), (True, None), (False, 4)])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_kept_decode_layout_and_tokens_give_what_a_fresh_build_does(
    async_scheduling: bool, graphs: bool, budget: int | None
) -> None:
    """Steady decode steps keep their layout and read their tokens from the last launch's tensor; the batch
    changes as requests end, and a small KV pool preempts and readmits requests. With a budget of 4 tokens a
    step and 4 seats, a prompt advances a token at a time beside 3 decode rows: steps of single tokens where a
    row samples nothing, whose inputs are not the last launch's tokens."""
    block_bytes = 2 * 4 * TINY_LLAMA.num_key_value_heads * TINY_LLAMA.head_dim * 4 * 2

    def params(i: int) -> SamplingParams:
        length = 10 if budget is None else 40  # long enough, with a small budget, for prompts to trickle in
        return SamplingParams(temperature=1.5 if i % 2 else 0.0, seed=5 + i, max_tokens=length + i % 5, ignore_eos=True)

    def core() -> EngineCore:
        made = _core(async_scheduling, memory_bytes=(44 if budget is None else 160) * block_bytes)
        if budget is not None:
            scheduler = made.scheduler.config
            made.scheduler.config = dataclasses.replace(scheduler, max_num_batched_tokens=budget, max_num_seqs=budget)
        if graphs:
            made.runner.capture_decode_graphs(EagerCapture())
        return made

    def rebuild_every_step(_: int, core: EngineCore) -> None:
        core.runner._decode_rows.invalidate()

    fresh, _ = _run(core(), _requests(params), rebuild_every_step)
    kept_core = core()
    layout = kept_core.runner._decode_rows.layout_columns  # both the rows' and a steady step's columns come here
    continued: list[bool] = []

    def counted(requests: list[Request], tables: list[list[int]], starts: Any) -> tuple[DecodeLayout, bool]:
        result = layout(requests, tables, starts)
        continued.append(result[1])
        return result

    kept_core.runner._decode_rows.layout_columns = counted  # type: ignore[method-assign]
    kept, _ = _run(kept_core, _requests(params))
    assert kept == fresh
    assert sum(continued) >= 5 and not all(continued)  # both paths ran
    assert budget is not None or kept_core.scheduler.total_preemptions > 0  # 4 seats need no preemption


class _FixedStepTime(StepTimeModel):
    """A step-time model that has learned 10 ms a token (three rows fit its 0.03 s target; a quiet spell's 3 s
    target holds any step here) and learns no more."""

    def __init__(self) -> None:
        super().__init__(0.03, min_chunk=4, quiet_factor=100.0)
        for prefill, rows in [(8, 0), (0, 3), (4, 2)] * 3:
            super().observe(prefill, rows, 0.01 * (prefill + rows))

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        pass


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batch_rows_held_back_by_the_step_target_decode_what_a_fresh_build_does(async_scheduling: bool) -> None:
    """With interactive requests about, batch decode rows past the step-time target sit steps out and come back
    later, in rank order: their inputs then come from the host (the kept layout cannot continue), and with
    async scheduling a row may sit out while its token is on the way. Same outputs as rebuilding every step."""

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.5 if i % 2 else 0.0, seed=5 + i, max_tokens=8 + i % 5, ignore_eos=True)

    def arrive(step: int, core: EngineCore) -> None:
        if step == 2:  # six BATCH requests decode, all in one step; now interactive requests arrive
            for request in _requests(params, count=8)[6:]:
                core.add_request(request)

    def requests() -> list[Request]:
        made = _requests(params, count=6)
        for request in made:
            request.priority = Priority.BATCH
        return made

    def core() -> EngineCore:
        made = _core(async_scheduling)
        made.step_time = made.scheduler.step_time = _FixedStepTime()
        return made

    def rebuild_every_step(step: int, core: EngineCore) -> None:
        arrive(step, core)
        core.runner._decode_rows.invalidate()

    fresh, _ = _run(core(), requests(), rebuild_every_step)
    held_core = core()
    rows: list[tuple[int, int]] = []  # (decode rows scheduled, requests running) per step
    schedule = held_core.scheduler.schedule

    def counted(now: float | None = None) -> SchedulerOutput:
        out = schedule(now)
        rows.append((out.num_decode_rows, held_core.scheduler.num_running))
        return out

    held_core.scheduler.schedule = counted  # type: ignore[method-assign]
    held, _ = _run(held_core, requests(), arrive)
    assert held == fresh and len(held) == 8
    assert rows[1] == (6, 6)  # before the interactive requests: every row
    assert max(scheduled for scheduled, _ in rows[3:]) == 3  # after: never more rows than the target holds
    assert any(running > 3 and scheduled == 3 for scheduled, running in rows[3:])  # and rows sat out
