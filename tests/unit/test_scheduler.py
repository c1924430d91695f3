"""Scheduler: token budget, priorities, chunked prefill, prefix sharing, preemption, stops, aborts."""

from __future__ import annotations

from typing import Any

import pytest

from engine_server.core.request import Priority, Request, RequestStatus
from engine_server.core.scheduler import Scheduler
from engine_server.core.scheduler_output import SchedulerOutput
from engine_server.errors import QueueFullError
from tests.unit.factories import (
    FakeRunner,
    expected_output,
    make_request,
    make_scheduler,
    run_until_done,
)

BATCH = Priority.BATCH


def step(sched: Scheduler, runner: FakeRunner, now: float = 0.0) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step; returns (output, requests finished by sampling)."""
    out = sched.schedule(now=now)
    return out, sched.update_from_output(out, runner.step(out))


def chunks(out: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: s.num_new_tokens for s in out.scheduled}


def test_budget_split_between_decodes_and_chunked_prefill() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(16)
    for i in range(3):
        sched.add_request(make_request(f"d{i}", 10, max_tokens=50))
    out, _ = step(sched, runner)
    assert chunks(out) == {"d0": 10, "d1": 10, "d2": 10}
    assert all(s.needs_sample for s in out.scheduled)

    sched.add_request(make_request("long", 150))
    out, _ = step(sched, runner)
    assert chunks(out) == {"d0": 1, "d1": 1, "d2": 1, "long": 61}
    assert out.num_batched_tokens == 64
    long_item = out.scheduled[-1]
    assert (long_item.start_position, long_item.needs_sample) == (0, False)

    out, _ = step(sched, runner)  # the running prefill continues with what the decodes leave
    assert chunks(out) == {"d0": 1, "d1": 1, "d2": 1, "long": 61}
    assert out.scheduled[-1].start_position == 61
    out, _ = step(sched, runner)
    assert chunks(out) == {"d0": 1, "d1": 1, "d2": 1, "long": 28}
    assert out.scheduled[-1].needs_sample and out.num_batched_tokens == 31
    assert sched.get_request("long").num_output_tokens == 1  # type: ignore[union-attr]


def test_max_num_seqs_caps_running() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=1000)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 5))
    out, _ = step(sched, FakeRunner(16))
    assert list(chunks(out)) == ["r0", "r1"]
    assert (sched.num_running, sched.num_waiting) == (2, 2)


def test_priority_then_fifo_order() -> None:
    sched = make_scheduler(max_num_batched_tokens=20)
    runner = FakeRunner(16)
    sched.add_request(make_request("b1", 10, priority=BATCH, arrival_time=0.0))
    sched.add_request(make_request("i1", 10, arrival_time=1.0))
    sched.add_request(make_request("b2", 10, priority=BATCH, arrival_time=2.0))
    sched.add_request(make_request("i2", 10, arrival_time=3.0))
    out, _ = step(sched, runner)
    assert list(chunks(out)) == ["i1", "i2"]
    out, _ = step(sched, runner)  # two decodes, then the batch class gets the rest of the budget
    assert chunks(out) == {"i1": 1, "i2": 1, "b1": 10, "b2": 8}


def test_preemption_picks_lowest_priority_latest_arrival_and_requeues_at_front() -> None:
    # 4 blocks of 4 tokens. Each request holds one full block after prefill and needs a second to decode.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=100, enable_prefix_caching=False)
    runner = FakeRunner(4)
    sched.add_request(make_request("i_old", 4, arrival_time=0.0, max_tokens=20))
    sched.add_request(make_request("b_old", 4, priority=BATCH, arrival_time=1.0, max_tokens=20))
    sched.add_request(make_request("b_new", 4, priority=BATCH, arrival_time=2.0, max_tokens=20))
    sched.add_request(make_request("i_new", 4, arrival_time=3.0, max_tokens=20))
    step(sched, runner)  # all four prefill, filling the pool
    sched.add_request(make_request("b_newest", 4, priority=BATCH, arrival_time=4.0))
    out, _ = step(sched, runner)
    # i_old needs a block: b_new goes (batch, latest). i_new needs one too: b_old goes. b_old's own turn
    # never comes, so it is not scheduled this step.
    assert out.preempted_ids == ["b_new", "b_old"]
    assert list(chunks(out)) == ["i_old", "i_new"]
    assert sched.kv_cache.num_free_blocks == 0
    # Preempted requests go back to the front of their class, earlier arrival first, before b_newest.
    assert [r.request_id for r in sched._waiting[BATCH]] == ["b_old", "b_new", "b_newest"]
    assert sched.get_request("b_new").num_computed_tokens == 0  # type: ignore[union-attr]
    assert sched.get_request("b_new").num_preemptions == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_storm_completes_every_request_with_correct_outputs(prefix_caching: bool) -> None:
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=32, enable_prefix_caching=prefix_caching)
    runner = FakeRunner(4)
    shared = list(range(500, 512))
    reqs = [
        make_request(
            f"r{i}",
            [*shared, *range(i * 10, i * 10 + 3 + i % 5)] if i % 2 else 5 + 3 * i,
            max_tokens=20 + i,
            priority=BATCH if i % 3 == 0 else Priority.INTERACTIVE,
            arrival_time=float(i),
        )
        for i in range(10)
    ]
    for r in reqs:
        sched.add_request(r)
    finished = run_until_done(sched, runner)

    assert {r.request_id for r in finished} == {r.request_id for r in reqs}
    assert sum(r.num_preemptions for r in reqs) > 0
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens)
    assert sched.kv_cache.num_free_blocks == 24 and sched.kv_usage == 0.0
    assert (sched.num_running, sched.num_waiting) == (0, 0)


def test_prefix_shared_with_running_request_and_in_same_step() -> None:
    sched = make_scheduler(num_blocks=200, max_num_batched_tokens=4096)
    runner = FakeRunner(16)
    prompt = list(range(500))
    # n=3 of one prompt, admitted in one step: the later copies reuse blocks the first is about to write.
    for i in range(3):
        sched.add_request(make_request(f"n{i}", prompt))
    out, _ = step(sched, runner)
    assert [s.num_cached_tokens for s in out.scheduled] == [0, 496, 496]
    assert [s.num_new_tokens for s in out.scheduled] == [500, 4, 4]
    tables = [s.block_ids for s in out.scheduled]
    assert tables[1][:31] == tables[0][:31] == tables[2][:31]
    assert len({t[31] for t in tables}) == 3
    assert sched.get_request("n1").num_cached_tokens == 496  # type: ignore[union-attr]

    sched.add_request(make_request("later", [*prompt[:490], 1, 2, 3]))
    out, _ = step(sched, runner)
    assert out.scheduled[-1].num_cached_tokens == 480
    run_until_done(sched, runner)
    assert sched.kv_cache.num_free_blocks == 200


def test_abort_frees_blocks_in_every_state() -> None:
    sched = make_scheduler(num_blocks=20, max_num_batched_tokens=40, max_num_seqs=2)
    runner = FakeRunner(16)
    sched.add_request(make_request("running", 10, max_tokens=50))
    sched.add_request(make_request("prefilling", 100))
    sched.add_request(make_request("waiting", 10))
    step(sched, runner)
    prefilling = sched.get_request("prefilling")
    assert prefilling is not None and 0 < prefilling.num_computed_tokens < 100
    assert sched.kv_cache.num_free_blocks < 20

    for rid in ("waiting", "prefilling", "running"):
        req = sched.abort_request(rid)
        assert req is not None and req.status is RequestStatus.FINISHED_ABORTED
    assert sched.abort_request("running") is None
    assert sched.kv_cache.num_free_blocks == 20
    assert not sched.has_unfinished() and sched.schedule(now=0.0).is_empty


def test_abort_between_schedule_and_update_is_ignored() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 10))
    out = sched.schedule(now=0.0)
    sched.abort_request("a")
    assert sched.update_from_output(out, {}) == []
    assert sched.kv_cache.num_free_blocks == 64


def test_deadline_expires_in_queue_and_is_never_scheduled() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(16)
    sched.add_request(make_request("runs", 10, max_tokens=3))
    sched.add_request(make_request("late", 10, deadline=5.0))
    sched.add_request(make_request("fine", 10, deadline=100.0))
    out, _ = step(sched, runner, now=1.0)
    assert list(chunks(out)) == ["runs"]
    out, _ = step(sched, runner, now=6.0)
    assert [r.request_id for r in out.finished] == ["late"]
    assert out.finished[0].status is RequestStatus.FINISHED_DEADLINE
    assert out.finished[0].num_computed_tokens == 0
    out, done = step(sched, runner, now=7.0)
    assert [r.request_id for r in done] == ["runs"]
    out, _ = step(sched, runner, now=8.0)
    assert list(chunks(out)) == ["fine"]


def test_deadline_passed_while_running_expires_once_preempted() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=100)
    runner = FakeRunner(4)
    sched.add_request(make_request("keeps", 4, max_tokens=10))
    sched.add_request(make_request("timed", 4, priority=BATCH, deadline=10.0, max_tokens=10))
    step(sched, runner, now=0.0)
    out, _ = step(sched, runner, now=20.0)  # past the deadline, but running: it is preempted, not expired
    assert out.preempted_ids == ["timed"] and not out.finished
    out, _ = step(sched, runner, now=21.0)
    assert [r.request_id for r in out.finished] == ["timed"]
    assert out.finished[0].status is RequestStatus.FINISHED_DEADLINE
    assert list(chunks(out)) == ["keeps"]


def test_queue_full() -> None:
    sched = make_scheduler(max_waiting=2)
    sched.add_request(make_request("a", 5))
    sched.add_request(make_request("b", 5))
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("c", 5))
    with pytest.raises(ValueError):
        sched.add_request(make_request("a", 5))
    step(sched, FakeRunner(16))  # both leave the queue, so there is room again
    sched.add_request(make_request("c", 5))


def _run_with_tokens(sched: Scheduler, tokens: list[int]) -> None:
    """Drive the scheduler until done, answering every sample with the next of `tokens`."""
    feed = iter(tokens)
    while sched.has_unfinished():
        out = sched.schedule(now=0.0)
        sched.update_from_output(out, {s.request_id: next(feed) for s in out.scheduled if s.needs_sample})


@pytest.mark.parametrize(
    ("kwargs", "n_out", "status", "stop_id"),
    [
        ({"eos": [7]}, 2, RequestStatus.FINISHED_STOPPED, 7),
        ({"eos": [7], "min_tokens": 3}, 5, RequestStatus.FINISHED_STOPPED, 9),  # eos at 2 ignored
        ({"eos": [7], "ignore_eos": True}, 5, RequestStatus.FINISHED_STOPPED, 9),
        ({"stop_token_ids": (9,), "min_tokens": 6}, 8, RequestStatus.FINISHED_LENGTH, None),
        ({"stop_token_ids": (9,)}, 5, RequestStatus.FINISHED_STOPPED, 9),
        ({"max_tokens": 3}, 3, RequestStatus.FINISHED_LENGTH, None),
        ({"max_model_len": 14}, 4, RequestStatus.FINISHED_LENGTH, None),
    ],
)
def test_stop_rules(kwargs: dict[str, Any], n_out: int, status: RequestStatus, stop_id: int | None) -> None:
    # Sampled in order: 1 7(eos) 2 3 9(stop id) 4 5 6 ...; max_tokens 8 unless overridden.
    kwargs = {"max_tokens": 8, "stop_token_ids": (9,), **kwargs}
    max_model_len = kwargs.pop("max_model_len", 4096)
    sched = make_scheduler(max_model_len=max_model_len)
    req = make_request("r", 10, max_model_len=max_model_len, **kwargs)
    sched.add_request(req)
    _run_with_tokens(sched, [1, 7, 2, 3, 9, 4, 5, 6, 8, 8])
    assert (req.num_output_tokens, req.status, req.stop_token_id) == (n_out, status, stop_id)
    assert sched.kv_cache.num_free_blocks == 64


def test_finish_requests_with_caller_status() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 10))
    step(sched, FakeRunner(16))
    done = sched.finish_requests(["a", "unknown"], RequestStatus.FINISHED_STOPPED)
    assert [r.request_id for r in done] == ["a"] and sched.num_running == 0
    with pytest.raises(ValueError):
        sched.finish_requests(["a"], RequestStatus.RUNNING)
