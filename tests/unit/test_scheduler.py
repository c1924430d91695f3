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
    sched.add_request(make_request("b_old", 4, priority=BATCH, arrival_time=1.0, max_tokens=20))
    sched.add_request(make_request("b_new", 4, priority=BATCH, arrival_time=2.0, max_tokens=20))
    step(sched, runner)
    sched.add_request(make_request("i_old", 4, arrival_time=0.0, max_tokens=20))
    sched.add_request(make_request("i_new", 4, arrival_time=3.0, max_tokens=20))
    step(sched, runner)  # the interactive two prefill (batch sits out): all four hold one block, the pool is full
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


def test_every_running_request_holds_a_state_slot_of_its_own_and_only_while_it_runs() -> None:
    """A model with linear attention (Qwen3-Next, Qwen3.5): as many state slots as seats. Through a preemption storm
    and an abort, after every step each running request holds one slot no other holds, no queued or finished one
    holds any, and every slot is free at the end."""
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                           enable_prefix_caching=False, state_slots=4)  # fmt: skip
    runner = FakeRunner(4)
    reqs = [make_request(f"r{i}", 5 + 3 * i, max_tokens=20 + i, arrival_time=float(i)) for i in range(10)]
    for r in reqs:
        sched.add_request(r)
    for steps in range(10_000):
        if not sched.has_unfinished():
            break
        step(sched, runner)
        if steps == 3:
            sched.abort_request(sched.running_requests[0].request_id)
        held = [r.state_slot for r in sched.running_requests]
        assert min(held, default=0) >= 0 and len(set(held)) == len(held)
        assert all(r.state_slot == -1 for r in reqs if r not in sched.running_requests)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert sched.state_slots is not None and sched.state_slots.num_free == 4
    with pytest.raises(ValueError, match="2 state slots for 4 running requests"):
        make_scheduler(max_num_seqs=4, state_slots=2)


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
    assert sched.update_from_output(out, [0]) == []  # its token is dropped
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
    sched.add_request(make_request("timed", 4, priority=BATCH, deadline=10.0, max_tokens=10))
    step(sched, runner, now=0.0)
    sched.add_request(make_request("keeps", 4, max_tokens=10))
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


def test_a_call_is_admitted_whole_while_its_class_has_room() -> None:
    """One call's requests (its choices, its pooling inputs) are queued together: a group larger than
    max_waiting is admitted when the queue has a free place, never half of it; each class counts its own."""
    sched = make_scheduler(max_waiting=2)
    sched.add_requests([make_request(f"a:{i}", 5, priority=Priority.BATCH) for i in range(5)])
    assert sched.num_waiting == 5 and not sched.has_room(Priority.BATCH)
    with pytest.raises(QueueFullError):
        sched.add_requests([make_request(f"b:{i}", 5, priority=Priority.BATCH) for i in range(2)])
    assert sched.num_waiting == 5  # nothing of the refused call was queued
    assert sched.has_room(Priority.INTERACTIVE)  # queued batch work never turns an interactive call away
    sched.add_requests([make_request(f"c:{i}", 5) for i in range(3)])
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_requests([make_request("d:0", 5), make_request("d:0", 5)])
    assert sched.get_request("d:0") is None


def _run_with_tokens(sched: Scheduler, tokens: list[int]) -> None:
    """Drive the scheduler until done, answering every sample with the next of `tokens`."""
    feed = iter(tokens)
    while sched.has_unfinished():
        out = sched.schedule(now=0.0)
        sched.update_from_output(out, [next(feed) for s in out.scheduled if s.needs_sample])


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


# -- interactive first ---------------------------------------------------------------------------------------


def _exact(requests: list[Request]) -> bool:
    return all(r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens) for r in requests)


