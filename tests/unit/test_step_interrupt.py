"""A running BATCH step stopped between layers (engine_server.step_interrupt) is taken back whole: scheduling it
again starts from the very same state, no cache hit finds a block it published, and every request's tokens are
those of a run that was never stopped."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from typing import Any

import pytest
import torch

from engine_server.core.engine_core import EngineCore
from engine_server.core.request import Priority, Request, RequestStatus
from engine_server.core.scheduler import Scheduler
from engine_server.core.scheduler_output import SchedulerOutput
from engine_server.model_runner import LaunchedStep
from engine_server.sampling_params import SamplingParams
from engine_server.server.engine_loop import EngineLoop, RequestStream
from engine_server.step_interrupt import StepInterrupt
from ladle_kernels import cpu_ops as cpu
from tests.unit.factories import VOCAB, make_request, make_scheduler
from tests.unit.runner_factories import MAX_MODEL_LEN, tiny_engine_config, tiny_source

PREFIX = [(11 * i + 5) % VOCAB for i in range(16)]  # four blocks of the tiny engine's 4 tokens

QUANTIZATIONS = [
    "none",
    pytest.param(
        "int8", marks=pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")
    ),
]


def _shape(output: SchedulerOutput) -> list[tuple[str, int, int, bool, int]]:
    return [
        (item.request_id, item.start_position, item.num_new_tokens, item.needs_sample, item.num_cached_tokens)
        for item in output.scheduled
    ]


def _state(scheduler: Scheduler) -> tuple[object, ...]:
    """What the next `schedule()` depends on, but for the blocks held (a stopped step's allocations are kept) and
    the cached ones (`_cached`)."""
    requests = sorted(scheduler._requests.values(), key=lambda r: r.request_id)
    return (
        [(r.request_id, r.status, r.num_computed_tokens, r.num_pending_tokens, r.num_cached_tokens) for r in requests],
        [r.request_id for r in scheduler._running],
        {p: [r.request_id for r in q] for p, q in scheduler._waiting.items()},
    )


def _cached(scheduler: Scheduler) -> dict[bytes, int]:
    return dict(scheduler.kv_cache.pool._cached)


def test_undo_returns_the_scheduler_to_where_it_was_at_every_step_of_a_random_workload() -> None:
    rng = random.Random(7)
    scheduler = make_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=24, max_num_seqs=6)
    shared = [rng.randrange(VOCAB) for _ in range(10)]
    added = 0
    undone = published_undone = 0
    for step in range(400):
        for _ in range(rng.choice((0, 0, 0, 1, 2))):
            prompt = [*shared[: rng.randrange(11)], *(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 14)))]
            priority = rng.choice((Priority.BATCH, Priority.BATCH, Priority.INTERACTIVE))
            scheduler.add_request(make_request(f"r{added}", prompt, max_tokens=rng.randrange(1, 9), priority=priority))
            added += 1
        before, cached = _state(scheduler), _cached(scheduler)
        output = scheduler.schedule(now=float(step))
        if rng.random() < 0.5 and output.scheduled:
            published_undone += len(scheduler.kv_cache._step_registered)
            scheduler.undo(output)
            undone += 1
            assert _state(scheduler) == before
            # Nothing the step published stays cached; a block it evicted for its allocations stays evicted.
            assert _cached(scheduler).items() <= cached.items()
            again = scheduler.schedule(now=float(step))
            assert _shape(again) == _shape(output)
            output = again
        scheduler.update_from_output(output, [rng.randrange(VOCAB) for item in output.scheduled if item.needs_sample])
    assert undone > 100 and published_undone > 20  # blocks published by the undone steps were taken back
    assert added > 150


def test_a_block_published_by_a_stopped_step_is_no_cache_hit() -> None:
    scheduler = make_scheduler(num_blocks=20, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", [*PREFIX, 1, 2], priority=Priority.BATCH))
    output = scheduler.schedule(now=0.0)
    assert len(scheduler.kv_cache._step_registered) == 4
    scheduler.undo(output)
    late = make_request("b", [*PREFIX, 3])
    assert scheduler.kv_cache.get_computed_blocks(late) == ([], 0)
    assert scheduler.kv_cache.num_free_blocks == 20


def _engine(quantization: str, *, prefill_chunk: int = 1024) -> EngineCore:
    config = tiny_engine_config()
    config = dataclasses.replace(
        config,
        quantization=quantization,
        cache=dataclasses.replace(config.cache, enable_prefix_caching=True),
        scheduler=dataclasses.replace(config.scheduler, max_num_batched_tokens=prefill_chunk, batch_step_target_s=0),
    )
    core = EngineCore(config, tiny_source())
    # Slots hold noise until written: a read of K/V that no step wrote shows in the tokens.
    generator = torch.Generator().manual_seed(0)
    for cache in core.runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=generator) * 100)
    return core


def _request(request_id: str, prompt: list[int], max_tokens: int, priority: Priority = Priority.BATCH) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, prompt, params, max_model_len=MAX_MODEL_LEN, priority=priority)


def _run(
    core: EngineCore, requests: list[Request], stop_before: set[int] = frozenset(),  # type: ignore[assignment]
    late: dict[int, list[Request]] | None = None,
) -> dict[str, list[int]]:
    """Step until done; `step_interrupt` is set before the steps in `stop_before` (so such a step stops after its
    first layer) and `late[i]` are added before step i. Returns each request's tokens."""
    interrupt = core.step_interrupt
    assert interrupt is not None
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {}
    step = 0
    while core.has_unfinished() or step in (late or {}):
        for request in (late or {}).get(step, []):
            core.add_request(request)
        if step in stop_before:
            interrupt.set()
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(token.token_id for token in output.new_tokens)
        interrupt.clear()
        step += 1
    return tokens


def _batch(n: int) -> list[Request]:
    return [_request(f"b{i}", [*PREFIX[: 4 * (i % 5)], *range(100 + 7 * i, 103 + 9 * i)], 6 + i % 4) for i in range(n)]


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_stopped_steps_change_no_token(quantization: str) -> None:
    expected = _run(_engine(quantization), _batch(8))
    core = _engine(quantization, prefill_chunk=20)  # chunked prefills: stopped steps hold prefill and decode rows
    got = _run(core, _batch(8), stop_before={0, 1, 4, 7, 10, 12})
    assert got == expected
    # Step 1 is the BATCH step right after a stopped one: not stopped, however set its flag was.
    assert core.num_interrupted_steps == 5
    assert core.scheduler.kv_cache.num_used_blocks == 0


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_an_interactive_arrival_sharing_a_prefix_the_stopped_step_published_computes_it_itself(
    quantization: str,
) -> None:
    chat = [*PREFIX, 900, 901]
    alone = _run(_engine(quantization), [_request("chat", chat, 5, Priority.INTERACTIVE)])
    core = _engine(quantization, prefill_chunk=8)
    # Step 0 prefills b's first 8 tokens, step 1 (stopped) the next 8, publishing PREFIX's last two blocks with
    # only the first layer's K/V written; then the chat arrives.
    late = {2: [_request("chat", chat, 5, Priority.INTERACTIVE)]}
    got = _run(core, [_request("b", [*PREFIX, 1, 2, 3], 4)], stop_before={1}, late=late)
    assert core.num_interrupted_steps == 1
    assert got["chat"] == alone["chat"]


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_a_step_with_interactive_rows_is_never_stopped(quantization: str) -> None:
    core = _engine(quantization)
    requests = [_request("chat", [1, 2, 3], 6, Priority.INTERACTIVE), *_batch(3)]
    _run(core, requests, stop_before=set(range(6)))
    assert core.num_interrupted_steps == 0


def test_the_flag_is_read_without_torch_and_shared_with_the_tensor() -> None:
    interrupt = StepInterrupt()
    assert not interrupt.is_set() and interrupt.tensor.dtype == torch.int32
    interrupt.set()
    assert interrupt.is_set() and int(interrupt.tensor[0]) == 1
    interrupt.clear()
    assert int(interrupt.tensor[0]) == 0


def test_undone_admissions_keep_their_queue_order_and_status() -> None:
    scheduler = make_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=64)
    for name in "abc":
        scheduler.add_request(make_request(name, 6, priority=Priority.BATCH))
    output = scheduler.schedule(now=0.0)
    assert [item.request_id for item in output.scheduled] == ["a", "b", "c"]
    scheduler.undo(output)
    queue = scheduler._waiting[Priority.BATCH]
    assert [r.request_id for r in queue] == ["a", "b", "c"]
    assert all(r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 for r in queue)
    assert scheduler.num_running == 0 and scheduler.kv_cache.num_free_blocks == 40


