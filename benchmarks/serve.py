"""Online serving benchmark: streamed requests to an OpenAI-compatible server, modelled on `vllm bench serve`.

Workloads (`--num-prompts` requests, `--output-len` tokens each with ignore_eos, seeded):
  random  /v1/completions with `prompt` a list of `--input-len` token ids drawn uniformly from
          [1000, vocab - 1000) (`--vocab-size`, default 49152 as SmolLM2's): the margins keep clear of the
          special, byte and added tokens that vocabularies put at either end, which decode to no text.
  chat    /v1/chat/completions with a synthetic conversation of 1-3 user turns (with assistant turns between)
          of words drawn from a fixed list, about `--input-len` words in all.
Arrivals: `--request-rate` requests/s as a Poisson process (seeded exponential gaps; default inf: all at once),
optionally capped by `--max-concurrency` requests in flight (a request that arrives while the cap is reached
waits for a slot; its latencies are timed from when it is sent). Every request streams with
stream_options.include_usage, and its token counts come from the final usage chunk (falling back to the number
of content chunks and the prompt's length). Metrics are defined in benchmarks/serve_metrics.py. A table goes to
stdout and, with `--out`, one JSON object is appended per run. Exit status 1 when no request completed.

    ladle bench serve --dataset random --num-prompts 64 --input-len 128 --output-len 128 --max-concurrency 8 \\
        --out benchmarks/results/serve_cpu.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.common import append_result, git_commit, utc_timestamp
from benchmarks.serve_metrics import RequestOutput, compute_metrics, format_table

MAX_ERRORS_KEPT = 5
WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "curious", "cats",
    "watch", "from", "an", "old", "stone", "wall", "near", "river", "bank", "where", "children", "play", "games",
    "and", "tell", "stories", "about", "distant", "mountains", "deep", "forests", "bright", "stars", "ancient",
    "cities", "hidden", "treasure", "brave", "sailors", "strange", "machines", "quiet", "libraries", "warm",
    "bread", "fresh", "coffee", "rainy", "afternoons", "long", "journeys", "simple", "questions", "clever",
)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of the workload: the API path under the base URL, its JSON body (less `model`)."""

    path: str  # "/completions" or "/chat/completions"
    body: dict[str, Any]
    prompt_len: int  # token ids (random) or words (chat); used only when the server reports no usage


