"""Steady decode steps (engine_server.core.scheduler's `_SteadyRecord`) schedule exactly what the general path does.

Two schedulers take the same random workload step by step: one schedules steady decode steps from its record and
updates them in columns, the other (`steady_decode = False`) schedules every step row by row. Every step's rows
(request, start, tokens, block table, sampling), preemptions and finishes, and every request's outputs and status
must be equal; and the steady path must have carried a good share of the steps, so the comparison means something.

The workload mixes what ends or breaks a steady streak: arrivals, INTERACTIVE and BATCH requests, eos and stop
tokens, min_tokens (a request whose sampling needs its outputs on the host), max_tokens and max_model_len, aborts,
a KV pool small enough to preempt, shared prefixes (the prefix cache publishes blocks as decodes fill them), a
step-time model that holds BATCH rows back, and async scheduling: the next step is scheduled before the last one's
tokens arrive, as the engine core does (at most one step in flight; a step with a request that needs its outputs
on the host is completed at once).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from engine_server.core.request import Priority, Request, RequestStatus
from engine_server.core.scheduler import Scheduler
from engine_server.core.scheduler_output import SchedulerOutput
from tests.unit.factories import make_request, make_scheduler

VOCAB = 50
EOS = 7
STOP = 11


def token_at(request_id: str, position: int) -> int:
    """The fake model's token for a request's position: a function of both alone, so a step can be sampled before
    the tokens of the step before it are known (async scheduling)."""
    return random.Random(f"{request_id}:{position}").randrange(VOCAB)


def sample(output: SchedulerOutput) -> list[int]:
    return [
        token_at(item.request_id, item.start_position + item.num_new_tokens)
        for item in output.scheduled
        if item.needs_sample
    ]


class RowCap:
    """A step-time model that holds BATCH decode rows to a fixed number while INTERACTIVE requests are about."""

    quiet_target_s = 1.0

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def decode_row_cap(self, target_s: float | None = None) -> int | None:
        return self.rows

    def prefill_that_fits(self, decode_rows: int, target_s: float | None = None) -> int:
        return 24

    def batch_prefill_cap(self, decode_rows: int, target_s: float | None = None) -> int:
        return 32


@dataclass
class Run:
    """One scheduler driven through a workload; `log` holds every step's decisions."""

    scheduler: Scheduler
    requests: dict[str, Request] = field(default_factory=dict)
    log: list[tuple[object, ...]] = field(default_factory=list)
    steady_steps: int = 0


def drive(steady: bool, seed: int, async_scheduling: bool, row_cap: int | None) -> Run:
    rng = random.Random(seed)
    scheduler = make_scheduler(
        num_blocks=rng.choice([24, 40, 200]),
        block_size=4,
        max_num_batched_tokens=48,
        max_num_seqs=12,
        max_model_len=rng.choice([48, 4096]),
        step_time=RowCap(row_cap) if row_cap is not None else None,  # type: ignore[arg-type]
    )
    scheduler.steady_decode = steady
    run = Run(scheduler)
    shared = [rng.randrange(VOCAB) for _ in range(8)]
    in_flight: SchedulerOutput | None = None
    now = 0.0
    for step in range(400):
        now += 0.001
        if step < 250 and rng.random() < 0.12:
            for _ in range(rng.randint(1, 4)):
                i = len(run.requests)
                prompt = [*shared, *(rng.randrange(VOCAB) for _ in range(rng.randint(1, 9)))] if i % 3 else 2 + i % 7
                request = make_request(
                    f"r{i}",
                    prompt,
                    max_tokens=rng.choice([3, 12, 30, 60]),
                    min_tokens=4 if i % 5 == 0 else 0,
                    eos=[EOS],
                    stop_token_ids=(STOP,) if i % 4 == 0 else (),
                    ignore_eos=i % 6 == 0,
                    priority=Priority.BATCH if i % 2 else Priority.INTERACTIVE,
                    arrival_time=now,
                    max_model_len=scheduler.max_model_len,
                )
                run.requests[request.request_id] = request
                scheduler.add_request(request)
        if rng.random() < 0.03 and run.requests:
            victim = rng.choice(sorted(run.requests))
            aborted = scheduler.abort_request(victim)
            run.log.append(("abort", victim, aborted is not None))
        output = scheduler.schedule(now=now)
        run.steady_steps += output.steady is not None
        rows = [
            (item.request_id, item.start_position, item.num_new_tokens, tuple(item.block_ids), item.needs_sample)
            for item in output.scheduled
        ]
        run.log.append((step, rows, list(output.preempted_ids), [r.request_id for r in output.finished]))
        tokens = sample(output)  # sampled now, as the device would: the rows' state is the step's
        finished: list[Request] = []
        if async_scheduling:
            if in_flight is not None:
                finished += scheduler.update_from_output(*in_flight)  # type: ignore[misc]
                in_flight = None
            if any(item.request.needs_output_history for item in output.scheduled):
                finished += scheduler.update_from_output(output, tokens)
            else:
                in_flight = (output, tokens)  # type: ignore[assignment]
        else:
            finished += scheduler.update_from_output(output, tokens)
        run.log.append(("finished", step, [(r.request_id, r.status.name) for r in finished]))
    if in_flight is not None:
        scheduler.update_from_output(*in_flight)  # type: ignore[misc]
    return run


@pytest.mark.parametrize("row_cap", [None, 3])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_steady_steps_schedule_what_the_general_path_does(
    seed: int, async_scheduling: bool, row_cap: int | None
) -> None:
    general = drive(False, seed, async_scheduling, row_cap)
    steady = drive(True, seed, async_scheduling, row_cap)
    assert general.steady_steps == 0
    for expected, got in zip(general.log, steady.log, strict=True):
        assert got == expected
    for request_id, request in general.requests.items():
        other = steady.requests[request_id]
        assert (other.output_token_ids, other.status, other.num_preemptions) == (
            request.output_token_ids,
            request.status,
            request.num_preemptions,
        )
    assert steady.scheduler.kv_cache.num_free_blocks == general.scheduler.kv_cache.num_free_blocks
    # The comparison means something: the steady path carried many steps, and requests ended in every way.
    assert steady.steady_steps >= 30
    statuses = {r.status for r in general.requests.values()}
    assert {RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED} <= statuses
    assert sum(r.num_preemptions for r in general.requests.values()) > 0 or seed % 3 != 0


def test_undo_of_a_steady_step_returns_every_row() -> None:
    """A steady step that is taken back (a step interrupt) leaves the rows where they were; the next step, on the
    general path, schedules the same rows again."""
    scheduler = make_scheduler(block_size=4)
    for i in range(4):
        scheduler.add_request(make_request(f"u{i}", 5 + i, max_tokens=40))
    for _ in range(3):
        output = scheduler.schedule(now=0.0)
        scheduler.update_from_output(output, sample(output))
    output = scheduler.schedule(now=0.0)
    assert output.steady is not None
    before = [(item.request_id, item.start_position) for item in output.scheduled]
    scheduler.undo(output)
    again = scheduler.schedule(now=0.0)
    assert again.steady is None
    assert [(item.request_id, item.start_position) for item in again.scheduled] == before
