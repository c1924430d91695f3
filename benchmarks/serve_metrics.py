"""Serving-benchmark metrics: per-request timings in, a `vllm bench serve`-style summary out (pure, no I/O).

Definitions (all times from when the request was sent, i.e. after any wait for a concurrency slot):
  TTFT  time to the first content chunk (a streamed event whose first choice carries non-empty text).
  ITL   gaps between successive content chunks of one request; pooled over all successful requests.
  E2EL  time to the last content chunk.
  TPOT  (E2EL - TTFT) / (output_tokens - 1), per request with more than one output token.
Throughputs divide by the wall-clock duration of the whole run: request/s counts completed requests,
output tok/s their completion tokens, total tok/s their prompt + completion tokens. Failed requests count
only in `failed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

LATENCIES = (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
             ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"))


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one streamed request measured; on failure only `error` (and `success=False`) means anything."""

    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: tuple[float, ...] = ()  # seconds, one per content chunk after the first
    e2el: float = 0.0  # seconds
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first; None when there is no second token."""
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def summarize_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    """Mean, median and 99th percentile (linear interpolation, as numpy) in milliseconds; None when empty."""
    if not seconds:
        return {"mean": None, "median": None, "p99": None}
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    return {"mean": round(float(ms.mean()), 3), "median": round(float(np.median(ms)), 3),
            "p99": round(float(np.percentile(ms, 99)), 3)}


def compute_metrics(outputs: Sequence[RequestOutput], duration: float) -> dict[str, Any]:
    """The run's summary: counts, token totals, throughputs, and mean/median/p99 of each latency in ms.

    `duration` is the wall-clock seconds from the first request's scheduled start to the last one's end (> 0).
    """
    done = [o for o in outputs if o.success]
    input_tokens = sum(o.prompt_tokens for o in done)
    output_tokens = sum(o.output_tokens for o in done)
    tpots = [t for t in (o.tpot for o in done) if t is not None]
    return {
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "duration_s": round(duration, 3),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": round(len(done) / duration, 3),
        "output_throughput": round(output_tokens / duration, 3),
        "total_token_throughput": round((input_tokens + output_tokens) / duration, 3),
        "ttft_ms": summarize_ms([o.ttft for o in done]),
        "tpot_ms": summarize_ms(tpots),
        "itl_ms": summarize_ms([gap for o in done for gap in o.itl]),
        "e2el_ms": summarize_ms([o.e2el for o in done]),
    }


def format_table(metrics: dict[str, Any]) -> str:
    """The summary as the fixed-width text table `vllm bench serve` prints."""
    width = 50

    def row(label: str, value: Any) -> str:
        shown = "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<40}{shown:>10}"

    lines = [" Serving Benchmark Result ".center(width, "="),
             row("Successful requests:", metrics["completed"]),
             row("Failed requests:", metrics["failed"]),
             row("Benchmark duration (s):", metrics["duration_s"]),
             row("Total input tokens:", metrics["total_input_tokens"]),
             row("Total generated tokens:", metrics["total_output_tokens"]),
             row("Request throughput (req/s):", metrics["request_throughput"]),
             row("Output token throughput (tok/s):", metrics["output_throughput"]),
             row("Total token throughput (tok/s):", metrics["total_token_throughput"])]
    for key, title in LATENCIES:
        lines.append(title.center(width, "-"))
        name = key.upper()
        stats = metrics[f"{key}_ms"]
        lines += [row(f"Mean {name} (ms):", stats["mean"]), row(f"Median {name} (ms):", stats["median"]),
                  row(f"P99 {name} (ms):", stats["p99"])]
    lines.append("=" * width)
    return "\n".join(lines)