def test_an_interactive_request_takes_a_seat_from_batch_work_at_once() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    runner = FakeRunner(16)
    batch = [make_request(f"b{i}", 6, priority=BATCH, arrival_time=float(i), max_tokens=12) for i in range(3)]
    for r in batch:
        sched.add_request(r)
    step(sched, runner)
    step(sched, runner)
    chat = make_request("chat", 10, arrival_time=5.0, max_tokens=4)
    sched.add_request(chat)
    out, _ = step(sched, runner)
    assert out.preempted_ids == ["b2"]  # the latest batch request gives its seat up
    assert chunks(out) == {"chat": 10}  # and is not back in the same step: batch rows sit the prefill out
    out, _ = step(sched, runner)
    assert chunks(out) == {"chat": 1, "b0": 1, "b1": 1}  # decodes share steps again; b2 waits for a seat
    run_until_done(sched, runner)
    assert _exact([*batch, chat]) and batch[2].num_preemptions == 1
    assert sched.kv_cache.num_free_blocks == 64


def test_interactive_requests_never_preempt_each_other() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    runner = FakeRunner(16)
    sched.add_request(make_request("a", 4, max_tokens=6))
    sched.add_request(make_request("b", 4, priority=BATCH, max_tokens=6))
    step(sched, runner)
    step(sched, runner)
    for name in ("c", "d"):
        sched.add_request(make_request(name, 4, arrival_time=1.0, max_tokens=6))
    out, _ = step(sched, runner)
    assert out.preempted_ids == ["b"] and chunks(out) == {"a": 1, "c": 4}  # d finds only interactive seats
    out, _ = step(sched, runner)
    assert out.preempted_ids == [] and chunks(out) == {"a": 1, "c": 1}  # d waits: batch work sits this out
    finish_order = [r.request_id for r in run_until_done(sched, runner)]
    assert finish_order == ["a", "c", "d", "b"]
    assert sched.total_preemptions == 1


def test_batch_rows_sit_out_every_chunk_of_an_interactive_prefill() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(16)
    sched.add_request(make_request("b", 6, priority=BATCH, max_tokens=20))
    step(sched, runner)
    sched.add_request(make_request("long", 150, max_tokens=3))
    sched.add_request(make_request("b_later", 6, priority=BATCH, max_tokens=3))
    outs = [step(sched, runner)[0] for _ in range(4)]
    # Neither a running nor a waiting batch request gets a row until the interactive prompt is in; the running
    # one keeps its seat and blocks meanwhile. Then decodes mix again and the batch class is admitted.
    assert [chunks(out) for out in outs] == [
        {"long": 64},
        {"long": 64},
        {"long": 22},
        {"long": 1, "b": 1, "b_later": 6},
    ]
    assert all(not out.preempted_ids for out in outs) and sched.total_preemptions == 0


def test_a_batch_token_on_the_way_waits_out_an_interactive_step() -> None:
    """Async scheduling: the next step is scheduled before the last one's tokens land. A batch request that
    sits that step out with its token pending is consistent again, and decodes from it, one step later."""
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(16)
    batch = make_request("b", 6, priority=BATCH, max_tokens=6)
    sched.add_request(batch)
    step(sched, runner)
    first = sched.schedule(now=0.0)  # b decodes; its token stays pending while the next step is scheduled
    sampled = runner.step(first)
    chat = make_request("chat", 5, max_tokens=3)
    sched.add_request(chat)
    second = sched.schedule(now=0.0)
    assert chunks(second) == {"chat": 5} and batch.num_pending_tokens == 1
    sched.update_from_output(first, sampled)
    assert batch.num_pending_tokens == 0 and batch.num_computed_tokens == batch.num_tokens - 1
    sched.update_from_output(second, runner.step(second))
    out, _ = step(sched, runner)
    assert chunks(out) == {"chat": 1, "b": 1} and out.scheduled[1].start_position == batch.num_tokens - 2
    run_until_done(sched, runner)
    assert _exact([batch, chat])


