"""Scheduler with a step-time model: BATCH decode rows and prefill capped to the time target while INTERACTIVE
requests are about, INTERACTIVE work never."""

from __future__ import annotations

from engine_server.core.request import Priority, Request
from engine_server.core.scheduler import Scheduler
from engine_server.core.scheduler_output import SchedulerOutput
from engine_server.core.step_timing import INTERACTIVE_QUIET_S, StepTimeModel
from tests.unit.factories import FakeRunner, expected_output, make_request, make_scheduler, run_until_done

BATCH = Priority.BATCH


def learned(per_token: float, target_s: float, min_chunk: int = 8, quiet_factor: float = 1.0) -> StepTimeModel:
    """A model that has measured steps costing `per_token` seconds per scheduled token, and nothing else (by
    default with no larger target for quiet spells)."""
    model = StepTimeModel(target_s, min_chunk=min_chunk, quiet_factor=quiet_factor)
    for prefill, rows in [(64, 0), (0, 8), (128, 4), (16, 30)] * 5:
        model.observe(prefill, rows, per_token * (prefill + rows))
    return model


def step(sched: Scheduler, runner: FakeRunner, now: float = 0.0) -> SchedulerOutput:
    out = sched.schedule(now=now)
    sched.update_from_output(out, runner.step(out))
    return out


def chunks(out: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: s.num_new_tokens for s in out.scheduled}


def _exact(requests: list[Request]) -> bool:
    return all(r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens) for r in requests)


def test_batch_only_steps_carry_the_prefill_that_fits_the_target() -> None:
    model = learned(per_token=1 / 1024, target_s=50 / 1024)  # 50 tokens fit; the budget is 256
    sched = make_scheduler(num_blocks=128, max_num_batched_tokens=256, step_time=model)
    runner = FakeRunner(16)
    batch = [make_request(f"b{i}", 100, priority=BATCH, arrival_time=float(i), max_tokens=6) for i in range(4)]
    for r in batch:
        sched.add_request(r)
    outs = [step(sched, runner) for _ in range(5)]
    # Uncapped, the first step would hold b0, b1 and 56 tokens of b2. Each decode row takes a token's time.
    assert [chunks(out) for out in outs] == [
        {"b0": 50},
        {"b0": 50},
        {"b0": 1, "b1": 49},
        {"b0": 1, "b1": 49},
        {"b0": 1, "b1": 2, "b2": 47},
    ]
    run_until_done(sched, runner)
    assert _exact(batch)


def test_an_interactive_prefill_keeps_the_whole_budget_and_its_decode_shares_a_capped_step() -> None:
    model = learned(per_token=1 / 1024, target_s=50 / 1024)
    sched = make_scheduler(num_blocks=128, max_num_batched_tokens=256, step_time=model)
    runner = FakeRunner(16)
    batch = [make_request(f"b{i}", 300, priority=BATCH, arrival_time=float(i), max_tokens=4) for i in range(2)]
    for r in batch:
        sched.add_request(r)
    assert chunks(step(sched, runner)) == {"b0": 50}
    chat = make_request("chat", 300, arrival_time=9.0, max_tokens=4)
    sched.add_request(chat)
    assert chunks(step(sched, runner)) == {"chat": 256}  # the whole budget, not the cap
    assert chunks(step(sched, runner)) == {"chat": 44}
    out = step(sched, runner)  # its decode row counts against the target of a step with BATCH prefill
    assert chunks(out) == {"chat": 1, "b0": 49}
    run_until_done(sched, runner)
    assert _exact([*batch, chat])


def test_in_a_quiet_spell_every_row_runs_and_the_minimum_chunk_keeps_prefill_going() -> None:
    model = learned(per_token=0.01, target_s=0.05, min_chunk=8)  # five rows fill the target
    sched = make_scheduler(num_blocks=128, max_num_batched_tokens=256, step_time=model)
    runner = FakeRunner(16)
    decoding = [make_request(f"d{i}", 1, priority=BATCH, arrival_time=float(i), max_tokens=40) for i in range(6)]
    for r in decoding:
        sched.add_request(r)
    assert chunks(step(sched, runner)) == {f"d{i}": 1 for i in range(6)}  # within the minimum chunk
    late = make_request("late", 40, priority=BATCH, arrival_time=9.0, max_tokens=2)
    sched.add_request(late)
    outs = [step(sched, runner) for _ in range(5)]
    assert [chunks(out).get("late") for out in outs] == [8, 8, 8, 8, 8]
    assert all(out.num_decode_rows == 6 for out in outs)  # the decode rows are never held back
    run_until_done(sched, runner)
    assert _exact([*decoding, late])