def _common_body(output_len: int, temperature: float) -> dict[str, Any]:
    return {"max_tokens": output_len, "temperature": temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def random_requests(num: int, input_len: int, output_len: int, vocab_size: int, seed: int,
                    temperature: float = 0.0) -> list[BenchRequest]:
    """`num` completions of `input_len` random token ids, each in [1000, vocab_size - 1000)."""
    if vocab_size <= 2000:
        raise ValueError(f"--vocab-size must exceed 2000, got {vocab_size}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, vocab_size - 1000) for _ in range(input_len)] for _ in range(num)]
    return [BenchRequest("/completions", {"prompt": ids, **_common_body(output_len, temperature)}, input_len)
            for ids in prompts]


def chat_requests(num: int, input_len: int, output_len: int, seed: int,
                  temperature: float = 0.0) -> list[BenchRequest]:
    """`num` chats ending in a user turn: 1-3 user turns, an assistant turn between each, ~`input_len` words."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        turns = 2 * rng.randint(1, 3) - 1  # user, assistant, user, ...
        sizes = [input_len // turns + (i < input_len % turns) for i in range(turns)]
        messages = [{"role": "user" if i % 2 == 0 else "assistant",
                     "content": " ".join(rng.choices(WORDS, k=max(size, 1)))} for i, size in enumerate(sizes)]
        requests.append(BenchRequest("/chat/completions", {"messages": messages,
                                                           **_common_body(output_len, temperature)}, input_len))
    return requests


def arrival_offsets(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: 0 for the first, then exponential gaps of mean
    1 / request_rate (a Poisson process); all 0 when the rate is infinite."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


def _chunk_text(event: dict[str, Any]) -> str:
    """The first choice's new text (completions `text`, chat `delta.content`); "" for role and usage chunks."""
    choices = event.get("choices") or [{}]
    choice = choices[0]
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


async def send_request(client: httpx.AsyncClient, request: BenchRequest, model: str) -> RequestOutput:
    """Stream one request and time its content chunks; never raises (a failure is a RequestOutput)."""
    start = time.perf_counter()
    arrivals: list[float] = []
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", request.path, json={**request.body, "model": model}) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                return RequestOutput(False, error=f"HTTP {response.status_code}: {body[:200]}")
            # Read to the end of the body rather than stopping at [DONE], so that the server has finished
            # with this request before its concurrency slot is given to the next one.
            async for line in response.aiter_lines():
                if not line.startswith("data:") or (payload := line[5:].strip()) == "[DONE]":
                    continue
                event = json.loads(payload)
                if event.get("error"):
                    return RequestOutput(False, error=f"stream error: {json.dumps(event['error'])[:200]}")
                if _chunk_text(event):
                    arrivals.append(time.perf_counter())
                usage = event.get("usage") or usage
    except Exception as exc:  # one broken response (connection, JSON, shape) is a failed request, not a crash
        return RequestOutput(False, error=f"{type(exc).__name__}: {exc}")
    if not arrivals:
        return RequestOutput(False, error="no content chunk received")
    return RequestOutput(
        True, prompt_tokens=int(usage.get("prompt_tokens") or request.prompt_len),
        output_tokens=int(usage.get("completion_tokens") or len(arrivals)),
        ttft=arrivals[0] - start, itl=tuple(b - a for a, b in itertools.pairwise(arrivals)),
        e2el=arrivals[-1] - start,
    )


async def run_requests(client: httpx.AsyncClient, requests: Sequence[BenchRequest], model: str,
                       offsets: Sequence[float], max_concurrency: int | None,
                       progress: bool = False) -> tuple[list[RequestOutput], float]:
    """Send request i at `offsets[i]` seconds after the start, at most `max_concurrency` in flight.

    Returns the outputs in workload order and the seconds from the start until the last request ended.
    """
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc="requests")
    start = time.perf_counter()

    async def one(request: BenchRequest, offset: float) -> RequestOutput:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        if slots is None:
            output = await send_request(client, request, model)
        else:
            async with slots:
                output = await send_request(client, request, model)
        bar.update()
        return output

    outputs = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
    duration = time.perf_counter() - start
    bar.close()
    return list(outputs), duration


def _client(args: argparse.Namespace) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No pool limit (a request waiting for a connection would count that wait in its TTFT), and no proxies
    # from the environment: the benchmark measures the server, not a proxy in front of it.
    return httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, trust_env=False,
                             timeout=httpx.Timeout(args.timeout), limits=httpx.Limits(max_connections=None))


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    """The requests `args` describe (see the module docstring)."""
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.input_len, args.output_len, args.vocab_size, args.seed,
                               args.temperature)
    return chat_requests(args.num_prompts, args.input_len, args.output_len, args.seed, args.temperature)


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, run the timed workload, print the table; returns the JSON result (see `main`)."""
    requests = build_workload(args)
    async with _client(args) as client:
        model = args.model
        if model is None:
            response = await client.get("/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        if args.num_warmups:
            warmups = await asyncio.gather(*(send_request(client, requests[i % len(requests)], model)
                                             for i in range(args.num_warmups)))
            if not any(w.success for w in warmups):
                raise RuntimeError(f"every warm-up request failed, e.g. {warmups[0].error}")
        print(f"{args.dataset}: {len(requests)} requests to {args.base_url} ({model}), "
              f"rate {args.request_rate} req/s, max concurrency {args.max_concurrency}", flush=True)
        offsets = arrival_offsets(len(requests), args.request_rate, args.seed)
        outputs, duration = await run_requests(client, requests, model, offsets, args.max_concurrency,
                                               progress=sys.stderr.isatty())
    metrics = compute_metrics(outputs, duration)
    print(format_table(metrics), flush=True)
    return {
        "benchmark": "serve",
        "time": utc_timestamp(),
        "commit": git_commit(),
        "command": args.command_line,
        "base_url": args.base_url,
        "model": model,
        "dataset": args.dataset,
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "vocab_size": args.vocab_size, "seed": args.seed, "temperature": args.temperature,
                     "ignore_eos": True, "num_warmups": args.num_warmups, "timeout_s": args.timeout,
                     # JSON has no infinity: null means every request at once.
                     "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
                     "max_concurrency": args.max_concurrency},
        "metrics": metrics,
        "errors": [o.error for o in outputs if not o.success][:MAX_ERRORS_KEPT],
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ladle bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI API root")
    parser.add_argument("--api-key", help="sent as a Bearer token")
    parser.add_argument("--model", help="model name to request (default: the first of GET /models)")
    parser.add_argument("--dataset", choices=["random", "chat"], default="random")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (random) or words (chat)")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens, with ignore_eos")
    parser.add_argument("--vocab-size", type=int, default=49152, help="random ids lie in [1000, this - 1000)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default inf)")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no cap)")
    parser.add_argument("--num-warmups", type=int, default=1, help="untimed requests first (all failing aborts)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--out", type=Path, help="append the JSON result to this .jsonl file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark `argv` describes; 0 when at least one request completed, else 1.

    The appended JSON object: benchmark ("serve"), time, commit, command, base_url, model, dataset,
    workload (every workload flag), metrics (see `serve_metrics.compute_metrics`), errors (the first few).
    """
    args = build_parser().parse_args(argv)
    args.command_line = "ladle bench serve " + shlex.join(argv if argv is not None else sys.argv[1:])
    try:
        result = asyncio.run(run_benchmark(args))
    except (httpx.HTTPError, RuntimeError, KeyError, IndexError) as exc:
        print(f"ladle bench serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    append_result(args.out, result)
    return 0 if result["metrics"]["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
