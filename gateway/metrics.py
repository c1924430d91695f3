"""Prometheus metrics of one gateway app, in its own registry (no process-global state).

Request counts by route and status, latency histograms (TTFT, inter-token latency, end-to-end), token counters,
in-flight requests, the batch lines this gateway's workers committed and the event loop's lag (how late a 10 ms
timer fires while the gateway serves a request or runs a batch: how long the loop was held by other work) are
recorded as they happen; the engines' running /
waiting / KV usage (from the pool's last poll), batches by status (from the database) and batch lines in flight
are read when /metrics is scraped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from gateway.engines import EnginePool
from gateway.usage import UsageLedger
from ladle.v1 import engine_pb2

# Seconds; from a few ms (one decode step on a GPU) to minutes (long CPU generations).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
LOOP_LAG_INTERVAL_S = 0.01
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)


class GatewayMetrics:
    """The gateway's metrics; `render()` is the /metrics body."""

    def __init__(self, pool: EnginePool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ladle_gateway_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.in_flight = Gauge("ladle_gateway_requests_in_flight", "HTTP requests being served", registry=r)
        self.ttft = Histogram("ladle_gateway_time_to_first_token_seconds", "Time to the first streamed token",
                              ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ladle_gateway_inter_token_latency_seconds", "Time between streamed chunks",
                             ["route"], buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("ladle_gateway_request_latency_seconds", "End-to-end latency of generation requests",
                             ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("ladle_gateway_prompt_tokens", "Prompt tokens processed", ["route"],
                                     registry=r)
        self.completion_tokens = Counter("ladle_gateway_completion_tokens", "Completion tokens generated",
                                         ["route"], registry=r)
        self.batch_lines = Counter("ladle_gateway_batch_lines", "Batch lines this gateway committed, by outcome",
                                   ["outcome"], registry=r)
        self.loop_lag = Histogram("ladle_gateway_event_loop_lag_seconds", "How late a 10 ms timer on the event "
                                  "loop fires while the gateway has work: how long the loop was held by other work",
                                  buckets=_LOOP_LAG_BUCKETS, registry=r)
        self.usage = UsageLedger(r)  # tokens by project, model and kind, also kept for the database
        self._working = 0  # requests being served and batches held (`working`)
        self._work_started = asyncio.Event()
        r.register(_EngineCollector(pool))

    def watch_batches(self, count_by_status: Callable[[], dict[str, int]], lines_in_flight: Callable[[], int]) -> None:
        """Report batches by status (`count_by_status`, which may raise while the store is not open or not
        reachable: then none) and batch lines in flight on every scrape."""
        self.registry.register(_BatchCollector(count_by_status, lines_in_flight))

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Mark a request being served or a batch being run, for the loop-lag probe (`watch_event_loop`)."""
        self._working += 1
        self._work_started.set()
        try:
            yield
        finally:
            self._working -= 1

    async def watch_event_loop(self, interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
        """Until cancelled: while anything is `working`, sleep `interval_s` on the running loop and record how late
        each wake-up is; while nothing is, wait for work without a timer. An idle gateway's loop has nobody to
        keep waiting, and a 10 ms timer there cost ~3% of a core (measured: 0.56 s of CPU in 20 s idle)."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._working:
                self._work_started.clear()
                await self._work_started.wait()
            started = loop.time()
            await asyncio.sleep(interval_s)
            self.loop_lag.observe(max(0.0, loop.time() - started - interval_s))

    def render(self) -> bytes:
        """The exposition text. Blocking (it reads the database): call it off the event loop."""
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Per-engine gauges from the pool's last poll."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        up = GaugeMetricFamily("ladle_engine_up", "1 when the engine is SERVING", labels=["engine"])
        calls = GaugeMetricFamily("ladle_engine_gateway_calls", "Calls this gateway has in flight on the engine",
                                  labels=["engine"])
        routed = CounterMetricFamily("ladle_gateway_routed", "Calls sent to each engine, by why it was chosen "
                                     "(prefix: it likely holds the prompt's prefix; least_busy)",
                                     labels=["engine", "reason"])
        failovers = CounterMetricFamily("ladle_gateway_failovers", "Calls sent again to another engine because "
                                        "this one was unavailable before any output", labels=["engine"])
        running = GaugeMetricFamily("ladle_engine_running", "Sequences the engine is generating", labels=["engine"])
        waiting = GaugeMetricFamily("ladle_engine_waiting", "Sequences queued at the engine", labels=["engine"])
        kv = GaugeMetricFamily("ladle_engine_kv_cache_usage", "Fraction of KV-cache blocks in use", labels=["engine"])
        proposed = CounterMetricFamily("ladle_engine_speculative_proposed_tokens", "Draft tokens the engine "
                                       "verified (speculative decoding)", labels=["engine"])
        accepted = CounterMetricFamily("ladle_engine_speculative_accepted_tokens", "Draft tokens the engine kept "
                                       "(equal to its own)", labels=["engine"])
        kept = HistogramMetricFamily("ladle_engine_speculative_kept_drafts", "Drafts kept per sequence step that "
                                     "verified drafts (the acceptance length is this plus 1)", labels=["engine"])
        for (address, reason), count in sorted(self.pool.routed.items()):
            routed.add_metric([address, reason], count)
        for address, count in sorted(self.pool.failovers.items()):
            failovers.add_metric([address], count)
        for engine in self.pool.engines:
            up.add_metric([engine.address], 1.0 if engine.serving else 0.0)
            calls.add_metric([engine.address], engine.calls)
            if engine.load is not None:
                running.add_metric([engine.address], engine.load.running)
                waiting.add_metric([engine.address], engine.load.waiting)
                kv.add_metric([engine.address], engine.load.kv_usage)
                _add_speculation(engine.address, engine.load, proposed, accepted, kept)
        yield from (up, calls, running, waiting, kv, routed, failovers, proposed, accepted, kept)


def _add_speculation(
    address: str,
    load: engine_pb2.GetLoadResponse,
    proposed: CounterMetricFamily,
    accepted: CounterMetricFamily,
    kept: HistogramMetricFamily,
) -> None:
    """An engine's speculative decoding figures, when it speculates (its histogram has buckets)."""
    histogram = list(load.speculative_kept_histogram)
    if not histogram:
        return
    proposed.add_metric([address], load.speculative_proposed_tokens)
    accepted.add_metric([address], load.speculative_accepted_tokens)
    buckets = [(str(i), float(sum(histogram[: i + 1]))) for i in range(len(histogram))]
    kept.add_metric([address], [*buckets, ("+Inf", float(sum(histogram)))], float(load.speculative_accepted_tokens))


class _BatchCollector(Collector):
    """Batches by status (every replica's, from the database) and this gateway's batch lines in flight."""

    def __init__(self, count_by_status: Callable[[], dict[str, int]], lines_in_flight: Callable[[], int]) -> None:
        self.count_by_status = count_by_status
        self.lines_in_flight = lines_in_flight

    def collect(self) -> Iterator[GaugeMetricFamily]:
        by_status = GaugeMetricFamily("ladle_batches", "Batch jobs by status", labels=["status"])
        try:
            counts = self.count_by_status()
        except Exception:  # not started yet, or the database is unreachable: report what is known
            counts = {}
        for status, count in sorted(counts.items()):
            by_status.add_metric([status], count)
        in_flight = GaugeMetricFamily("ladle_gateway_batch_lines_in_flight",
                                      "Batch engine items this gateway has sent and not yet had answered")
        in_flight.add_metric([], self.lines_in_flight())
        yield from (by_status, in_flight)
