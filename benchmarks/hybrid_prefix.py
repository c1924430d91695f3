"""A hybrid model's prefix cache (`engine_server.core.state_snapshots`): time to the first token of questions after one
long shared system prompt, with the linear-attention state snapshots on and off, in the same run.

The engine serves `--model` (a Qwen3.5 / Qwen3-Next preset or folder) alone (8 seats, 1 GiB of cache memory, 4,096
positions; by default as many snapshots as fit an eighth of it, at most 8); the prompt is `--prefix-len` random
token ids, then each of `--questions` questions of 16 random ids is asked after it, one at a time, for one token
(greedy). With snapshots the first two questions still pay for the whole prefix: the first saves its states at its
own last block boundary (inside its question), the second finds the shared blocks but no snapshot at their end, so
it computes them and saves one there; the others start from it. The medians are of the times to the first token of
the third question on; the prompt tokens the engine served from its cache are listed for every question. Greedy
tokens must be equal with and without snapshots (the script fails otherwise).

    PYTHONPATH=. .venv/bin/python -m benchmarks.hybrid_prefix --out benchmarks/results/hybrid_prefix_cpu.jsonl
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Literal

from benchmarks.common import append_result, cpu_model_name, git_commit, utc_timestamp

Device = Literal["cpu", "cuda"]


def measure(model: str, snapshots: int | None, prompts: list[list[int]], device: Device) -> dict[str, Any]:
    """Each prompt alone for one greedy token: the times to its first token, its cached prompt tokens, its token."""
    from engine_server import LLM, SamplingParams
    from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig

    config = EngineConfig(model=model, device=device, quantization="auto",
                          cache=CacheConfig(memory_bytes=1024**3, state_snapshots=snapshots),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=4096))  # fmt: skip
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times, cached, tokens = [], [], []
    with LLM(config=config) as llm:
        for prompt in prompts:
            start = time.perf_counter()
            (result,) = llm.generate([prompt], one, use_tqdm=False)
            times.append(time.perf_counter() - start)
            cached.append(result.usage.cached_prompt_tokens)
            tokens.append(result.choices[0].token_ids[0])
    return {"ttft_s": times, "cached_prompt_tokens": cached, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:qwen3.5-tiny")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--questions", type=int, default=6, help="at least 3")
    parser.add_argument("--out", type=Path, help="append the JSON result to this .jsonl file")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prefix = [rng.randrange(10, 40000) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(10, 40000) for _ in range(16)] for _ in range(args.questions)]
    off = measure(args.model, 0, prompts, args.device)
    on = measure(args.model, None, prompts, args.device)
    if off["tokens"] != on["tokens"]:
        print(f"greedy tokens differ: {off['tokens']} without snapshots, {on['tokens']} with", file=sys.stderr)
        return 1
    median_off, median_on = (statistics.median(run["ttft_s"][2:]) for run in (off, on))
    result = {
        "benchmark": "hybrid_prefix", "time": utc_timestamp(), "commit": git_commit(),
        "command": " ".join(["benchmarks/hybrid_prefix.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": args.device, "cpu": cpu_model_name(), "model": args.model, "prefix_len": args.prefix_len,
        "questions": args.questions, "median_ttft_s_without_snapshots": round(median_off, 4),
        "median_ttft_s_with_snapshots": round(median_on, 4), "speedup": round(median_off / median_on, 2),
        "cached_prompt_tokens_with_snapshots": on["cached_prompt_tokens"],
        "ttft_s_without": [round(t, 4) for t in off["ttft_s"]], "ttft_s_with": [round(t, 4) for t in on["ttft_s"]],
    }  # fmt: skip
    append_result(args.out, result)
    print(f"{args.model}, {args.prefix_len}-token prefix: median time to first token {median_off:.3f} s without "
          f"snapshots, {median_on:.3f} s with ({result['speedup']}x); cached {on['cached_prompt_tokens']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
