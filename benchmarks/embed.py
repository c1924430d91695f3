"""Pooling throughput: ladle's embeddings vs transformers' batched forward, and pooling mixed with generation.

Offline: `--num-inputs` random-token inputs of `--input-len` tokens each, embedded by ladle's `LLM.embed` on each
`--quantization` path (`none`: float32; `auto`: the default, GGUF's 4-bit blocks on the CPU) and by transformers'
bare decoder holding the same weights (fp32 on the CPU), in batches of `--hf-batch-size`, last-token pooled and
L2-normalized, all in this one process with the same torch threads. Every timed run embeds inputs of its own, so
no prefix cache serves a repeat, and the systems take turns run by run; each reports the median of `--repeats`
runs as inputs/s and tokens/s, and ladle's ratio to transformers. A sanity check compares ladle's vectors with
transformers' (each vector's relative error; the float path should be within 1e-5).

Mixed load, on one engine (`--mixed-quantization`) driven through its core: `--mixed-generations` greedy
generations (`--mixed-prompt-len` prompt tokens, `--mixed-output-len` new tokens, ignore_eos) and
`--mixed-inputs` pooling requests of `--input-len` tokens, all queued at once, interleaved, with the priorities
of `--generate-priority` and `--embed-priority`; then each kind alone. Reported per run: each kind's wall time
and rate, how long its requests waited before their first step, and the longest gap between two tokens of a
generation (the median of `--repeats` runs of each figure).

    ladle bench embed --num-inputs 64 --input-len 128 --repeats 3 --out benchmarks/results/embed_cpu.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import add_model_arguments, append_result, cpu_model_name, git_commit, hf_model, utc_timestamp
from engine_server.config import QUANTIZATION_MODES

Inputs = list[list[int]]
PRIORITIES = ("interactive", "batch")


def make_inputs(count: int, length: int, vocab_size: int, seed: int, label: str) -> Inputs:
    """`count` random-token inputs of `length` ids, a function of (seed, label) alone: each run has its own."""
    rng = random.Random(f"{seed}/{label}")
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(count)]


Embedder = Callable[[Inputs], list[torch.Tensor]]


def _median_run(runs: list[float], count: int, tokens: int) -> dict[str, Any]:
    """A system's figures from its runs' seconds: the median run's, and every run's inputs/s."""
    seconds = statistics.median(runs)
    return {
        "inputs": count, "tokens": tokens, "seconds": round(seconds, 3),
        "inputs_per_s": round(count / seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
        "runs_inputs_per_s": [round(count / s, 2) for s in runs],
    }  # fmt: skip


def ladle_embedder(stack: contextlib.ExitStack, args: argparse.Namespace, quantization: str) -> tuple[Embedder, Any]:
    """ladle's offline `LLM.embed` with the weights `quantization` selects (closed with `stack`), and its facts."""
    from engine_server import LLM

    llm = stack.enter_context(LLM(config=_engine_config(args, quantization)))
    return (lambda inputs: llm.embed(inputs, use_tqdm=False)), {"quantization": llm.core.runner.quantization}


