"""The scheduler with drafts (speculative decoding), against the fake model of tests/unit/factories.py.

The fake runner writes every scheduled token (drafts included) into a fake KV pool and checks, for every row,
that the blocks hold exactly the request's tokens up to the row's end: so a rejected draft's KV that is not
written again, a published block holding a draft, or a prefix-cache hit on one fails the step.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine_server.core.request import Priority, Request, RequestStatus
from engine_server.core.scheduler import Scheduler
from tests.unit.factories import FakeRunner, expected_output, make_request, make_scheduler, next_token

Proposer = Callable[[Request], list[int]]


def correct_drafts(request: Request, count: int) -> list[int]:
    """The next `count` tokens the fake model will produce."""
    tokens = list(request.all_token_ids)
    for _ in range(count):
        tokens.append(next_token(tokens))
    return tokens[request.num_tokens :]


def drafts_right_for(correct: int, total: int) -> Proposer:
    """Drafts whose first `correct` tokens are right and the rest wrong."""

    def propose(request: Request) -> list[int]:
        drafts = correct_drafts(request, total)
        return [*drafts[:correct], *((t + 1) % 1000 for t in drafts[correct:])]

    return propose


def run_with_drafts(
    scheduler: Scheduler, runner: FakeRunner, propose: Proposer, max_steps: int = 2_000
) -> list[Request]:
    """run_until_done, with `propose` setting the drafts of every request that decodes next (as the engine core's
    speculator does)."""
    finished: list[Request] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished
        for request in scheduler.running_requests:
            decodes_next = request.num_tokens - request.num_computed_tokens == 1 and not request.num_pending_tokens
            request.draft_token_ids = propose(request) if decodes_next else []
        output = scheduler.schedule(now=0.0)
        finished.extend(output.finished)
        tokens = runner.step(output)
        finished.extend(scheduler.update_from_output(output, tokens, runner.runs))
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("correct", range(6))
def test_a_draft_refused_at_any_position_gives_the_plain_output(correct: int) -> None:
    """Drafts right up to position `correct` and wrong from there (5 drafts: 5 means all right): the output is the
    model's own, and every rejected position is written again before anything reads it (block size 4: the
    rolled-back positions cross block boundaries)."""
    scheduler = make_scheduler(block_size=4, num_blocks=64)
    runner = FakeRunner(block_size=4)
    requests = [make_request(f"r{i}", 5 + i, max_tokens=30, ignore_eos=True) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    run_with_drafts(scheduler, runner, drafts_right_for(correct, 5))
    for request in requests:
        assert request.output_token_ids == expected_output(request.prompt_token_ids, 30)
        assert request.status is RequestStatus.FINISHED_LENGTH


def test_kept_drafts_advance_many_tokens_a_step() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=64)
    runner = FakeRunner(block_size=4)
    request = make_request("r", 6, max_tokens=40, ignore_eos=True)
    scheduler.add_request(request)
    steps = 0
    while scheduler.has_unfinished():
        for running in scheduler.running_requests:
            running.draft_token_ids = correct_drafts(running, 4) if running.num_computed_tokens else []
        output = scheduler.schedule(now=0.0)
        scheduler.update_from_output(output, runner.step(output), runner.runs)
        steps += 1
    assert request.output_token_ids == expected_output(request.prompt_token_ids, 40)
    assert steps == 1 + 8  # the prefill (1 token), then 5 tokens a step for the other 39 (max_tokens caps the last)


def test_max_tokens_reached_inside_a_run_ends_there() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=64)
    runner = FakeRunner(block_size=4)
    request = make_request("r", 6, max_tokens=3, ignore_eos=True)
    scheduler.add_request(request)
    run_with_drafts(scheduler, runner, drafts_right_for(8, 8))
    assert request.output_token_ids == expected_output(request.prompt_token_ids, 3)
    assert request.status is RequestStatus.FINISHED_LENGTH


def test_a_stop_token_inside_a_run_ends_it_and_drops_the_rest() -> None:
    prompt = list(range(10, 16))
    plain = expected_output(prompt, 20)
    stop = plain[6]  # the 7th output token, inside a run of 8 kept drafts
    first = plain.index(stop)
    scheduler = make_scheduler(block_size=4, num_blocks=64)
    runner = FakeRunner(block_size=4)
    request = make_request("r", prompt, max_tokens=20, eos=[stop])
    scheduler.add_request(request)
    run_with_drafts(scheduler, runner, drafts_right_for(8, 8))
    assert request.output_token_ids == plain[: first + 1]
    assert request.status is RequestStatus.FINISHED_STOPPED and request.stop_token_id == stop


def test_prefix_cache_holds_only_kept_tokens() -> None:
    """A request speculates with wrong drafts across several blocks, then a second one whose prompt is the first's
    tokens so far: its cache hits must hold the first request's real tokens (the fake runner checks)."""
    scheduler = make_scheduler(block_size=4, num_blocks=64)
    runner = FakeRunner(block_size=4)
    first = make_request("a", 6, max_tokens=24, ignore_eos=True)
    scheduler.add_request(first)
    run_with_drafts(scheduler, runner, drafts_right_for(2, 7))
    second = make_request("b", first.all_token_ids, max_tokens=8, ignore_eos=True)
    scheduler.add_request(second)
    run_with_drafts(scheduler, runner, drafts_right_for(1, 7))
    assert second.num_cached_tokens >= 24  # most of the first request's blocks were found again
    assert second.output_token_ids == expected_output(second.prompt_token_ids, 8)


