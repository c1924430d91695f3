"""Soak: `ladle serve` under mixed traffic for a bounded time; resident memory and KV blocks over the run.

`--clients` threads send, one after another, a random mix through the gateway: non-streaming chat, streamed
chat (SSE, read to the end), streamed chat dropped after a few chunks (the client hangs up), chat constrained
by a JSON schema (the reply must parse), and completions. Every `--sample-s` seconds the engine and gateway
resident set sizes (RSS) and the engine's GetLoad are recorded. At the end traffic stops, the engine goes idle
and its KV blocks in use are compared with the idle baseline taken before the traffic: any difference is a leak.
RSS growth is measured from the end of the warm-up (the first `--warmup-s` seconds, when allocators and caches
fill) to the end, and as a slope (least squares over the samples after warm-up), in MiB per hour.

    ladle bench soak --minutes 30 --out benchmarks/results/soak_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.common import add_model_arguments, append_result, git_commit, ladle_serve, utc_timestamp
from ladle.client import EngineClient
from ladle.v1 import engine_pb2, types_pb2

KINDS = ("chat", "stream", "dropped_stream", "json_schema", "completion")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOPICS = ("the sea", "a cat", "rain", "Paris", "music", "a robot", "the moon", "bread")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ladle bench soak", description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--sample-s", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


class Traffic:
    """The client threads and what they saw: requests by kind, failures by kind (with one example each)."""

    def __init__(self, base_url: str, model: str, args: argparse.Namespace) -> None:
        self.base_url, self.model, self.args = base_url, model, args
        self.done: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(args.seed + i,), daemon=True)
                         for i in range(args.clients)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.base_url, timeout=300) as http:
            while not self._stop.is_set():
                kind = rng.choice(KINDS)
                try:
                    self._send(http, kind, rng)
                except Exception as exc:  # a soak counts failures, it does not stop on them
                    with self._lock:
                        self.failed[kind] += 1
                        self.examples.setdefault(kind, f"{type(exc).__name__}: {exc}"[:300])
                else:
                    with self._lock:
                        self.done[kind] += 1

    def _send(self, http: httpx.Client, kind: str, rng: random.Random) -> None:
        topic = rng.choice(TOPICS)
        messages = [{"role": "user", "content": f"Write about {topic} ({rng.randrange(10**6)})."}]
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.args.max_tokens,
                                "temperature": rng.choice([0.0, 0.7])}
        if kind == "chat":
            check(http.post("/chat/completions", json=body))
        elif kind == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
            body["max_tokens"] = 64
            reply = check(http.post("/chat/completions", json=body))
            choice = reply["choices"][0]
            if choice["finish_reason"] == "stop":
                json.loads(choice["message"]["content"])  # a constrained reply that ended must parse
        elif kind == "completion":
            del body["messages"]
            check(http.post("/completions", json={**body, "prompt": f"A note about {topic}:"}))
        else:
            body["stream"] = True
            with http.stream("POST", "/chat/completions", json=body) as reply:
                if reply.status_code != 200:
                    raise RuntimeError(f"HTTP {reply.status_code}: {reply.read()[:200]!r}")
                keep = rng.randint(1, 4) if kind == "dropped_stream" else None
                for i, line in enumerate(reply.iter_lines()):
                    if keep is not None and i >= keep:
                        return  # leaving the block closes the connection mid-stream
                    if line == "data: [DONE]":
                        return
            if keep is None:
                raise RuntimeError("a stream ended without [DONE]")


def check(reply: httpx.Response) -> Any:
    if reply.status_code != 200:
        raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:200]}")
    return reply.json()


def rss_mib(process: psutil.Process) -> float:
    return round(process.memory_info().rss / 2**20, 1)


def idle_load(engine: EngineClient, timeout: float = 30.0) -> engine_pb2.GetLoadResponse:
    """GetLoad once nothing runs or waits (raises TimeoutError if that does not happen in `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        load = engine.load(timeout=5)
        if not (load.running or load.waiting):
            return load
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine is not idle: {load}")
        time.sleep(0.1)


def slope_mib_per_hour(samples: list[dict[str, Any]], key: str) -> float:
    """Least-squares slope of samples[key] (MiB) over samples['t_s'] (seconds), in MiB per hour."""
    if len(samples) < 2:
        return 0.0
    ts = [s["t_s"] for s in samples]
    ys = [s[key] for s in samples]
    mean_t, mean_y = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mean_t) ** 2 for t in ts)
    cov = sum((t - mean_t) * (y - mean_y) for t, y in zip(ts, ys, strict=True))
    return round(cov / var * 3600, 1) if var else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--kv-cache-mib", str(args.kv_cache_mib)]
    with ladle_serve(args.model, args.device, *flags) as served, \
            EngineClient(served.grpc_address, auth_token=served.engine_token) as engine_client:
        gateway = psutil.Process(served.process.pid)
        engine = next(p for p in gateway.children(recursive=True) if "engine" in " ".join(p.cmdline()))
        model = httpx.get(f"{served.base_url}/models", timeout=30).json()["data"][0]["id"]
        baseline = idle_load(engine_client)
        traffic = Traffic(served.base_url, model, args)
        samples: list[dict[str, Any]] = []
        started = time.monotonic()
        traffic.start()
        while (elapsed := time.monotonic() - started) < args.minutes * 60:
            time.sleep(min(args.sample_s, max(0.0, args.minutes * 60 - elapsed)))
            load = engine_client.load(timeout=5)
            samples.append({"t_s": round(time.monotonic() - started, 1), "engine_rss_mib": rss_mib(engine),
                            "gateway_rss_mib": rss_mib(gateway), "running": load.running,
                            "waiting": load.waiting, "kv_blocks_used": load.kv_blocks_used,
                            "requests": sum(traffic.done.values())})
            print(json.dumps(samples[-1]), flush=True)
        traffic.stop()
        after = idle_load(engine_client)
        probe = engine_pb2.GenerateRequest(input=types_pb2.Input(text="Still serving?"),
                                           sampling=types_pb2.SamplingParams(max_tokens=2, temperature=0.0))
        ok = engine_client.generate(probe, timeout=60)
        settled = [s for s in samples if s["t_s"] >= args.warmup_s] or samples
        return {
            "duration_s": round(time.monotonic() - started, 1),
            "requests": dict(traffic.done), "failures": dict(traffic.failed), "failure_examples": traffic.examples,
            "kv_blocks_used_idle_before": baseline.kv_blocks_used, "kv_blocks_used_idle_after": after.kv_blocks_used,
            "leaked_kv_blocks": after.kv_blocks_used - baseline.kv_blocks_used,
            "serves_after": bool(ok.choices and ok.choices[0].token_ids),
            "engine_rss_mib": {"after_warmup": settled[0]["engine_rss_mib"], "end": samples[-1]["engine_rss_mib"],
                               "growth": round(samples[-1]["engine_rss_mib"] - settled[0]["engine_rss_mib"], 1),
                               "slope_mib_per_hour": slope_mib_per_hour(settled, "engine_rss_mib")},
            "gateway_rss_mib": {"after_warmup": settled[0]["gateway_rss_mib"],
                                "end": samples[-1]["gateway_rss_mib"],
                                "growth": round(samples[-1]["gateway_rss_mib"] - settled[0]["gateway_rss_mib"], 1),
                                "slope_mib_per_hour": slope_mib_per_hour(settled, "gateway_rss_mib")},
            "samples": samples,
        }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    figures = run(args)
    result = {
        "benchmark": "soak", "time": utc_timestamp(), "commit": git_commit(),
        "command": "ladle bench soak " + " ".join(argv),
        "machine": platform.machine(), "cpus": psutil.cpu_count(), "device": args.device,
        "workload": {"minutes": args.minutes, "clients": args.clients, "max_tokens": args.max_tokens,
                     "max_num_seqs": args.max_num_seqs, "kinds": list(KINDS)},
        **figures,
    }
    append_result(args.out, result)
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    return 0 if not figures["failures"] and figures["leaked_kv_blocks"] == 0 and figures["serves_after"] else 1


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
