"""The gateway's event-loop lag probe: a loop held by blocking work shows up in its histogram, an idle one not."""

from __future__ import annotations

import asyncio
import time

from gateway.config import GatewayConfig
from gateway.engines import EnginePool
from gateway.metrics import GatewayMetrics


def lag_counts(metrics: GatewayMetrics) -> dict[str, float]:
    (family,) = [f for f in metrics.registry.collect() if f.name == "ladle_gateway_event_loop_lag_seconds"]
    return {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}


async def test_a_held_loop_is_recorded_as_lag() -> None:
    metrics = GatewayMetrics(EnginePool(GatewayConfig(engines=("127.0.0.1:1",))))
    probe = asyncio.create_task(metrics.watch_event_loop())
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.12)  # blocking work on the loop
        await asyncio.sleep(0.05)
    finally:
        probe.cancel()
    counts = lag_counts(metrics)
    assert counts["+Inf"] >= 3
    assert counts["+Inf"] - counts["0.1"] >= 1  # the held wake-up came >= 100 ms late
