"""Usage per project: the ledger's counters and increments, the store's upserts (two flushes of one row add up, on
SQLite and PostgreSQL), and the usage page's daily buckets and groups."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from sqlalchemy import Engine

from gateway.store.usage import DAY_S, UsageCounts, UsageKey, UsageStore
from gateway.usage import UsageLedger, completions_usage_page
from ladle.v1 import types_pb2

DAY = 20_000 * DAY_S


def test_the_ledger_counts_and_hands_over_its_increments() -> None:
    registry = CollectorRegistry()
    ledger = UsageLedger(registry)
    ledger.record("alpha", "m", "interactive", [types_pb2.Usage(prompt_tokens=5, completion_tokens=3,
                                                                cached_prompt_tokens=2, reasoning_tokens=1)] * 2)
    ledger.record("alpha", "m", "batch", [types_pb2.Usage(prompt_tokens=7, completion_tokens=1)])
    sample = registry.get_sample_value
    assert sample("ladle_gateway_usage_tokens_total", {"project": "alpha", "model": "m", "kind": "interactive",
                                                       "type": "input"}) == 10
    assert sample("ladle_gateway_usage_requests_total", {"project": "alpha", "model": "m", "kind": "batch"}) == 1
    taken = ledger.take()
    assert {k.kind: v for k, v in taken.items()} == {"interactive": UsageCounts(1, 10, 4, 6, 2),
                                                     "batch": UsageCounts(1, 7, 0, 1, 0)}
    assert ledger.take() == {}
    ledger.give_back(taken)  # a failed flush: kept, merged with what came since
    ledger.record("alpha", "m", "batch", [types_pb2.Usage(prompt_tokens=1)])
    assert {k.kind: v.requests for k, v in ledger.take().items()} == {"interactive": 1, "batch": 2}


def test_flushes_of_one_row_add_up(store_db: Engine) -> None:
    store = UsageStore(store_db)
    key = UsageKey("alpha", DAY, "m", "interactive")
    store.add({key: UsageCounts(1, 10, 2, 5, 1)})
    store.add({key: UsageCounts(2, 1, 0, 1, 0), UsageKey("beta", DAY + DAY_S, "m", "batch"): UsageCounts(1, 3)})
    assert store.rows(DAY, DAY + 2 * DAY_S, ["alpha"]) == [(key, UsageCounts(3, 11, 2, 6, 1))]
    assert len(store.rows(DAY, DAY + 2 * DAY_S, None)) == 2 and store.rows(DAY, DAY + DAY_S, ["beta"]) == []


def test_the_page_has_a_bucket_a_day_grouped_as_asked() -> None:
    rows = [
        (UsageKey("alpha", DAY, "m", "interactive"), UsageCounts(1, 10, 0, 5, 0)),
        (UsageKey("alpha", DAY, "m", "batch"), UsageCounts(2, 20, 0, 6, 0)),
        (UsageKey("beta", DAY + DAY_S, "m", "interactive"), UsageCounts(1, 1, 0, 1, 0)),
    ]
    page = completions_usage_page(rows, DAY, 3, [], None)
    assert [b["start_time"] for b in page["data"]] == [DAY, DAY + DAY_S, DAY + 2 * DAY_S] and not page["has_more"]
    first = page["data"][0]["results"]
    assert len(first) == 1 and first[0]["input_tokens"] == 30 and first[0]["num_model_requests"] == 3
    assert first[0]["project_id"] is None and first[0]["batch"] is None
    assert page["data"][2]["results"] == []
    split = completions_usage_page(rows, DAY, 1, ["project_id", "batch"], DAY + DAY_S)
    assert {(r["project_id"], r["batch"], r["output_tokens"]) for r in split["data"][0]["results"]} == {
        ("alpha", False, 5), ("alpha", True, 6)}
    assert split["has_more"] and split["next_page"] == str(DAY + DAY_S)
