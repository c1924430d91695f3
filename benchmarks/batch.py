"""Batch jobs: their throughput against the offline engine, and interactive latency while one runs. One run:

  1. The offline engine (`LLM.generate`, same max_num_seqs and KV cache) is built in this process and warmed up.
  2. `ladle serve` (engine + gateway, a fresh data directory), warmed up with a few chat requests and a
     32-line batch, then left without interactive requests for the engine's quiet spell.
  3. `--rounds` rounds (default 2), each: a batch of `--num-lines` chat requests (one-sentence prompts, or with
     `--prompt-tokens N` prompts of about N tokens that share no prefix beyond the template's; `--output-len`
     tokens each, ignore_eos, greedy) through the OpenAI files + batches API, alone: output tokens and seconds
     from creating the batch to seeing it completed; then the offline engine on the same conversations while
     the server sits idle. Alternating the two puts a slow spell of a shared machine (rates here drift by 10%
     from one minute to the next) on both alike; each side's rate is its tokens over its seconds, all rounds.
  4. `--probes` streamed chat requests one after another on the idle server: the idle time to first token (TTFT).
  5. The same batch again, now with the probes running one after another while it does: TTFT under load.
Reported: batch / offline throughput ratio (target >= 0.9; per round too), batch with probes / batch alone,
and busy / idle median TTFT (target <= 1.5 for short prompts; <= 3 for long ones). On the CPU an arrival stops
the batch step it finds running (engine_server.step_interrupt); a step it cannot stop is kept short by the
engine's `--batch-step-target`, which `--batch-step-target` here passes on. A table goes to stdout and, with
`--out`, one JSON object is appended.

    ladle bench batch --num-lines 1000 --output-len 16 --out benchmarks/results/batch_cpu.jsonl
    ladle bench batch --num-lines 200 --prompt-tokens 1000 --out benchmarks/results/batch_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import add_model_arguments, append_result, cpu_model_name, git_commit, ladle_serve, utc_timestamp
from engine_server.core.step_timing import INTERACTIVE_QUIET_S

TOPICS = ("the sea", "a cat", "rain", "Paris", "music", "a robot", "the moon", "bread", "trains", "snow", "tea",
          "a river", "chess", "winter", "bees", "a lighthouse")
PROBE = [{"role": "user", "content": "What is the capital of France?"}]
# Common words of one token each (with their leading space) in the Llama/Qwen/SmolLM BPE vocabularies.
WORDS = ("time", "people", "water", "world", "house", "light", "night", "river", "music", "story", "garden",
         "city", "window", "morning", "paper", "friend", "school", "family", "market", "mountain", "table",
         "door", "road", "tree", "voice", "summer", "letter", "bird", "stone", "horse", "field", "ship")
TEMPLATE_TOKENS = 40  # what the chat template and the instruction add to a long prompt's words, about


def conversations(num: int, prompt_tokens: int = 0) -> list[list[dict[str, str]]]:
    """`num` chats: one-sentence requests, or with `prompt_tokens` notes of about that many tokens each,
    seeded by their index and numbered first, so no two share a prefix beyond the chat template's."""
    if prompt_tokens <= 0:
        return [[{"role": "user", "content": f"Write one sentence about {TOPICS[i % len(TOPICS)]} (note {i})."}]
                for i in range(num)]
    chats = []
    for i in range(num):
        words = random.Random(i).choices(WORDS, k=max(1, prompt_tokens - TEMPLATE_TOKENS))
        chats.append([{"role": "user", "content": f"Note {i}: {' '.join(words)}. Summarize note {i} in one sentence."}])
    return chats


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ladle bench batch", description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--num-lines", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="prompts of about this many tokens (0: one-sentence requests)")
    parser.add_argument("--batch-step-target", default=None,
                        help="the served engine's --batch-step-target (default: its own, auto)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--probes", type=int, default=20, help="TTFT probes, idle and under load")
    parser.add_argument("--rounds", type=int, default=2, help="batch-alone and offline runs, alternating")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def ttft(client: Any, model: str) -> float:
    """Seconds from sending a streamed chat request to its first content chunk."""
    started = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=PROBE, max_tokens=8, temperature=0, stream=True)
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                return time.perf_counter() - started
    finally:
        stream.close()
    raise RuntimeError("the probe produced no content")


