"""The gateway's event-loop lag probe: a loop held by blocking work while the gateway has work shows up in its
histogram; while it has none, the probe takes no samples (and sets no timer)."""

from __future__ import annotations

import asyncio
import time

from gateway.config import GatewayConfig
from gateway.engines import EnginePool
from gateway.metrics import GatewayMetrics


def lag_counts(metrics: GatewayMetrics) -> dict[str, float]:
    (family,) = [f for f in metrics.registry.collect() if f.name == "ladle_gateway_event_loop_lag_seconds"]
    return {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}


def new_metrics() -> GatewayMetrics:
    return GatewayMetrics(EnginePool(GatewayConfig(engines=("127.0.0.1:1",))))


async def test_a_held_loop_is_recorded_as_lag() -> None:
    metrics = new_metrics()
    probe = asyncio.create_task(metrics.watch_event_loop())
    try:
        with metrics.working():
            await asyncio.sleep(0.05)
            time.sleep(0.12)  # blocking work on the loop
            await asyncio.sleep(0.05)
    finally:
        probe.cancel()
    counts = lag_counts(metrics)
    assert counts["+Inf"] >= 3
    assert counts["+Inf"] - counts["0.1"] >= 1  # the held wake-up came >= 100 ms late


async def test_an_idle_gateway_takes_no_samples_until_work_starts() -> None:
    metrics = new_metrics()
    probe = asyncio.create_task(metrics.watch_event_loop())
    try:
        await asyncio.sleep(0.1)
        assert lag_counts(metrics)["+Inf"] == 0  # idle: no timer fired
        with metrics.working():
            await asyncio.sleep(0.1)
        working = lag_counts(metrics)["+Inf"]
        assert working >= 3  # ~10 samples in 100 ms of work
        await asyncio.sleep(0.1)
        assert lag_counts(metrics)["+Inf"] <= working + 1  # idle again: at most the wake-up already under way
    finally:
        probe.cancel()