def test_only_an_interactive_submission_sets_the_flag() -> None:
    core = _engine("none")
    loop = EngineLoop(core, asyncio.new_event_loop())  # not started: nothing clears the flag
    assert core.step_interrupt is not None
    loop.add("batch", [_request("b", [1, 2, 3], 2)])
    assert not core.step_interrupt.is_set()
    loop.add("chat", [_request("c", [1, 2, 3], 2, Priority.INTERACTIVE)])
    assert core.step_interrupt.is_set()


async def _tokens(stream: RequestStream) -> list[int]:
    tokens: list[int] = []
    while True:
        for output in await stream.next():
            tokens += [token.token_id for token in output.new_tokens]
            if output.finished:
                return tokens


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_an_interactive_request_added_during_a_batch_step_stops_it(
    quantization: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chat is added while the engine thread is inside a BATCH step (held there by the test), so the step
    stops after its first layer; the chat then runs, and every request gets the tokens of an unstopped run."""
    chat = _request("chat", [*PREFIX, 7], 4, Priority.INTERACTIVE)
    expected = _run(_engine(quantization), [*_batch(4), chat])
    core = _engine(quantization)
    inside, added = threading.Event(), threading.Event()
    launch = core.runner.launch

    def held_launch(output: SchedulerOutput, interrupt: Any = None) -> LaunchedStep:
        if interrupt is not None and not inside.is_set():
            inside.set()
            added.wait(10)
        return launch(output, interrupt)

    monkeypatch.setattr(core.runner, "launch", held_launch)

    async def serve() -> dict[str, list[int]]:
        loop = EngineLoop(core, asyncio.get_running_loop())
        loop.start()
        try:
            streams = [loop.add(request.request_id, [request]) for request in _batch(4)]
            await asyncio.to_thread(inside.wait, 10)
            chat_stream = loop.add("chat", [_request("chat", [*PREFIX, 7], 4, Priority.INTERACTIVE)])
            added.set()
            results = await asyncio.gather(*(_tokens(stream) for stream in [*streams, chat_stream]))
        finally:
            await asyncio.to_thread(loop.stop)
        return {stream.request_id: tokens for stream, tokens in zip([*streams, chat_stream], results, strict=True)}

    assert asyncio.run(serve()) == expected
    assert core.num_interrupted_steps == 1