def run_batch(
    client: Any, model: str, args: argparse.Namespace, folder: Path, num_lines: int | None = None
) -> dict[str, Any]:
    """Upload, create and wait for one batch (of `num_lines`, default `--num-lines`); its output tokens and
    seconds from creation to completion."""
    num_lines = args.num_lines if num_lines is None else num_lines
    path = folder / f"batch-{time.monotonic_ns()}.jsonl"
    with path.open("w") as f:
        for i, messages in enumerate(conversations(num_lines, args.prompt_tokens)):
            body = {"model": model, "messages": messages, "max_tokens": args.output_len, "temperature": 0,
                    "ignore_eos": True}
            f.write(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    with path.open("rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    started = time.perf_counter()
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(poll_interval(batch.request_counts, num_lines))
        batch = client.batches.retrieve(batch.id)
    seconds = time.perf_counter() - started
    if batch.status != "completed" or batch.request_counts.completed != num_lines:
        raise RuntimeError(f"the batch ended {batch.status} with {batch.request_counts}")
    tokens = batch.usage.output_tokens
    return {"lines": num_lines, "input_tokens": batch.usage.input_tokens, "output_tokens": tokens,
            "seconds": round(seconds, 2), "output_tok_per_s": round(tokens / seconds, 2)}


def poll_interval(counts: Any, num_lines: int) -> float:
    """Seconds until the next status poll: 0.5 until 95% of the lines are done, then 0.05, so the end is seen
    within 50 ms without the poller itself (each poll is an HTTP request and a database read on the gateway)
    taking a noticeable share of a small machine's CPU from the batch it measures."""
    done = (counts.completed + counts.failed) if counts is not None else 0
    return 0.05 if done >= 0.95 * num_lines else 0.5


def ttft_summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"n": len(samples), "median_ms": round(statistics.median(ordered) * 1000, 1),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 1),
            "max_ms": round(ordered[-1] * 1000, 1)}


def bench_served(args: argparse.Namespace, offline: OfflineEngine) -> dict[str, Any]:
    """Steps 2-5 of the module docstring: the served figures, and the offline rounds run between them."""
    import openai

    flags = ["--max-num-seqs", str(args.max_num_seqs), "--kv-cache-mib", str(args.kv_cache_mib)]
    if args.batch_step_target is not None:
        flags += ["--batch-step-target", args.batch_step_target]
    with ladle_serve(args.model, args.device, *flags) as served, tempfile.TemporaryDirectory() as folder:
        client = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        # Warm-ups: the chat path, and the batch path (as the offline engine's is), so neither figure pays
        # for first use. The batch alone starts once the engine has seen no interactive request for its quiet
        # spell: before, it keeps its steps short for them (engine_server.core.step_timing.INTERACTIVE_QUIET_S).
        for _ in range(3):
            ttft(client, model)
        run_batch(client, model, args, Path(folder), num_lines=min(args.num_lines, 32))
        time.sleep(INTERACTIVE_QUIET_S + 0.5)
        alone, offline_rounds = [], []
        for _ in range(args.rounds):
            alone.append(run_batch(client, model, args, Path(folder)))
            offline_rounds.append(offline.run())
        idle = [ttft(client, model) for _ in range(args.probes)]

        busy: list[float] = []
        done = threading.Event()

        def probe_while_running() -> None:
            time.sleep(3.0)  # let the batch fill the engine first
            while not done.is_set() and len(busy) < args.probes:
                busy.append(ttft(client, model))
                time.sleep(0.2)

        prober = threading.Thread(target=probe_while_running)
        prober.start()
        try:
            loaded = run_batch(client, model, args, Path(folder))
        finally:
            done.set()
            prober.join()
    return {"model": model, "ttft_idle": ttft_summary(idle), "ttft_during_batch": ttft_summary(busy),
            "batch_alone": combined(alone), "batch_with_probes": loaded, "offline": combined(offline_rounds)}