def hf_embedder(args: argparse.Namespace) -> tuple[Embedder, Any]:
    """transformers' bare decoder holding the same weights, `--hf-batch-size` inputs per forward: the last token's
    final hidden state, L2-normalized (every input of a run has the same length, so no padding)."""
    decoder = hf_model(args.model, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32).model
    size = args.hf_batch_size

    def embed(inputs: Inputs) -> list[torch.Tensor]:
        vectors: list[torch.Tensor] = []
        with torch.inference_mode():
            for i in range(0, len(inputs), size):
                ids = torch.tensor(inputs[i : i + size], device=args.device)
                hidden = decoder(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
                vectors += F.normalize(hidden[:, -1].float(), dim=-1).cpu().unbind(0)
        return vectors

    return embed, {"batch_size": size, "dtype": str(next(decoder.parameters()).dtype)}


def time_systems(systems: dict[str, Embedder], runs: list[Inputs], warmup: Inputs) -> tuple[dict[str, Any], Any]:
    """Each system warmed up, then timed on every run's inputs, the systems taking turns run by run (a burst of a
    shared machine's neighbours then slows all of them, not one); each one's figures and first run's vectors."""
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    first: dict[str, torch.Tensor] = {}
    for embed in systems.values():
        embed(warmup)
    for inputs in runs:
        for name, embed in systems.items():
            start = time.perf_counter()
            vectors = embed(inputs)
            seconds[name].append(time.perf_counter() - start)
            first.setdefault(name, torch.stack(vectors))
    count, tokens = len(runs[0]), sum(map(len, runs[0]))
    return {name: _median_run(seconds[name], count, tokens) for name in systems}, first


def vector_check(ours: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    """How far ladle's vectors are from transformers': the largest relative error of a vector (norm of the
    difference over the reference's norm) and the smallest cosine similarity."""
    errors = (ours - reference).norm(dim=1) / reference.norm(dim=1)
    cosines = F.cosine_similarity(ours, reference, dim=1)
    return {"max_relative_error": float(errors.max()), "min_cosine": round(float(cosines.min()), 6)}


def _engine_config(args: argparse.Namespace, quantization: str) -> Any:
    from engine_server.config import EngineConfig, SchedulerConfig

    return EngineConfig(
        model=args.model,
        device=args.device,
        quantization=quantization,  # type: ignore[arg-type]
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens),
    )


def run_offline(args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """The throughput part: every ladle path and transformers on the same runs' inputs."""
    runs = [make_inputs(args.num_inputs, args.input_len, vocab_size, args.seed, f"run{r}") for r in range(args.repeats)]
    warmup = make_inputs(4, args.input_len, vocab_size, args.seed, "warmup")
    with contextlib.ExitStack() as stack:
        built = {f"ladle_{q}": ladle_embedder(stack, args, q) for q in args.quantization}
        if not args.skip_hf:
            built["hf"] = hf_embedder(args)
        figures, vectors = time_systems({name: embed for name, (embed, _) in built.items()}, runs, warmup)
    systems = {name: {**figures[name], **facts} for name, (_, facts) in built.items()}
    for name in systems:
        if name != "hf" and "hf" in vectors:
            systems[name]["vs_hf"] = vector_check(vectors[name], vectors["hf"])
        print(f"{name}: {systems[name]}", flush=True)
    hf_rate = systems.get("hf", {}).get("inputs_per_s")
    return {
        "systems": systems,
        "ratio_vs_hf": {
            name: round(s["inputs_per_s"] / hf_rate, 3) for name, s in systems.items() if name != "hf" and hf_rate
        },
    }


# -- mixed load --------------------------------------------------------------------------------------------


@dataclass
class Tracked:
    """One request of a mixed-load run, and what the driver saw of it (times from the run's start, seconds)."""

    request: Any  # engine_server.core.request.Request
    kind: str  # "generate" or "embed"
    first_step: float | None = None  # the start of the first step that computed any of its tokens
    first_token: float | None = None
    last_token: float | None = None
    max_token_gap: float = 0.0
    tokens: int = 0
    finished: float | None = None

    def observe(self, step_start: float, step_end: float) -> None:
        """Update from the request's state after a step that ran from `step_start` to `step_end`."""
        request = self.request
        if self.first_step is None and (request.num_computed_tokens > 0 or request.status.is_finished):
            self.first_step = step_start
        if request.num_output_tokens > self.tokens:
            if self.last_token is not None:
                self.max_token_gap = max(self.max_token_gap, step_end - self.last_token)
            self.first_token = step_end if self.first_token is None else self.first_token
            self.last_token, self.tokens = step_end, request.num_output_tokens
        if request.status.is_finished:
            self.finished = step_end


def mixed_requests(llm: Any, args: argparse.Namespace, label: str, generate: bool, embed: bool) -> list[Tracked]:
    """The run's requests in queue order: pooling inputs, with the generations spread evenly among them."""
    from engine_server import SamplingParams
    from engine_server.core.request import Priority
    from engine_server.pooling.requests import pooling_requests

    vocab = llm.core.model_config.vocab_size
    priority = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}
    params = SamplingParams(temperature=0.0, max_tokens=args.mixed_output_len, ignore_eos=True)
    generations: list[Tracked] = []
    if generate:
        prompts = make_inputs(args.mixed_generations, args.mixed_prompt_len, vocab, args.seed, f"{label}/generate")
        for i, prompt in enumerate(prompts):
            (request,) = llm.inputs.make_requests(f"{label}-g{i}", prompt, params, priority[args.generate_priority])
            request.final_only = True  # as LLM.generate sets it: no per-step output objects
            generations.append(Tracked(request, "generate"))
    poolings: list[Tracked] = []
    if embed:
        inputs = make_inputs(args.mixed_inputs, args.input_len, vocab, args.seed, f"{label}/embed")
        requests = pooling_requests(
            f"{label}-e", inputs, llm.pooling.params(), llm.core.max_model_len, priority[args.embed_priority]
        )
        poolings = [Tracked(request, "embed") for request in requests]
    every = max(1, len(poolings) // max(1, len(generations)))
    queue = list(poolings)
    for i, tracked in enumerate(generations):
        queue.insert(i * (every + 1), tracked)
    return queue


def drive(core: Any, tracked: list[Tracked]) -> int:
    """Queue every request at once and step the core until all have finished; the number of steps."""
    start = time.perf_counter()
    for item in tracked:
        item.request.arrival_time = time.monotonic()
        core.add_request(item.request)
    steps = 0
    while core.has_unfinished():
        step_start = time.perf_counter() - start
        core.step()
        steps += 1
        step_end = time.perf_counter() - start
        for item in tracked:
            if item.finished is None:
                item.observe(step_start, step_end)
    return steps


def summarize(tracked: list[Tracked], kind: str, output_len: int) -> dict[str, Any]:
    """One kind's figures in a run: wall time to its last finish, rates, waits before the first step."""
    items = [t for t in tracked if t.kind == kind]
    wall = max(t.finished or 0.0 for t in items)
    waits = [t.first_step if t.first_step is not None else wall for t in items]
    figures: dict[str, Any] = {
        "requests": len(items), "wall_s": round(wall, 3),
        "max_wait_before_first_step_s": round(max(waits), 3), "median_wait_before_first_step_s": round(
            statistics.median(waits), 3),
    }  # fmt: skip
    if kind == "embed":
        tokens = sum(t.request.num_prompt_tokens for t in items)
        figures["all_finished"] = all(t.request.status.value == "stop" for t in items)
        figures.update(inputs_per_s=round(len(items) / wall, 2), tokens_per_s=round(tokens / wall, 1))
    else:
        figures["all_finished"] = all(t.tokens == output_len for t in items)
        figures.update(
            output_tok_per_s=round(sum(t.tokens for t in items) / wall, 1),
            max_ttft_s=round(max(t.first_token or wall for t in items), 3),
            max_token_gap_s=round(max(t.max_token_gap for t in items), 3),
        )
    return figures


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over runs (booleans: all of them)."""
    return {
        key: all(run[key] for run in runs) if isinstance(value, bool) else statistics.median(run[key] for run in runs)
        for key, value in runs[0].items()
    }


def run_mixed(args: argparse.Namespace) -> dict[str, Any]:
    """The mixed-load part on an engine of its own (`--mixed-quantization`)."""
    from engine_server import LLM

    with LLM(config=_engine_config(args, args.mixed_quantization)) as llm:
        return measure_mixed(llm, args)


def measure_mixed(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Generations and pooling requests together, and each kind alone, `--repeats` times on `llm`'s core."""
    scenarios = {"mixed": (True, True), "generate_alone": (True, False), "embed_alone": (False, True)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in scenarios}
    drive(llm.core, mixed_requests(llm, args, "warmup", True, True))
    for repeat in range(args.repeats):
        for name, (generate, embed) in scenarios.items():
            tracked = mixed_requests(llm, args, f"{name}{repeat}", generate, embed)
            steps = drive(llm.core, tracked)
            kinds = ["generate"] * generate + ["embed"] * embed
            run: dict[str, Any] = {kind: summarize(tracked, kind, args.mixed_output_len) for kind in kinds}
            runs[name].append({**run, "steps": steps})
            print(f"mixed load, {name}: {run}", flush=True)
    result: dict[str, Any] = {"quantization": llm.core.runner.quantization}
    for name, scenario_runs in runs.items():
        kinds = [kind for kind in scenario_runs[0] if kind != "steps"]
        result[name] = {kind: _medians([run[kind] for run in scenario_runs]) for kind in kinds}
        result[name]["runs"] = scenario_runs
    mixed, gen_alone, embed_alone = result["mixed"], result["generate_alone"], result["embed_alone"]
    result["generate_wall_mixed_over_alone"] = round(mixed["generate"]["wall_s"] / gen_alone["generate"]["wall_s"], 3)
    result["embed_rate_mixed_over_alone"] = round(
        mixed["embed"]["inputs_per_s"] / embed_alone["embed"]["inputs_per_s"], 3
    )
    return result


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from engine_server.loader import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    vocab_size = resolve_model(args.model).config.vocab_size
    result: dict[str, Any] = {
        "benchmark": "embed", "time": utc_timestamp(), "commit": git_commit(), "command": args.command_line,
        "machine": {
            "platform": platform.platform(), "cpu_model": cpu_model_name(), "cpu_count": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
        },
        "workload": {
            "model": args.model, "num_inputs": args.num_inputs, "input_len": args.input_len, "seed": args.seed,
            "repeats": args.repeats, "threads": torch.get_num_threads(), "hf_batch_size": args.hf_batch_size,
            "max_num_batched_tokens": args.max_num_batched_tokens, "pooling": "last token, L2-normalized",
        },
    }  # fmt: skip
    load_before = [round(x, 2) for x in os.getloadavg()]  # a shared machine's neighbours move the figures
    result.update(run_offline(args, vocab_size))
    if not args.skip_mixed:
        result["mixed_load"] = {
            "generations": args.mixed_generations, "prompt_len": args.mixed_prompt_len,
            "output_len": args.mixed_output_len, "inputs": args.mixed_inputs, "input_len": args.input_len,
            "generate_priority": args.generate_priority, "embed_priority": args.embed_priority,
            "arrival": "all queued at once, generations spread evenly among the pooling inputs",
            **run_mixed(args),
        }  # fmt: skip
    result["machine"]["load_average"] = {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(result, indent=2))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ladle bench embed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    add = parser.add_argument
    add("--num-inputs", type=int, default=256, help="inputs per timed run")
    add("--input-len", type=int, default=128, help="tokens per input (random ids)")
    add("--seed", type=int, default=0)
    add("--quantization", nargs="+", default=["none", "auto"], choices=QUANTIZATION_MODES, help="ladle's paths")
    add("--hf-batch-size", type=int, default=32, help="inputs per transformers forward")
    add("--skip-hf", action="store_true", help="leave transformers out (no ratio, no vector check)")
    add("--max-num-batched-tokens", type=int, default=2048, help="ladle's token budget per step")
    add("--repeats", type=int, default=3, help="timed runs per system (and mixed-load scenario); medians reported")
    add("--threads", type=int, default=0, help="torch CPU threads of this process (0: torch's default)")
    add("--skip-mixed", action="store_true", help="leave the mixed-load part out")
    add("--mixed-quantization", default="auto", choices=QUANTIZATION_MODES, help="the mixed-load engine's weights")
    add("--mixed-generations", type=int, default=8)
    add("--mixed-prompt-len", type=int, default=32)
    add("--mixed-output-len", type=int, default=64)
    add("--mixed-inputs", type=int, default=32, help="pooling requests in a mixed-load run")
    add("--generate-priority", default="interactive", choices=PRIORITIES)
    add("--embed-priority", default="interactive", choices=PRIORITIES)
    add("--out", type=Path, help="append the JSON result to this .jsonl file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = "ladle bench embed " + " ".join(argv or [])
    result = run_benchmark(args)
    append_result(args.out, result)
    return 0
