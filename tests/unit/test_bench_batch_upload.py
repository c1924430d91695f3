"""`ladle bench batch_upload`'s pure parts: the batch file it uploads and the loop-lag figures it reports."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.batch_upload import lag_buckets, lag_summary, write_batch_file
from gateway.batches import lines

INF = float("inf")


def test_the_file_has_the_asked_size_and_fails_only_on_its_last_line(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    size = write_batch_file(path, 50, 4000, "m")
    assert 50 * 3900 < size < 50 * 4100
    with path.open("rb") as f:
        count, errors = lines.validate(lines.read_lines(f, 1 << 20), "/v1/chat/completions", "m")
    assert count == 50 and [(e.line, e.code) for e in errors] == [(50, "duplicate_custom_id")]
    assert json.loads(path.read_text().splitlines()[0])["body"]["model"] == "m"


def test_lag_quantiles_are_bucket_bounds_of_the_samples_between_two_scrapes() -> None:
    before = {0.005: 10.0, 0.05: 10.0, 0.1: 10.0, INF: 10.0}
    after = {0.005: 108.0, 0.05: 109.0, 0.1: 110.0, INF: 110.0}  # 98 fast samples, one <= 50 ms, one <= 100 ms
    summary = lag_summary(before, after)
    assert summary == {"samples": 100, "p50_le_ms": 5.0, "p99_le_ms": 50.0, "max_le_ms": 100.0,
                       "share_over_50ms": 0.01}


def test_lag_buckets_are_read_from_the_metrics_text() -> None:
    text = ('ladle_gateway_event_loop_lag_seconds_bucket{le="0.01"} 3.0\n'
            'ladle_gateway_event_loop_lag_seconds_bucket{le="+Inf"} 4.0\n'
            "ladle_gateway_event_loop_lag_seconds_count 4.0\nladle_gateway_event_loop_lag_seconds_sum 0.2\n")
    assert lag_buckets("# TYPE ladle_gateway_event_loop_lag_seconds histogram\n" + text) == {0.01: 3.0, INF: 4.0}
