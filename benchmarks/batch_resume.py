"""A large batch resumed by a gateway: event-loop lag while a worker picks up a batch with most of its lines done.

One run:
  1. A data directory is prepared as a gateway that died mid-batch leaves it: a `--num-lines` chat batch file
     (`--line-bytes` each, ~200 MB by default) and its batch `in_progress`, with every line but the last
     `--remaining` committed as results in a segment of a claim whose lease has run out.
  2. `ladle serve` starts on that directory; its worker claims the batch, reads the committed results, skips the
     done lines of the input file and runs the rest on the engine, then publishes the output file.
Throughout, interactive probes (GET /v1/models, a 1-token chat completion) run one after another. The loop lag is
the gateway's own histogram `ladle_gateway_event_loop_lag_seconds` on /metrics (a 10 ms timer's overshoot, sampled
while the gateway serves a request or runs a batch; its quantiles are bucket upper bounds) from the gateway's start
being served until the batch is completed. Target: p99 <= 50 ms. A table goes to stdout and, with `--out`, one
JSON object is appended.

    ladle bench batch_resume --out benchmarks/results/batch_resume_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.batch_upload import LAG_TARGET_S, Watch, chat_probe, lag_buckets, lag_summary, latency_summary
from benchmarks.batch_upload import probe_interactive as probe
from benchmarks.common import append_result, cpu_model_name, git_commit, ladle_serve, utc_timestamp
from gateway.batches import lines
from gateway.store.batches import BatchStore, Progress
from gateway.store.blobs import BlobStore, segment_key, upload_key
from gateway.store.database import database_url, open_database
from gateway.store.files import FileStore
from gateway.store.ids import BATCH_PREFIX, FILE_PREFIX, new_id
from gateway.store.pairing import pair

SERVED_MODEL = "SmolLM2-135M-Instruct"  # the embedded model's id, written into the batch as a validated one's


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ladle bench batch_resume", description=__doc__.split("\n")[0])
    parser.add_argument("--num-lines", type=int, default=50_000)
    parser.add_argument("--remaining", type=int, default=100, help="lines without a result when it resumes")
    parser.add_argument("--line-bytes", type=int, default=4000, help="bytes per input line, roughly")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--note", default="", help="stored with the result (e.g. what the tree held)")
    return parser.parse_args(argv)


def prepare(data_dir: Path, num_lines: int, remaining: int, line_bytes: int) -> tuple[str, int]:
    """The data directory of a gateway that died `remaining` lines before the end of a `num_lines` batch; (batch
    id, input file bytes)."""
    db = open_database(database_url(None, data_dir))
    blobs = BlobStore(data_dir / "blobs")
    pair(db, blobs)
    files, batches = FileStore(db), BatchStore(db)
    file_id = new_id(FILE_PREFIX)
    path = blobs.path(upload_key(file_id))
    path.parent.mkdir(parents=True, exist_ok=True)
    filler = "lorem ipsum " * max(1, (line_bytes - 300) // 12)  # one system prompt for all: a cached prefix
    with path.open("w") as f:
        for i in range(num_lines):
            body = {"model": SERVED_MODEL, "max_tokens": 4, "temperature": 0, "messages": [
                {"role": "system", "content": filler}, {"role": "user", "content": f"Say {i}."}]}
            f.write(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    size = path.stat().st_size
    files.add(files.record(file_id, "in.jsonl", "batch", size, upload_key(file_id)))
    record = batches.create(new_id(BATCH_PREFIX), "/v1/chat/completions", file_id, "24h", 86400, None)
    assert record is not None
    claim = batches.claim(record.id, "died", time.time(), 1.0)
    assert claim is not None
    batches.start(claim, num_lines, SERVED_MODEL)
    batches.add_segment(claim)
    segment = blobs.open_segment(segment_key(record.id, claim.epoch, "output"))
    done = num_lines - remaining
    for i in range(done):
        body = {"id": f"chatcmpl-{i}", "object": "chat.completion", "model": SERVED_MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": f"{i}"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}
        segment.append(lines.encode(lines.output_record(f"batch_req_{i}", f"line-{i}", f"req_{i}", 200, body)))
    batches.commit(claim, time.time(), 1.0, Progress(segment.sync(), 0, completed=done, prompt_tokens=10 * done,
                                                      completion_tokens=done))
    segment.close()
    db.dispose()
    time.sleep(1.1)  # the dead claim's lease runs out
    return record.id, size


def run(args: argparse.Namespace, data_dir: Path, batch_id: str) -> dict[str, Any]:
    watch = Watch(phase="resume")
    with ladle_serve("default", "cpu", data_dir=data_dir) as served, \
            httpx.Client(base_url=served.base_url, timeout=600) as client:
        root = served.base_url.removesuffix("/v1")
        started = time.perf_counter()
        first = lag_buckets(client.get(root + "/metrics").text)
        probe_client = httpx.Client(base_url=served.base_url, timeout=600)
        thread = threading.Thread(target=probe, args=(probe_client, SERVED_MODEL, watch))
        thread.start()
        try:
            client.post("/chat/completions", json=chat_probe(SERVED_MODEL)).raise_for_status()
            while (batch := client.get(f"/batches/{batch_id}").raise_for_status().json())["status"] not in {
                    "completed", "failed", "cancelled", "expired"}:
                time.sleep(0.05)
            seconds = time.perf_counter() - started
            last = lag_buckets(client.get(root + "/metrics").text)
        finally:
            watch.stop.set()
            thread.join()
            probe_client.close()
    return {"batch_status": batch["status"], "request_counts": batch["request_counts"],
            "seconds": round(seconds, 1), "loop_lag": lag_summary(first, last),
            "latency": {kind: latency_summary(watch.latency.get(("resume", kind), []))
                        for kind in ("models", "chat_1_token")}}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ladle-bench-resume-") as folder:
        data_dir = Path(folder)
        batch_id, size = prepare(data_dir, args.num_lines, args.remaining, args.line_bytes)
        figures = run(args, data_dir, batch_id)
    lag_p99 = figures["loop_lag"]["p99_le_ms"]
    counts = figures["request_counts"]
    result = {
        "benchmark": "batch_resume", "time": utc_timestamp(), "commit": git_commit(),
        "command": "ladle bench batch_resume " + " ".join(argv),
        "machine": {"cpu": cpu_model_name(), "cpus": os.cpu_count(), "device": "cpu",
                    "load_avg_before": [round(x, 2) for x in load_before],
                    "load_avg_after": [round(x, 2) for x in os.getloadavg()]},
        "workload": {"lines": args.num_lines, "done_before": args.num_lines - args.remaining,
                     "line_bytes": args.line_bytes, "file_bytes": size},
        **figures,
        "loop_lag_p99_le_ms": lag_p99,
        "note": args.note,
        "targets": {"loop_lag_p99_ms": LAG_TARGET_S * 1000},
        "targets_met": figures["batch_status"] == "completed" and counts["completed"] == args.num_lines
        and lag_p99 is not None and lag_p99 <= LAG_TARGET_S * 1000,
    }
    lag, chat = figures["loop_lag"], figures["latency"]["chat_1_token"]
    print(f"file: {args.num_lines} lines ({args.num_lines - args.remaining} done), {size / 1e6:.1f} MB; batch "
          f"{figures['batch_status']} {counts} in {figures['seconds']} s")
    print(f"loop lag: {lag['samples']} samples, p50 <= {lag['p50_le_ms']} ms, p99 <= {lag_p99} ms, max <= "
          f"{lag['max_le_ms']} ms; 1-token chat median {chat.get('median_ms')} ms, max {chat.get('max_ms')} ms")
    print(f"targets {'met' if result['targets_met'] else 'NOT met'}")
    append_result(args.out, result)
    return 0