def combined(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one kind as one figure: their tokens over their seconds, with each round kept beside it."""
    tokens, seconds = sum(r["output_tokens"] for r in rounds), sum(r["seconds"] for r in rounds)
    return {"output_tokens": tokens, "seconds": round(seconds, 2), "output_tok_per_s": round(tokens / seconds, 2),
            "rounds": rounds}


class OfflineEngine:
    """The offline engine on the benchmark's conversations, built and warmed up once, run once per round."""

    def __init__(self, args: argparse.Namespace) -> None:
        from engine_server import LLM, ChatPrompt, SamplingParams
        from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
        from engine_server.tokenizer.chat import ChatMessage

        config = EngineConfig(model=args.model, device=args.device,
                              cache=CacheConfig(memory_bytes=args.kv_cache_mib * 1024**2),
                              scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs))  # fmt: skip
        self.llm = LLM(config=config)
        self.prompts = [ChatPrompt([ChatMessage(m["role"], m["content"]) for m in conv])
                        for conv in conversations(args.num_lines, args.prompt_tokens)]  # fmt: skip
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        self.llm.generate(self.prompts[:4], self.params, use_tqdm=False)  # warm-up

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        results = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = sum(len(r.choices[0].token_ids) for r in results)
        return {"output_tokens": tokens, "seconds": round(seconds, 2), "output_tok_per_s": round(tokens / seconds, 2)}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()  # the machine may be shared: the figures say how busy it was
    served_figures = bench_served(args, OfflineEngine(args))
    offline = served_figures["offline"]
    by_round = [a["output_tok_per_s"] / o["output_tok_per_s"]
                for a, o in zip(served_figures["batch_alone"]["rounds"], offline["rounds"], strict=True)]  # fmt: skip
    ratio = served_figures["batch_alone"]["output_tok_per_s"] / offline["output_tok_per_s"]
    probed = served_figures["batch_with_probes"]["output_tok_per_s"] / served_figures["batch_alone"]["output_tok_per_s"]
    ttft_ratio = served_figures["ttft_during_batch"]["median_ms"] / served_figures["ttft_idle"]["median_ms"]
    result = {
        "benchmark": "batch", "time": utc_timestamp(), "commit": git_commit(),
        "command": "ladle bench batch " + " ".join(argv), "machine": platform.machine(), "cpu": cpu_model_name(),
        "cpus": os.cpu_count(), "load_avg_1_5_15m": {"before": [round(x, 2) for x in load_before],
                                            "after": [round(x, 2) for x in os.getloadavg()]}, "device": args.device,
        "workload": {"lines": args.num_lines, "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
                     "kv_cache_mib": args.kv_cache_mib, "probes": args.probes, "prompt_tokens": args.prompt_tokens,
                     "batch_step_target": args.batch_step_target or "auto", "rounds": args.rounds},
        **served_figures,
        "batch_vs_offline": round(ratio, 3), "batch_vs_offline_by_round": [round(r, 3) for r in by_round],
        "probed_vs_alone": round(probed, 3),
        "ttft_busy_vs_idle": round(ttft_ratio, 2),
    }
    print(f"batch alone        {served_figures['batch_alone']['output_tok_per_s']:>9.1f} tok/s")
    print(f"batch with probes  {served_figures['batch_with_probes']['output_tok_per_s']:>9.1f} tok/s   "
          f"with probes/alone = {probed:.3f}")
    print(f"offline engine     {offline['output_tok_per_s']:>9.1f} tok/s   batch/offline = {ratio:.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in by_round)})")
    print(f"TTFT idle          {served_figures['ttft_idle']['median_ms']:>9.1f} ms median")
    print(f"TTFT during batch  {served_figures['ttft_during_batch']['median_ms']:>9.1f} ms median   "
          f"busy/idle = {ttft_ratio:.2f}")
    append_result(args.out, result)
    return 0
