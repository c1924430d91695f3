"""A large batch file against the gateway's event loop: loop lag, RSS and interactive latency while a file is
uploaded and validated. One run:

  1. `ladle serve` (a fresh data directory); `--idle-s` seconds at rest.
  2. A `--num-lines` file of chat lines (`--line-bytes` each, ~200 MB by default) uploaded through
     `POST /v1/files`.
  3. A batch created from it: the worker validates every line. The file's last line repeats the first line's
     custom_id, so the batch ends `failed` once validation has read every line, and no engine time is spent.
Throughout, interactive probes run one after another (GET /v1/models, then a 1-token chat completion), and
the gateway's RSS (the `ladle serve` process; the engine is its child) and any other child's (the validation
process) is sampled every 20 ms. The loop lag of each phase comes from the gateway's own probe, the histogram
`ladle_gateway_event_loop_lag_seconds` on /metrics (a 10 ms timer's overshoot, sampled while the gateway serves a
request or runs a batch: here all along, the probes being requests): its quantiles are bucket upper bounds.
Targets: lag p99 <= 50 ms and gateway RSS growth <= 300 MB. A table goes to stdout and, with `--out`, one JSON
object is appended.

    ladle bench batch_upload --out benchmarks/results/batch_upload_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import append_result, cpu_model_name, git_commit, ladle_serve, utc_timestamp

LAG_METRIC = "ladle_gateway_event_loop_lag_seconds"
LAG_TARGET_S = 0.05
RSS_TARGET_MB = 300.0
PHASES = ("idle", "upload", "validation")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ladle bench batch_upload", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-lines", type=int, default=50_000)
    parser.add_argument("--line-bytes", type=int, default=4000, help="bytes per line, roughly")
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--note", default="", help="stored with the result (e.g. what the tree held)")
    return parser.parse_args(argv)


def write_batch_file(path: Path, num_lines: int, line_bytes: int, model: str) -> int:
    """A chat batch file of `num_lines` lines of about `line_bytes` each, whose last line repeats the first
    custom_id (so validation reads every line, then fails the batch); its size in bytes."""
    filler = "lorem ipsum " * max(1, (line_bytes - 220) // 24)  # two of them, and ~220 bytes of the rest
    with path.open("w") as f:
        for i in range(num_lines):
            custom_id = "0" if i == num_lines - 1 and i > 0 else str(i)
            body = {"model": model, "max_tokens": 8, "messages": [
                {"role": "system", "content": filler}, {"role": "user", "content": f"Question {i}: {filler}"}]}
            f.write(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    return path.stat().st_size


def lag_buckets(metrics_text: str) -> dict[float, float]:
    """The loop-lag histogram's cumulative bucket counts, by upper bound (inf included)."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == LAG_METRIC:
            return {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
    raise RuntimeError(f"/metrics has no {LAG_METRIC}")


def lag_summary(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """Loop lag between two scrapes: samples, p50 / p99 / max as bucket upper bounds (ms), share over target."""
    delta = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    total = delta[-1][1]

    def quantile(q: float) -> float | None:
        bound = next((b for b, count in delta if count >= q * total), float("inf"))
        return None if bound == float("inf") else round(bound * 1000, 1)

    over = total - next(count for b, count in delta if b >= LAG_TARGET_S)
    return {"samples": int(total), "p50_le_ms": quantile(0.5), "p99_le_ms": quantile(0.99),
            "max_le_ms": quantile(1.0), "share_over_50ms": round(over / total, 4) if total else None}


def latency_summary(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"n": 0}
    ordered = sorted(samples)
    return {"n": len(ordered), "median_ms": round(statistics.median(ordered) * 1000, 1),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 1),
            "max_ms": round(ordered[-1] * 1000, 1)}


@dataclass
class Watch:
    """What the background threads record, tagged with the phase running at the time."""

    phase: str = "idle"
    stop: threading.Event = field(default_factory=threading.Event)
    latency: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    rss_peak: dict[str, int] = field(default_factory=dict)
    child_rss_peak: dict[str, int] = field(default_factory=dict)


def chat_probe(model: str) -> dict[str, Any]:
    return {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def probe_interactive(client: httpx.Client, model: str, watch: Watch) -> None:
    """GET /v1/models and a 1-token chat completion, one after another, until stopped."""
    chat = chat_probe(model)
    while not watch.stop.is_set():
        for kind, send in (("models", lambda: client.get("/models")),
                           ("chat_1_token", lambda: client.post("/chat/completions", json=chat))):
            phase, started = watch.phase, time.perf_counter()
            send().raise_for_status()
            watch.latency.setdefault((phase, kind), []).append(time.perf_counter() - started)
        time.sleep(0.05)


def sample_rss(gateway: psutil.Process, engine_pids: set[int], watch: Watch) -> None:
    """Peak RSS per phase of the gateway and of any child it starts (not the engine), every 20 ms."""
    while not watch.stop.is_set():
        phase = watch.phase
        watch.rss_peak[phase] = max(watch.rss_peak.get(phase, 0), gateway.memory_info().rss)
        for child in gateway.children():
            if child.pid not in engine_pids:
                try:
                    rss = child.memory_info().rss
                except psutil.Error:  # it ended between the listing and the read
                    continue
                watch.child_rss_peak[phase] = max(watch.child_rss_peak.get(phase, 0), rss)
        time.sleep(0.02)


def upload_and_validate(client: httpx.Client, path: Path, watch: Watch, scrape: Any) -> dict[str, Any]:
    """Upload `path`, create a batch of it and wait until validation ends it; the phases' loop-lag scrapes and
    seconds, and the batch's first error."""
    marks = [scrape()]
    watch.phase = "upload"
    started = time.perf_counter()
    with path.open("rb") as f:
        upload = client.post("/files", data={"purpose": "batch"}, files={"file": (path.name, f)})
    upload.raise_for_status()
    seconds = {"upload": time.perf_counter() - started}
    marks.append(scrape())
    watch.phase = "validation"
    started = time.perf_counter()
    batch = client.post("/batches", json={"input_file_id": upload.json()["id"], "completion_window": "24h",
                                          "endpoint": "/v1/chat/completions"}).raise_for_status().json()
    while batch["status"] == "validating":
        time.sleep(0.05)
        batch = client.get(f"/batches/{batch['id']}").raise_for_status().json()
    seconds["validation"] = time.perf_counter() - started
    marks.append(scrape())
    errors = (batch.get("errors") or {}).get("data") or [{}]
    return {"marks": marks, "seconds": seconds, "status": batch["status"], "first_error": errors[0]}


def bench_served(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    with ladle_serve(args.model, "cpu") as served, httpx.Client(base_url=served.base_url, timeout=600) as client:
        root = served.base_url.removesuffix("/v1")
        model = client.get("/models").raise_for_status().json()["data"][0]["id"]
        for _ in range(3):  # warm-up: the first chat completions pay for the engine's first steps
            client.post("/chat/completions", json=chat_probe(model)).raise_for_status()
        path = folder / "batch.jsonl"
        size = write_batch_file(path, args.num_lines, args.line_bytes, model)
        gateway = psutil.Process(served.process.pid)
        engine_pids = {child.pid for child in gateway.children(recursive=True)}
        rss_before = gateway.memory_info().rss
        watch = Watch()
        probe_client = httpx.Client(base_url=served.base_url, timeout=600)
        threads = [threading.Thread(target=probe_interactive, args=(probe_client, model, watch)),
                   threading.Thread(target=sample_rss, args=(gateway, engine_pids, watch))]
        for thread in threads:
            thread.start()
        try:
            idle_mark = lag_buckets(client.get(root + "/metrics").text)
            time.sleep(args.idle_s)
            run = upload_and_validate(client, path, watch,
                                      lambda: lag_buckets(client.get(root + "/metrics").text))
        finally:
            watch.stop.set()
            for thread in threads:
                thread.join()
            probe_client.close()
    marks = [idle_mark, *run["marks"]]
    phases = {}
    for i, phase in enumerate(PHASES):
        phases[phase] = {
            "seconds": round(run["seconds"].get(phase, args.idle_s), 2),
            "loop_lag": lag_summary(marks[i], marks[i + 1]),
            "latency": {kind: latency_summary(watch.latency.get((phase, kind), []))
                        for kind in ("models", "chat_1_token")},
            "gateway_rss_peak_mb": round(watch.rss_peak.get(phase, 0) / 1e6, 1),
            "child_rss_peak_mb": round(watch.child_rss_peak.get(phase, 0) / 1e6, 1),
        }
    peak = max(watch.rss_peak.get(p, 0) for p in ("upload", "validation"))
    return {"model": model, "file_bytes": size, "batch_status": run["status"], "first_error": run["first_error"],
            "gateway_rss_before_mb": round(rss_before / 1e6, 1),
            "gateway_rss_growth_mb": round((peak - rss_before) / 1e6, 1), "phases": phases}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ladle-bench-upload-") as folder:
        figures = bench_served(args, Path(folder))
    busy = [figures["phases"][p]["loop_lag"]["p99_le_ms"] for p in ("upload", "validation")]
    lag_p99 = None if None in busy else max(b for b in busy if b is not None)
    result = {
        "benchmark": "batch_upload", "time": utc_timestamp(), "commit": git_commit(),
        "command": "ladle bench batch_upload " + " ".join(argv),
        "machine": {"cpu": cpu_model_name(), "cpus": os.cpu_count(), "device": "cpu",
                    "load_avg_before": [round(x, 2) for x in load_before],
                    "load_avg_after": [round(x, 2) for x in os.getloadavg()]},
        "workload": {"lines": args.num_lines, "line_bytes": args.line_bytes},
        **figures,
        "loop_lag_p99_le_ms": lag_p99,
        "note": args.note,
        "targets": {"loop_lag_p99_ms": LAG_TARGET_S * 1000, "gateway_rss_growth_mb": RSS_TARGET_MB},
        "targets_met": lag_p99 is not None and lag_p99 <= LAG_TARGET_S * 1000
        and figures["gateway_rss_growth_mb"] <= RSS_TARGET_MB,
    }
    print(f"file: {args.num_lines} lines, {figures['file_bytes'] / 1e6:.1f} MB; batch {figures['batch_status']} "
          f"({figures['first_error'].get('code')})")
    print(f"{'phase':<11}{'s':>7}{'lag p50':>9}{'lag p99':>9}{'>50ms':>8}{'models p50':>12}{'chat p50':>10}"
          f"{'chat max':>10}{'RSS MB':>8}")
    for phase, f in figures["phases"].items():
        lag, lat = f["loop_lag"], f["latency"]
        print(f"{phase:<11}{f['seconds']:>7}{lag['p50_le_ms']!s:>9}{lag['p99_le_ms']!s:>9}"
              f"{lag['share_over_50ms']!s:>8}{lat['models'].get('median_ms')!s:>12}"
              f"{lat['chat_1_token'].get('median_ms')!s:>10}{lat['chat_1_token'].get('max_ms')!s:>10}"
              f"{f['gateway_rss_peak_mb']:>8}")
    print(f"loop lag p99 <= {lag_p99} ms, gateway RSS growth {figures['gateway_rss_growth_mb']} MB: targets "
          f"{'met' if result['targets_met'] else 'NOT met'}")
    append_result(args.out, result)
    return 0
