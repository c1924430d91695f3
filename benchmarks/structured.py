"""Constrained vs unconstrained decoding throughput on the same requests, at a fixed concurrency.

Workload: `--num-seqs` chat prompts (half ask for a person, half for a book summary), all submitted at once,
greedy. The constrained run gives each its JSON schema. The unconstrained run sends the same prompts with
ignore_eos and max_tokens set to the length the constrained run produced for that request, so both runs
decode exactly the same number of tokens per request and the batch shrinks the same way: the ratio of their
output tok/s is the cost of the grammar work alone (bitmask fill, mask apply, matcher accept). Grammars are
compiled once before timing (compile time is reported apart). Runs alternate, `--repeats` of each; the
median and the best wall-clock rates are reported, and the rate per CPU-second of this process, which
other work sharing the machine disturbs far less than wall time.

    python -m benchmarks.structured --num-seqs 32 --repeats 3 --out benchmarks/results/structured.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from functools import wraps
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import add_model_arguments, append_result

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "occupation": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "occupation"],
}
BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "author": {"type": "string", "maxLength": 60},
        "year": {"type": "integer"},
        "summary": {"type": "string", "maxLength": 300},
    },
    "required": ["title", "author", "year", "summary"],
}
SUBJECTS = ["a firefighter", "a pianist", "a chef", "a teacher", "an astronaut", "a runner", "a painter", "a nurse"]
BOOKS = ["Moby-Dick", "The Hobbit", "Frankenstein", "Emma", "Dracula", "Ulysses", "Beloved", "Hamlet"]


class _Timer:
    """Accumulated seconds spent in wrapped methods (the host-side grammar work of each step)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def _workload(num_seqs: int) -> tuple[list[Any], list[dict[str, Any]]]:
    from engine_server import ChatPrompt
    from engine_server.tokenizer.chat import ChatMessage

    prompts, schemas = [], []
    for i in range(num_seqs):
        if i % 2 == 0:
            text = f"Describe {SUBJECTS[i // 2 % len(SUBJECTS)]} (person #{i}) as JSON with name, age and occupation."
            schemas.append(PERSON)
        else:
            text = f"Summarize the book {BOOKS[i // 2 % len(BOOKS)]} as JSON (entry #{i})."
            schemas.append(BOOK)
        prompts.append(ChatPrompt([ChatMessage(role="user", content=text)]))
    return prompts, schemas


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from engine_server import LLM, SamplingParams
    from engine_server.config import EngineConfig, SchedulerConfig
    from engine_server.structured import Constraint

    config = EngineConfig(
        model=args.model,
        device=args.device,
        scheduler=SchedulerConfig(max_num_seqs=max(args.num_seqs, 1)),
    )
    llm = LLM(config=config)
    prompts, schemas = _workload(args.num_seqs)
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=args.max_tokens, constraint=Constraint.json_schema(s))
        for s in schemas
    ]
    start = time.perf_counter()
    compiler = llm.grammar_compiler
    assert compiler is not None  # None only for an encoder model, which does not generate
    for params in {p.constraint: p for p in constrained}.values():
        assert params.constraint is not None
        compiler.compile(params.constraint)
    compile_s = time.perf_counter() - start

    timer = _Timer()
    grammars = llm.core.runner.grammars
    grammars.bitmasks = timer.wrap(grammars.bitmasks)  # type: ignore[method-assign]
    grammars.accept = timer.wrap(grammars.accept)  # type: ignore[method-assign]

    first = llm.generate(prompts, constrained, use_tqdm=False)  # warm-up, and the lengths to mirror
    lengths = [len(r.choices[0].token_ids) for r in first]
    plain = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]

    def timed(params: Sequence[Any]) -> tuple[float, float, int]:
        begin, cpu = time.perf_counter(), time.process_time()
        results = llm.generate(prompts, list(params), use_tqdm=False)
        tokens = sum(len(r.choices[0].token_ids) for r in results)
        return time.perf_counter() - begin, time.process_time() - cpu, tokens

    runs = {"constrained": constrained, "unconstrained": plain}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    cpu_rates: dict[str, list[float]] = {name: [] for name in runs}
    grammar_share: list[float] = []
    for _ in range(args.repeats):
        for name, batch_params in runs.items():
            before = timer.seconds
            seconds, cpu_seconds, tokens = timed(batch_params)
            rates[name].append(tokens / seconds)
            cpu_rates[name].append(tokens / cpu_seconds)
            if name == "constrained":
                grammar_share.append((timer.seconds - before) / seconds)
            print(f"{name}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.2f} tok/s", flush=True)
    finish = [r.choices[0].finish_reason.value if r.choices[0].finish_reason else None for r in first]
    median = {name: round(statistics.median(values), 2) for name, values in rates.items()}
    best = {name: round(max(values), 2) for name, values in rates.items()}
    per_cpu = {name: round(statistics.median(values), 2) for name, values in cpu_rates.items()}
    result = {
        "benchmark": "structured",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": args.command_line,
        "machine": {
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        },
        "workload": {
            "model": args.model,
            "num_seqs": args.num_seqs,
            "output_tokens": sum(lengths),
            "output_len_min_max": [min(lengths), max(lengths)],
            "finish_reasons": {reason: finish.count(reason) for reason in set(finish)},
        },
        "compile_seconds_cold": round(compile_s, 3),
        "output_tok_per_s_median": median,
        "output_tok_per_s_best": best,
        "output_tok_per_cpu_s_median": per_cpu,
        "runs": {name: [round(v, 2) for v in values] for name, values in rates.items()},
        "grammar_host_share_of_wall": round(statistics.median(grammar_share), 4),
        "ratio_median": round(median["constrained"] / median["unconstrained"], 3),
        "ratio_best": round(best["constrained"] / best["unconstrained"], 3),
        "ratio_per_cpu_s": round(per_cpu["constrained"] / per_cpu["unconstrained"], 3),
    }
    print(json.dumps(result, indent=2))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.structured",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="append the JSON result to this .jsonl file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = "python -m benchmarks.structured " + " ".join(argv or [])
    result = run_benchmark(args)
    append_result(args.out, result)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
