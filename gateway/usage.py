"""Token usage per project, model and kind, counted as requests end: on /metrics at once, and in the database
(`store.usage`) within a second, where every replica's counts add up and survive restarts.

`UsageLedger.record` is called where a request's engine usage is known: the generation and pooling routes
(`deps.RequestTimer.finish`), background responses, and the batch worker's commits (kind "batch"). It increments
the Prometheus counters and keeps the increments for the database; `flush_usage` writes them every
`FLUSH_INTERVAL_S` (and once more when the gateway stops). A flush that fails keeps its increments for the next
one, so a database outage delays counts and loses none; a gateway killed with -9 loses at most its last second's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter
from sqlalchemy.exc import SQLAlchemyError

from gateway.store.usage import DAY_S, UsageCounts, UsageKey, UsageStore, day_of
from ladle.v1 import types_pb2

log = structlog.get_logger(__name__)

FLUSH_INTERVAL_S = 1.0
# Distinct `model` label values on /metrics. Models are the served one and its LoRA adapters, which operators name
# and load at run time: past this many, further names are counted under OTHER_MODEL there, so loading and
# unloading adapters cannot grow the series without bound. The database keeps every name.
MAX_MODEL_LABELS = 64
OTHER_MODEL = "other"


class UsageLedger:
    """Usage counted in this gateway: Prometheus counters, and the increments not yet in the database."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.tokens = Counter("ladle_gateway_usage_tokens", "Tokens used, by project, model, kind (interactive or "
                              "batch) and type (input, cached, output, reasoning)",
                              ["project", "model", "kind", "type"], registry=registry)
        self.requests = Counter("ladle_gateway_usage_requests", "Requests that used the model, by project, model and "
                                "kind", ["project", "model", "kind"], registry=registry)
        self._pending: dict[UsageKey, UsageCounts] = {}
        self._model_labels: set[str] = set()

    def record(self, project: str, model: str, kind: str, usages: Iterable[types_pb2.Usage],
               requests: int = 1) -> None:
        """Count one request (or `requests`) of `project` that made engine requests with `usages`."""
        counts = UsageCounts(requests=requests)
        for u in usages:
            counts.input_tokens += u.prompt_tokens
            counts.cached_tokens += u.cached_prompt_tokens
            counts.output_tokens += u.completion_tokens
            counts.reasoning_tokens += u.reasoning_tokens
        label = self.model_label(model)
        self.requests.labels(project, label, kind).inc(requests)
        for name in ("input", "cached", "output", "reasoning"):
            self.tokens.labels(project, label, kind, name).inc(getattr(counts, f"{name}_tokens"))
        self._add(UsageKey(project, day_of(time.time()), model, kind), counts)

    def model_label(self, model: str) -> str:
        """`model` as the metrics label it is counted under: itself among the first MAX_MODEL_LABELS names seen,
        else OTHER_MODEL."""
        if model not in self._model_labels and len(self._model_labels) < MAX_MODEL_LABELS:
            self._model_labels.add(model)
        return model if model in self._model_labels else OTHER_MODEL

    def take(self) -> dict[UsageKey, UsageCounts]:
        """The increments kept so far, handed over (the ledger starts afresh)."""
        pending, self._pending = self._pending, {}
        return pending

    def give_back(self, increments: dict[UsageKey, UsageCounts]) -> None:
        """Increments a flush could not write, kept for the next one."""
        for key, counts in increments.items():
            self._add(key, counts)

    def _add(self, key: UsageKey, counts: UsageCounts) -> None:
        kept = self._pending.get(key)
        if kept is None:
            self._pending[key] = counts
        else:
            kept.add(counts)


async def flush_usage(ledger: UsageLedger, store: UsageStore, interval_s: float = FLUSH_INTERVAL_S) -> None:
    """Write the ledger's increments to `store` every `interval_s` until cancelled, then once more."""
    try:
        while True:
            await asyncio.sleep(interval_s)
            await _flush(ledger, store)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(_flush(ledger, store))


async def _flush(ledger: UsageLedger, store: UsageStore) -> None:
    increments = ledger.take()
    if not increments:
        return
    try:
        await asyncio.to_thread(store.add, increments)
    except SQLAlchemyError:
        ledger.give_back(increments)
        log.warning("could not write usage to the database; kept for the next flush", exc_info=True)


GROUPS = ("project_id", "model", "batch")


def completions_usage_page(
    rows: Iterable[tuple[UsageKey, UsageCounts]], start_day: int, days: int, group_by: Iterable[str],
    more_after: int | None,
) -> dict[str, Any]:
    """OpenAI's completions usage page: one daily bucket for each of `days` days from `start_day` (each with its
    results, grouped by the `group_by` fields; a field not grouped by is null), and the cursor of the next page
    (`more_after`: the first day not in this page, None when there is none)."""
    grouping = set(group_by)
    buckets: dict[int, dict[tuple[Any, ...], UsageCounts]] = {start_day + i * DAY_S: {} for i in range(days)}
    for key, counts in rows:
        results = buckets.get(key.day)
        if results is None:
            continue
        group = (key.project if "project_id" in grouping else None, key.model if "model" in grouping else None,
                 key.kind == "batch" if "batch" in grouping else None)
        results.setdefault(group, UsageCounts()).add(counts)
    data = [
        {"object": "bucket", "start_time": day, "end_time": day + DAY_S,
         "results": [_result(group, counts) for group, counts in sorted(results.items(), key=lambda r: str(r[0]))]}
        for day, results in buckets.items()
    ]
    return {"object": "page", "data": data, "has_more": more_after is not None,
            "next_page": str(more_after) if more_after is not None else None}


def _result(group: tuple[Any, ...], counts: UsageCounts) -> dict[str, Any]:
    project, model, batch = group
    return {
        "object": "organization.usage.completions.result", "input_tokens": counts.input_tokens,
        "output_tokens": counts.output_tokens, "input_cached_tokens": counts.cached_tokens,
        "input_audio_tokens": 0, "output_audio_tokens": 0, "num_model_requests": counts.requests,
        "output_reasoning_tokens": counts.reasoning_tokens, "project_id": project, "user_id": None,
        "api_key_id": None, "model": model, "batch": batch,
    }