def test_a_batch_alone_takes_the_quiet_target_until_an_interactive_request_arrives() -> None:
    model = learned(per_token=1 / 1024, target_s=50 / 1024, quiet_factor=4)  # quiet: 200 tokens fit
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=256, step_time=model)
    runner = FakeRunner(16)
    batch = [make_request(f"b{i}", 400, priority=BATCH, arrival_time=float(i), max_tokens=4) for i in range(2)]
    for r in batch:
        sched.add_request(r)
    assert chunks(step(sched, runner, now=10.0)) == {"b0": 200}
    chat = make_request("chat", 8, arrival_time=11.0, max_tokens=2)
    sched.add_request(chat)
    assert chunks(step(sched, runner, now=11.0)) == {"chat": 8}
    assert chunks(step(sched, runner, now=11.1)) == {"chat": 1, "b0": 49}  # the chat's decode row + the target
    assert chunks(step(sched, runner, now=12.0)) == {"b0": 50}  # the chat is done, but arrived lately
    assert chunks(step(sched, runner, now=11.0 + INTERACTIVE_QUIET_S + 0.1)) == {"b0": 101, "b1": 99}
    run_until_done(sched, runner)
    assert _exact([*batch, chat])


def test_while_an_interactive_request_is_about_batch_rows_past_the_target_sit_the_step_out() -> None:
    model = learned(per_token=0.01, target_s=0.05, min_chunk=8)  # five rows fill the target
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=256, step_time=model)
    runner = FakeRunner(16)
    decoding = [make_request(f"d{i}", 1, priority=BATCH, arrival_time=float(i), max_tokens=6) for i in range(8)]
    for r in decoding:
        sched.add_request(r)
    assert chunks(step(sched, runner, now=10.0)) == {f"d{i}": 1 for i in range(8)}  # quiet: every row
    chat = make_request("chat", 4, arrival_time=11.0, max_tokens=8)
    sched.add_request(chat)
    assert chunks(step(sched, runner, now=11.0)) == {"chat": 4}  # its prefill alone
    late = make_request("late", 20, priority=BATCH, arrival_time=12.0, max_tokens=2)
    sched.add_request(late)
    # The chat's row and the four BATCH rows ranked first fill the target: the rest sit out, no prefill fits
    # beside them and `late` is not admitted (it would hold a seat no step has room for).
    out = step(sched, runner, now=11.1)
    assert chunks(out) == {"chat": 1, "d0": 1, "d1": 1, "d2": 1, "d3": 1}
    assert out.num_decode_rows == 5
    for now in (11.2, 11.3, 11.4, 11.5):
        assert chunks(step(sched, runner, now=now)) == {"chat": 1, "d0": 1, "d1": 1, "d2": 1, "d3": 1}
    # d0-d3 are done (one token from the quiet step, five since): d4-d7 take their turn beside the chat.
    out = step(sched, runner, now=11.6)
    assert chunks(out) == {"chat": 1, "d4": 1, "d5": 1, "d6": 1, "d7": 1}
    run_until_done(sched, runner)
    assert _exact([*decoding, chat, late])


def test_a_step_without_decode_rows_still_takes_the_minimum_chunk_while_capped() -> None:
    model = learned(per_token=0.01, target_s=0.05, min_chunk=8)  # five tokens fit the target
    sched = make_scheduler(num_blocks=128, max_num_batched_tokens=256, step_time=model)
    runner = FakeRunner(16)
    chat = make_request("chat", 4, arrival_time=1.0, max_tokens=1)
    sched.add_request(chat)
    assert chunks(step(sched, runner, now=1.0)) == {"chat": 4}
    batch = make_request("b", 40, priority=BATCH, arrival_time=2.0, max_tokens=2)
    sched.add_request(batch)
    assert [chunks(step(sched, runner, now=2.0 + i / 10)) for i in range(3)] == [{"b": 8}] * 3
    run_until_done(sched, runner)
    assert _exact([chat, batch])
