"""Cache-aware routing against least-busy routing: two engines behind one gateway, a shared-prefix chat workload.

The workload is many conversations on a few long system prompts (`--prefixes` of them, about `--prefix-words`
words each), `--questions` per prompt, in a seeded random order, `--concurrency` at a time, `--output-len`
tokens each. Each engine's KV cache (`--kv-cache-mib`) holds about half of the prompts at once (the defaults:
24 prompts of ~450 tokens, ~8,700 tokens of cache per engine), so where a conversation goes decides whether its
system prompt comes from the engine's prefix cache or is computed again.
For each routing policy, two fresh engines and a fresh gateway run the same workload; reported per policy:
prompt tokens, cached prompt tokens (the share served from the prefix cache), requests/s, output tok/s and
latency percentiles, and cache-aware / least-busy ratios. A table goes to stdout; with `--out`, one JSON object
is appended, and with `--chart`, a PNG is drawn.

    ladle bench routing --out benchmarks/results/routing_cpu.jsonl --chart benchmarks/results/routing_cpu.png
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import add_model_arguments, append_result, free_port, git_commit, utc_timestamp
from gateway.routing import Policy

POLICIES: tuple[Policy, ...] = ("least_busy", "cache_aware")
STARTUP_TIMEOUT_S = 600.0
WORDS = ("museum", "ticket", "mosaic", "garden", "lantern", "harbour", "archive", "gallery", "river", "station",
         "library", "bakery", "orchard", "theatre", "market", "bridge", "tower", "festival", "workshop", "castle")
_ROUTED = re.compile(r'^ladle_gateway_routed_total\{engine="([^"]+)",reason="([^"]+)"\} ([0-9.e+]+)$', re.M)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ladle bench routing", description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--prefixes", type=int, default=24, help="distinct long system prompts")
    parser.add_argument("--prefix-words", type=int, default=300, help="words per system prompt")
    parser.add_argument("--questions", type=int, default=4, help="conversations per system prompt")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--kv-cache-mib", type=int, default=400,
                        help="per engine (the embedded model needs ~380 for one 8192-token sequence)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="per engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--chart", type=Path, default=None)
    return parser.parse_args(argv)


def workload(args: argparse.Namespace) -> list[list[dict[str, str]]]:
    """Every conversation: one of the system prompts and a question of its own, in a seeded random order."""
    rng = random.Random(args.seed)
    prompts = []
    for p in range(args.prefixes):
        words = " ".join(rng.choice(WORDS) for _ in range(args.prefix_words))
        prompts.append(f"You are guide number {p} of the city. Facts you know: {words}. Answer in one sentence.")
    conversations = [[{"role": "system", "content": prompts[p]},
                      {"role": "user", "content": f"Question {q}: what should I see near the {rng.choice(WORDS)}?"}]
                     for p in range(args.prefixes) for q in range(args.questions)]
    rng.shuffle(conversations)
    return conversations


def _start(command: list[str], marker: str, threads: int | None, log: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "LADLE_LOG_LEVEL": "WARNING", "NO_PROXY": "*"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with log.open("w") as err:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    assert process.stdout is not None
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"{command[3]} exited while starting:\n{log.read_text()[-2000:]}")
        if marker in line:
            return process, line.split(marker, 1)[1].split()[0]
    raise RuntimeError(f"{command[3]} did not start within {STARTUP_TIMEOUT_S:g} s")


@contextlib.contextmanager
def two_engines_and_a_gateway(args: argparse.Namespace, policy: Policy, logs: Path) -> Iterator[str]:
    """Two fresh `ladle engine`s and a `ladle gateway --routing policy` in front of them; yields its base URL."""
    processes: list[subprocess.Popen[str]] = []
    try:
        addresses = []
        for i in range(2):
            process, address = _start(
                [sys.executable, "-m", "ladle_cli", "engine", "--model", args.model, "--device", args.device,
                 "--port", str(free_port()), "--max-num-seqs", str(args.max_num_seqs),
                 "--kv-cache-mib", str(args.kv_cache_mib)], " on ", args.threads, logs / f"{policy}-engine{i}.log")
            processes.append(process)
            addresses.append(address)
        gateway, url = _start(
            [sys.executable, "-m", "ladle_cli", "gateway", "--engine", ",".join(addresses), "--port", "0",
             "--routing", policy, "--batch-workers", "0", "--health-interval", "0.2",
             "--data-dir", str(logs / f"{policy}-data")], "OpenAI API on ", 1, logs / f"{policy}-gateway.log")
        processes.append(gateway)
        base = url.removesuffix("/v1")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(re.findall(r'^ladle_engine_up\{[^}]*\} 1', httpx.get(base + "/metrics").text, re.M)) < 2:
            for i, process in enumerate(processes[:2]):
                if process.poll() is not None:
                    log = (logs / f"{policy}-engine{i}.log").read_text()[-3000:]
                    raise RuntimeError(f"engine {i} exited with status {process.returncode}:\n{log}")
            assert time.monotonic() < deadline, "the engines never became SERVING"
            time.sleep(0.2)
        yield base
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


def run_policy(args: argparse.Namespace, policy: Policy, conversations: list[list[dict[str, str]]],
               logs: Path) -> dict[str, Any]:
    with two_engines_and_a_gateway(args, policy, logs) as base, httpx.Client(base_url=base, timeout=600) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]

        def one(messages: list[dict[str, str]]) -> tuple[float, dict[str, Any]]:
            body = {"model": model, "messages": messages, "max_tokens": args.output_len, "temperature": 0,
                    "ignore_eos": True}
            started = time.perf_counter()
            reply = http.post("/v1/chat/completions", json=body)
            reply.raise_for_status()
            return time.perf_counter() - started, reply.json()["usage"]

        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(one, conversations))
        elapsed = time.perf_counter() - started
        routed: Counter[str] = Counter()
        for engine, reason, count in _ROUTED.findall(http.get("/metrics").text):
            routed[f"{engine} {reason}"] += int(float(count))
    latencies = sorted(latency for latency, _ in results)
    prompt = sum(usage["prompt_tokens"] for _, usage in results)
    cached = sum(usage["prompt_tokens_details"]["cached_tokens"] for _, usage in results)
    output = sum(usage["completion_tokens"] for _, usage in results)
    return {
        "requests": len(results), "elapsed_s": round(elapsed, 2), "requests_per_s": round(len(results) / elapsed, 3),
        "output_tok_per_s": round(output / elapsed, 2), "prompt_tokens": prompt, "cached_prompt_tokens": cached,
        "cached_fraction": round(cached / prompt, 4), "latency_p50_s": round(statistics.median(latencies), 3),
        "latency_p90_s": round(latencies[int(0.9 * (len(latencies) - 1))], 3), "routed": dict(routed),
    }


def draw(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(result["policies"])
    colors = ["#7570b3" if p == "least_busy" else "#d95f02" for p in policies]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    panels = (("cached_fraction", "prompt tokens from the prefix cache", "%.2f"),
              ("requests_per_s", "requests / s", "%.2f"), ("latency_p50_s", "median latency (s)", "%.2f"))
    for ax, (key, label, fmt) in zip(axes, panels, strict=True):
        bars = ax.bar(policies, [result["policies"][p][key] for p in policies], color=colors)
        ax.bar_label(bars, fmt=fmt)
        ax.set_title(label, fontsize=10)
    w = result["workload"]
    fig.suptitle(f"two engines, {w['prefixes']} system prompts x {w['questions']} conversations, "
                 f"{w['model']} on {result['machine']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    conversations = workload(args)
    policies: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ladle-bench-routing-") as logs:
        for policy in POLICIES:
            policies[policy] = run_policy(args, policy, conversations, Path(logs))
            print(f"{policy:>12}: {policies[policy]}", flush=True)
    ours, base = policies["cache_aware"], policies["least_busy"]
    result = {
        "benchmark": "routing", "time": utc_timestamp(), "commit": git_commit(),
        "command": "ladle bench routing " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"device": args.device, "cpus": os.cpu_count(), "platform": platform.platform()},
        "workload": {k: getattr(args, k) for k in ("model", "prefixes", "prefix_words", "questions", "output_len",
                                                   "concurrency", "max_num_seqs", "kv_cache_mib", "threads",
                                                   "seed")},
        "policies": policies,
        "cache_aware_vs_least_busy": {
            "cached_tokens": round(ours["cached_prompt_tokens"] / max(1, base["cached_prompt_tokens"]), 3),
            "requests_per_s": round(ours["requests_per_s"] / base["requests_per_s"], 3),
        },
    }
    print(f"cache-aware / least-busy: {result['cache_aware_vs_least_busy']}")
    append_result(args.out, result)
    if args.chart is not None:
        draw(result, args.chart)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