def test_an_interactive_request_short_of_blocks_preempts_batch_work() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=100, enable_prefix_caching=False)
    runner = FakeRunner(4)
    batch = [make_request(f"b{i}", 8, priority=BATCH, arrival_time=float(i), max_tokens=4) for i in range(2)]
    for r in batch:
        sched.add_request(r)
    step(sched, runner)  # two blocks each: two of six are left
    chat = make_request("chat", 12, arrival_time=9.0, max_tokens=2)  # needs three
    sched.add_request(chat)
    out, _ = step(sched, runner)
    assert out.preempted_ids == ["b1"] and chunks(out) == {"chat": 12}
    run_until_done(sched, runner)
    assert _exact([*batch, chat]) and sched.kv_cache.num_free_blocks == 6


def test_batch_victims_of_a_running_interactive_decode_do_not_hold_admission_back() -> None:
    # Three blocks of four tokens. b0 and b1 hold one each (room for a decode); i holds the third, full.
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=100, enable_prefix_caching=False)
    runner = FakeRunner(4)
    batch = [make_request(f"b{i}", 3, priority=BATCH, arrival_time=float(i), max_tokens=3) for i in range(2)]
    for r in batch:
        sched.add_request(r)
    step(sched, runner)
    first = make_request("i", 4, arrival_time=5.0, max_tokens=3)
    sched.add_request(first)
    step(sched, runner)
    second = make_request("j", 4, arrival_time=6.0, max_tokens=3)
    sched.add_request(second)
    out, _ = step(sched, runner)
    # i's decode needs a block and takes b1's; j is still admitted, taking b0's.
    assert out.preempted_ids == ["b1", "b0"] and chunks(out) == {"i": 1, "j": 4}
    run_until_done(sched, runner)
    assert _exact([*batch, first, second]) and sched.kv_cache.num_free_blocks == 3


def test_interactive_arrivals_during_a_batch_storm_are_never_preempted_and_all_outputs_are_exact() -> None:
    sched = make_scheduler(num_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    runner = FakeRunner(4)
    batch = [
        make_request(f"b{i}", 4 + i % 7, priority=BATCH, arrival_time=float(i), max_tokens=6 + i % 5) for i in range(30)
    ]
    chats = [make_request(f"c{i}", 5 + 3 * i, arrival_time=100.0 + i, max_tokens=4) for i in range(6)]
    for r in batch:
        sched.add_request(r)
    for n in range(10_000):
        if n % 3 == 0 and n // 3 < len(chats):
            sched.add_request(chats[n // 3])
        if not sched.has_unfinished():
            break
        out, _ = step(sched, runner)
        assert not any(sched.get_request(rid).priority is Priority.INTERACTIVE for rid in out.preempted_ids)  # type: ignore[union-attr]
        if any(s.is_prefill and s.request.priority is Priority.INTERACTIVE for s in out.scheduled):
            assert all(s.request.priority is Priority.INTERACTIVE for s in out.scheduled)
    assert _exact(batch + chats) and sum(r.num_preemptions for r in batch) > 0
    assert all(r.num_preemptions == 0 for r in chats) and sched.kv_cache.num_free_blocks == 20


@pytest.mark.parametrize("num_blocks", [40, 9])
def test_batch_alone_is_scheduled_exactly_as_before(num_blocks: int) -> None:
    """Priority only orders work: a batch-only load is scheduled step for step like the same load of
    interactive requests (where interactive first has no lower class to hold back or preempt), with and
    without a pool tight enough to preempt."""

    def trace(priority: Priority) -> list[tuple[dict[str, int], list[str]]]:
        sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=24)
        runner = FakeRunner(4)
        for i in range(10):
            sched.add_request(
                make_request(f"r{i}", 3 + 2 * i, priority=priority, arrival_time=float(i), max_tokens=5 + i % 4)
            )
        steps = []
        while sched.has_unfinished():
            out, _ = step(sched, runner)
            steps.append((chunks(out), out.preempted_ids))
        return steps

    batch = trace(BATCH)
    assert batch == trace(Priority.INTERACTIVE)
    assert any(preempted for _, preempted in batch) == (num_blocks == 9)