def test_drafts_fit_the_token_budget() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=64, max_num_batched_tokens=8)
    runner = FakeRunner(block_size=4)
    requests = [make_request(f"r{i}", 3, max_tokens=12, ignore_eos=True) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    run_with_drafts(scheduler, runner, drafts_right_for(6, 6))  # the runner asserts each step's counts
    for request in requests:
        assert request.output_token_ids == expected_output(request.prompt_token_ids, 12)


def test_a_speculating_request_preempted_for_blocks_recomputes_to_the_same_output() -> None:
    # 10 blocks of 4: two requests growing to ~30 tokens each cannot both fit; the later one is preempted.
    scheduler = make_scheduler(block_size=4, num_blocks=10, max_num_seqs=4)
    runner = FakeRunner(block_size=4)
    requests = [
        make_request(f"r{i}", 6, max_tokens=24, ignore_eos=True, priority=Priority.BATCH, arrival_time=i)
        for i in range(2)
    ]
    for request in requests:
        scheduler.add_request(request)
    run_with_drafts(scheduler, runner, drafts_right_for(3, 4))
    assert scheduler.total_preemptions > 0
    for request in requests:
        assert request.output_token_ids == expected_output(request.prompt_token_ids, 24)


def test_short_of_blocks_a_decode_verifies_no_drafts_rather_than_preempting() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=4)
    runner = FakeRunner(block_size=4)
    request, other = (make_request(name, 6, max_tokens=2, ignore_eos=True) for name in ("r", "o"))
    scheduler.add_request(request)
    scheduler.add_request(other)
    output = scheduler.schedule(now=0.0)  # 2 blocks each: every block is taken
    scheduler.update_from_output(output, runner.step(output))
    request.draft_token_ids = correct_drafts(request, 6)  # positions 6..12 would need 2 more blocks
    output = scheduler.schedule(now=0.0)
    rows = {item.request_id: item for item in output.scheduled}
    assert rows["r"].num_new_tokens == 1 and not rows["r"].draft_token_ids
    assert not output.preempted_ids


def test_undo_of_a_step_with_drafts_restores_the_counts() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=32)
    runner = FakeRunner(block_size=4)
    request = make_request("r", 5, max_tokens=16, ignore_eos=True)
    scheduler.add_request(request)
    output = scheduler.schedule(now=0.0)
    scheduler.update_from_output(output, runner.step(output))
    request.draft_token_ids = correct_drafts(request, 4)
    computed = request.num_computed_tokens
    output = scheduler.schedule(now=0.0)
    assert output.num_draft_tokens == 4 and request.num_computed_tokens == computed + 5
    scheduler.undo(output)
    assert request.num_computed_tokens == computed and request.num_pending_tokens == 0
    run_with_drafts(scheduler, runner, drafts_right_for(2, 4))
    assert request.output_token_ids == expected_output(request.prompt_token_ids, 16)
