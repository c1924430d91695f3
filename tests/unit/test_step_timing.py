"""StepTimeModel: the online fit of a step's seconds, its prefill cap, and the engine core that feeds it."""

from __future__ import annotations

import dataclasses

import pytest

from engine_server.core.engine_core import EngineCore
from engine_server.core.request import Priority
from engine_server.core.step_timing import StepTimeModel, default_step_targets
from tests.unit.runner_factories import greedy_request, tiny_engine_config, tiny_source

MIXES = [(64, 0), (0, 8), (256, 4), (32, 30), (128, 16), (0, 1), (512, 0), (16, 60)]


def seconds(
    prefill: int, rows: int, overhead: float = 0.004, per_token: float = 0.0007, premium: float = 0.001
) -> float:
    return overhead + per_token * (prefill + rows) + premium * rows


def test_before_any_measurement_it_predicts_nothing_and_caps_at_the_minimum_chunk() -> None:
    model = StepTimeModel(0.15, min_chunk=64)
    assert model.predict(100, 4) is None and model.coefficients is None
    assert model.batch_prefill_cap(0) == 64


def test_it_learns_overhead_per_token_and_row_premium_from_mixed_steps() -> None:
    model = StepTimeModel(0.15)
    for _ in range(10):
        for prefill, rows in MIXES:
            model.observe(prefill, rows, seconds(prefill, rows))
    overhead, per_token, premium = model.coefficients  # type: ignore[misc]
    # The weak prior pulls the overhead and premium a little towards 0; what counts is the prediction.
    assert overhead == pytest.approx(0.004, abs=0.002)
    assert per_token == pytest.approx(0.0007, rel=0.02)
    assert premium == pytest.approx(0.001, rel=0.15)
    assert model.predict(1000, 40) == pytest.approx(seconds(1000, 40), rel=0.02)
    # What fits 0.15 s beside 40 decode rows: (0.15 - 0.004 - 0.0017 * 40) / 0.0007 = 111 tokens.
    assert model.batch_prefill_cap(40) == pytest.approx(111, abs=5)


def test_one_kind_of_step_gives_one_rate_per_scheduled_token() -> None:
    model = StepTimeModel(0.15)
    model.observe(64, 0, 0.064)
    assert model.predict(128, 0) == pytest.approx(0.128, rel=0.01)
    assert model.batch_prefill_cap(0) == pytest.approx(150, abs=1)


def test_a_stalled_step_moves_the_fit_only_so_far() -> None:
    model = StepTimeModel(0.15, max_surprise=4.0)
    for _ in range(10):
        for prefill, rows in MIXES:
            model.observe(prefill, rows, seconds(prefill, rows))
    before = model.predict(128, 8)
    model.observe(128, 8, 100 * seconds(128, 8))  # another process took the CPU for this one
    assert before is not None and before < model.predict(128, 8) < 1.3 * before  # type: ignore[operator]


def test_a_step_much_faster_than_predicted_restarts_the_fit() -> None:
    model = StepTimeModel(0.15)
    model.observe(8, 0, 20.0)  # the first step pays for lazy set-up
    model.observe(64, 0, seconds(64, 0))
    assert model.predict(64, 0) == pytest.approx(seconds(64, 0), rel=0.01)


def test_slower_steps_shrink_the_cap_and_faster_ones_grow_it() -> None:
    model = StepTimeModel(0.15)
    for prefill, rows in MIXES * 5:
        model.observe(prefill, rows, seconds(prefill, rows))
    cap = model.batch_prefill_cap(4)
    for prefill, rows in MIXES * 10:  # the machine got twice as slow
        model.observe(prefill, rows, 2 * seconds(prefill, rows))
    assert model.batch_prefill_cap(4) == pytest.approx(cap / 2, rel=0.1)


def test_the_cap_never_goes_below_the_minimum_chunk() -> None:
    model = StepTimeModel(0.05, min_chunk=32)
    model.observe(10, 10, 0.2)  # 10 ms a token: ten decode rows alone overrun the target
    assert model.batch_prefill_cap(10) == 32


@pytest.mark.parametrize(
    ("configured", "device", "targets"),
    [(None, "cpu", (0.015, 0.15)), (None, "cuda", (0.02, 0.06)), (0.3, "cuda", (0.3, 0.9)), (0.0, "cpu", (0.0, 0.0))],
)
def test_default_targets_by_device(configured: float | None, device: str, targets: tuple[float, float]) -> None:
    assert default_step_targets(configured, device) == pytest.approx(targets)


def _core(target: float | None) -> EngineCore:
    config = tiny_engine_config()
    scheduler = dataclasses.replace(config.scheduler, batch_step_target_s=target, batch_min_prefill_chunk=8)
    return EngineCore(dataclasses.replace(config, scheduler=scheduler), tiny_source())


def test_the_engine_core_feeds_every_step_it_runs_to_the_model() -> None:
    core = _core(None)
    assert core.step_time is not None and core.step_time.target_s == 0.015  # the CPU's default
    assert core.step_time.quiet_target_s == pytest.approx(0.15)
    for i in range(3):
        request = greedy_request(f"b{i}", 20, max_tokens=3)
        request.priority = Priority.BATCH
        core.add_request(request)
    steps = 0
    while core.has_unfinished():
        core.step()
        steps += 1
    assert core.step_time.num_observed == steps
    assert core.step_time.predict(8, 0) is not None


def test_a_zero_target_turns_the_cap_off() -> None:
    core = _core(0.0)
    assert core.step_time is None and core.scheduler.step_time is None
