"""How many drafts a sequence verifies (engine_server.speculative.policy)."""

from __future__ import annotations

import pytest

from engine_server.speculative.policy import DEFAULT_THRESHOLD, PROBE_EVERY, DraftCost, DraftPolicy


def test_the_cost_of_a_draft_is_learned_from_steps_that_vary() -> None:
    cost = DraftCost()
    assert cost.threshold(1) is None
    for drafts in [0, 4, 1, 3, 0, 2, 4, 0] * 4:
        cost.observe(1, drafts, 0.006 + 0.0012 * drafts)  # one row: 6 ms, each draft 1.2 ms more
    assert cost.threshold(1) == pytest.approx(0.2, rel=0.02)


def test_at_a_large_batch_only_likely_drafts_pay() -> None:
    cost = DraftCost()
    for rows, drafts in [(16, 0), (16, 8), (8, 4), (16, 16), (8, 0), (4, 2)] * 5:
        cost.observe(rows, drafts, 0.004 + 0.0012 * rows + 0.0012 * drafts)  # compute-bound: a token is a token
    policy = DraftPolicy(max_drafts=8)
    policy.cost = cost
    assert policy.threshold(16) == pytest.approx(0.0192 / 0.0232, rel=0.02)
    assert policy.threshold(1) < 0.25


def test_the_depth_follows_the_measured_rate() -> None:
    policy = DraftPolicy(max_drafts=8)
    assert policy.threshold(1) == DEFAULT_THRESHOLD
    hopeful = policy.num_drafts("r", 0.2)
    assert 1 <= hopeful <= 8
    for _ in range(20):
        policy.observe("r", 8, 8)  # every draft kept
    assert policy.num_drafts("r", 0.2) == 8
    for _ in range(60):
        policy.observe("r", 4, 0)  # none kept
    assert policy.num_drafts("r", 0.2) == 0


def test_a_sequence_without_drafts_probes_every_few_steps() -> None:
    policy = DraftPolicy(max_drafts=4)
    for _ in range(40):
        policy.observe("r", 4, 0)
    depths = [policy.num_drafts("r", 0.5) for _ in range(2 * PROBE_EVERY)]
    assert depths.count(1) == 2 and set(depths) == {0, 1}


def test_without_adaptation_every_sequence_takes_the_maximum() -> None:
    policy = DraftPolicy(max_drafts=5, adaptive=False)
    policy.observe("r", 5, 0)
    assert policy.num_drafts("r", 0.99) == 5


def test_one_stalled_step_moves_the_cost_only_so_far() -> None:
    cost = DraftCost()
    for drafts in [0, 4, 1, 3, 0, 2, 4, 0] * 4:
        cost.observe(1, drafts, 0.006 + 0.0012 * drafts)
    cost.observe(1, 4, 0.5)  # another process held the CPU for half a second
    threshold = cost.threshold(1)
    assert threshold is not None and threshold < 0.3
