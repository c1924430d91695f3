"""Per-step host work of the engine, measured on a null device (`ladle bench host`, issue 31).

The engine is built as usual (a `dummy:` model, float weights) and its runner then runs on the null device of
`benchmarks.null_device`: the forward and the sampler's math cost nothing, so a step's time is the host's
scheduling, KV blocks, prefix-cache bookkeeping, input and sampling-metadata building, output handling,
detokenization and stop checks. B requests of `--input-len` random token ids each generate `--output-len`
tokens (ignore_eos); `--sampling` is greedy, sampled (temperature 0.8, top_p 0.95) or seeded (also seed=i).

Paths:
- offline: `LLM.generate` of the B prompts.
- grpc: the engine server (servicer on this process's event loop, the core on its own thread, as in
  `ladle engine`) and B concurrent `Stream` calls over loopback from a client in another process (this module,
  run with --stream-client). The core's steps are held until all B requests have arrived (`StartGate`). The
  clients' own view is reported too (`client`: output tok/s and ms per step from the first token to the last):
  the core may run ahead of the event loop that turns its outputs into messages.

Reported: ms per decode step in the steady state where all B requests decode (`benchmarks.step_probes`),
in total and by phase: scheduler.schedule, runner.launch (input building and the null forward), runner.collect
(with the device's time), scheduler.update_from_output, and the rest (the core's output handling, the caller's
loop, over gRPC the engine loop and the GIL shared with the event loop); the mean and the median step, and the
garbage collection inside them (one full collection is ~0.1 s: it moves the mean of a 128-step run by ~0.8 ms,
so compare medians or use --repeats and longer runs). `--device-ms D`: every step occupies
the device D ms, which the host waits for in collect; with `--async-scheduling on` a step should cost about
max(host, D), off host + D.
`--count-ops`: with the real model's logits and the real sampler (the forward's own ops not counted), the torch
ops dispatched per decode step by phase: what a GPU step launches eagerly around its captured graph.

One JSON object per (path, B, device_ms, sampling) is appended to `--out`.

    ladle bench host --batch-sizes 1,64,256,512 --out /tmp/host.jsonl
    ladle bench host --paths offline --batch-sizes 256 --device-ms 0,3 --async-scheduling on
    ladle bench host --paths offline --batch-sizes 1,256 --sampling greedy,sampled,seeded --count-ops
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from benchmarks.common import append_result, cpu_model_name, git_commit, utc_timestamp
from benchmarks.null_device import DeviceClock, null_device
from benchmarks.offline import make_workload, warmup_prompts
from benchmarks.step_probes import OpCounts, StepRecorder, StepTimes, counting_ops, decode_step_times, wrapped
from engine_server import LLM
from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_server.core.engine_core import CoreOutput, EngineCore
from engine_server.loader import resolve_model
from engine_server.model_loading import resolve_device, resolve_dtype
from engine_server.models import kv_cache_bytes_per_block
from engine_server.sampling_params import SamplingParams
from engine_server.server.server import EngineServer, ServerConfig
from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2

SAMPLING_KINDS = ("greedy", "sampled", "seeded")
SAMPLED_TEMPERATURE, SAMPLED_TOP_P = 0.8, 0.95
COUNT_OUTPUT_LEN = 8  # tokens per request when counting ops: a few decode steps, each counted the same
CLIENT_TIMEOUT_S = 600.0
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Run:
    """One measured configuration; each gives one result object."""

    path: str
    batch_size: int
    device_ms: float
    sampling: str


def sampling_params(kind: str, count: int, max_tokens: int) -> list[SamplingParams]:
    if kind == "greedy":
        return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * count
    seeded = kind == "seeded"
    return [
        SamplingParams(
            temperature=SAMPLED_TEMPERATURE, top_p=SAMPLED_TOP_P, seed=i if seeded else None,
            max_tokens=max_tokens, ignore_eos=True,
        )
        for i in range(count)
    ]  # fmt: skip


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Seats and a step's token budget for the largest batch's prefill in one step, and KV blocks for it all."""
    block_size = CacheConfig().block_size
    max_batch = max(args.batch_sizes)
    max_model_len = args.input_len + args.output_len + block_size
    blocks_per_seq = -(-max_model_len // block_size) + 1
    dtype = resolve_dtype("auto", resolve_device("cpu"))
    per_block = kv_cache_bytes_per_block(resolve_model(args.model).config, block_size, dtype)
    return EngineConfig(
        model=args.model,
        device="cpu",
        quantization="none",
        async_scheduling=args.async_scheduling == "on",
        cache=CacheConfig(memory_bytes=per_block * blocks_per_seq * (max_batch + 2)),
        scheduler=SchedulerConfig(
            max_num_seqs=max_batch,
            max_num_batched_tokens=max(2048, max_batch * args.input_len),
            max_model_len=max_model_len,
        ),
    )


# -- offline ---------------------------------------------------------------------------------------------------


def time_offline(llm: LLM, run: Run, args: argparse.Namespace, seed: int) -> StepTimes:
    """One `generate` of the run's workload on the null device; its decode steps' times."""
    prompts = make_workload(run.batch_size, args.input_len, args.vocab_limit, seed)
    params = sampling_params(run.sampling, run.batch_size, args.output_len)
    recorder = StepRecorder(llm.core)
    clock = DeviceClock(run.device_ms / 1e3) if run.device_ms > 0 else None  # no wrapper to time without one
    with null_device(llm.core.runner, clock), recorder.attached():
        llm.generate(prompts, params, use_tqdm=False)
    return _steady(decode_step_times(recorder.take(), run.batch_size), run)


def count_offline_ops(
    llm: LLM, batch_size: int, sampling: str, args: argparse.Namespace, seed: int, real_forward: bool = False
) -> OpCounts:
    """Ops per decode step with the real model's logits and the real sampler (see `counting_ops`)."""
    prompts = make_workload(batch_size, args.input_len, args.vocab_limit, seed)
    params = sampling_params(sampling, batch_size, COUNT_OUTPUT_LEN)
    with counting_ops(llm.core, real_forward) as counter:
        llm.generate(prompts, params, use_tqdm=False)
    counts = counter.decode_counts(batch_size)
    if counts is None:
        raise RuntimeError(f"no two decode steps of all {batch_size} requests were counted")
    return counts


def offline_results(args: argparse.Namespace, runs: list[Run], seeds: Iterator[int]) -> list[dict[str, Any]]:
    llm = LLM(config=engine_config(args))
    warmup = warmup_prompts(make_workload(2, args.input_len, args.vocab_limit, next(seeds)))
    with null_device(llm.core.runner):  # the first steps pay for lazy set-up
        llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    results = []
    print(TABLE_HEADER, flush=True)
    for run in runs:
        repeats = [time_offline(llm, run, args, next(seeds)) for _ in range(args.repeats)]
        results.append(_record(args, run, repeats))
        print(_row(results[-1]), flush=True)
    if args.count_ops:
        for batch_size, sampling in sorted({(r.batch_size, r.sampling) for r in runs}):
            counts = count_offline_ops(llm, batch_size, sampling, args, next(seeds))
            for result in results:
                if (result["batch_size"], result["sampling"]) == (batch_size, sampling):
                    result.update(
                        ops_per_step=counts.ops_per_step, launching_ops_per_step=counts.launching_ops_per_step,
                        ops_by_phase=counts.ops_by_phase, ops_by_name=counts.ops_by_name,
                        ops_counted_steps=counts.steps,
                    )  # fmt: skip
            print(
                f"ops  B={batch_size:<4} {sampling:<8} {counts.ops_per_step:>7.1f}/step "
                f"({counts.launching_ops_per_step:.1f} launching)  {counts.ops_by_phase}"
            )
    return results


# -- gRPC --------------------------------------------------------------------------------------------------------


async def grpc_results(args: argparse.Namespace, runs: list[Run], seeds: Iterator[int]) -> list[dict[str, Any]]:
    """`ladle engine`'s own server on the null device, in this process; one client process per repeat of each
    run. The stand-ins go in through the server's `prepare_core` seam, before the core's loop starts."""
    clock = DeviceClock()
    probes: list[tuple[StepRecorder, StartGate]] = []
    results = []
    with contextlib.ExitStack() as stack:

        def prepare(core: EngineCore) -> None:  # on the core's thread, which alone touches it afterwards
            recorder, gate = StepRecorder(core), StartGate(core)
            stack.enter_context(null_device(core.runner, clock))
            stack.enter_context(recorder.attached())
            stack.enter_context(wrapped(core, "step", gate.wrap))
            probes.append((recorder, gate))

        server = EngineServer(ServerConfig(engine=engine_config(args), port=0), prepare_core=prepare)
        address = await server.start()
        try:
            await server.load()  # warms up and freezes the start-up heap, as `ladle engine` does
            (recorder, gate), = probes
            print(TABLE_HEADER, flush=True)
            for run in runs:
                clock.step_s = run.device_ms / 1e3  # the core is idle between runs
                repeats, clients = [], []
                for _ in range(args.repeats):
                    recorder.take()
                    gate.expected = run.batch_size
                    clients.append(await _client_process(address, run, args, next(seeds)))
                    repeats.append(_steady(decode_step_times(recorder.take(), run.batch_size), run))
                results.append(_record(args, run, repeats, client=clients[_median_index(repeats)]))
                print(_row(results[-1]), flush=True)
        finally:
            server.stop_requested.set()
            await server.drain()
    return results


class StartGate:
    """Holds a core's steps until `expected` requests have arrived, then lets every step through.

    Over gRPC the B streams reach the core one by one, and on the null device a request's whole life is shorter
    than the arrival of B streams: without the gate, B requests would never decode together. While it holds,
    `step()` returns nothing at once, so the engine loop goes on taking in the arriving requests.
    """

    HOLD_S = 0.001

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.expected = 0  # 0: open

    def wrap(self, step: Callable[[], list[CoreOutput]]) -> Callable[[], list[CoreOutput]]:
        def gated() -> list[CoreOutput]:
            if self.expected:
                scheduler = self.core.scheduler
                if scheduler.num_waiting + scheduler.num_running < self.expected:
                    time.sleep(self.HOLD_S)
                    return []
                self.expected = 0
            return step()

        return gated


async def _client_process(address: str, run: Run, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    spec = {
        "address": address, "batch_size": run.batch_size, "input_len": args.input_len,
        "output_len": args.output_len, "sampling": run.sampling, "vocab_limit": args.vocab_limit, "seed": seed,
    }  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.host", "--stream-client", json.dumps(spec),
        stdout=subprocess.PIPE, cwd=REPO_ROOT, env={**os.environ, "NO_PROXY": "*"},
    )  # fmt: skip
    try:
        stdout, _ = await asyncio.wait_for(process.communicate(), CLIENT_TIMEOUT_S)
    finally:
        if process.returncode is None:
            process.kill()
    if process.returncode != 0:
        raise RuntimeError(f"the stream client exited with status {process.returncode}")
    result: dict[str, Any] = json.loads(stdout.decode().strip().splitlines()[-1])
    return result


async def stream_clients(spec: dict[str, Any]) -> dict[str, Any]:
    """The client half: B concurrent Streams on one channel. Output tok/s counts from the first token of any
    stream to the end of the last (the engine holds the requests until all have arrived, see StartGate)."""
    prompts = make_workload(spec["batch_size"], spec["input_len"], spec["vocab_limit"], spec["seed"])
    greedy, seeded = spec["sampling"] == "greedy", spec["sampling"] == "seeded"

    def request(i: int, ids: list[int]) -> engine_pb2.StreamRequest:
        sampling = types_pb2.SamplingParams(
            max_tokens=spec["output_len"], ignore_eos=True, temperature=0.0 if greedy else SAMPLED_TEMPERATURE,
            top_p=1.0 if greedy else SAMPLED_TOP_P, seed=i if seeded else None,
        )  # fmt: skip
        return engine_pb2.StreamRequest(input=types_pb2.Input(token_ids=types_pb2.TokenIds(ids=ids)), sampling=sampling)

    requests = [request(i, ids) for i, ids in enumerate(prompts)]
    first_token_at: list[float] = []
    async with grpc.aio.insecure_channel(spec["address"]) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        await asyncio.wait_for(channel.channel_ready(), CLIENT_TIMEOUT_S)

        async def one(message: engine_pb2.StreamRequest) -> int:
            tokens = 0
            async for response in stub.Stream(message):
                if not tokens:
                    first_token_at.append(time.perf_counter())
                tokens += sum(len(choice.token_ids) for choice in response.choices)
            return tokens

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(message) for message in requests))
        ended = time.perf_counter()
    tokens, streaming = sum(counts), ended - min(first_token_at)
    return {
        "output_tokens": tokens, "seconds": round(ended - started, 4), "streaming_seconds": round(streaming, 4),
        "output_tok_per_s": round(tokens / streaming, 1),
        # A step as the clients see it: the engine may run ahead of the event loop that sends its outputs.
        "ms_per_step": round(1e3 * streaming / max(1, spec["output_len"] - 1), 4),
    }  # fmt: skip


# -- results -----------------------------------------------------------------------------------------------------


def _steady(times: StepTimes | None, run: Run) -> StepTimes:
    if times is None:
        raise RuntimeError(f"{run}: no two decode steps of all {run.batch_size} requests; raise --output-len")
    return times


def _median_index(repeats: Sequence[StepTimes]) -> int:
    order = sorted(range(len(repeats)), key=lambda i: repeats[i].ms_per_step)
    return order[len(order) // 2]


def _record(
    args: argparse.Namespace, run: Run, repeats: Sequence[StepTimes], client: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The result object of one run: its median repeat (by ms per step), every repeat's ms per step."""
    times = repeats[_median_index(repeats)]
    record: dict[str, Any] = {
        "benchmark": "host",
        "path": run.path,
        "batch_size": run.batch_size,
        "device_ms": run.device_ms,
        "async_scheduling": args.async_scheduling == "on",
        "sampling": run.sampling,
        "ms_per_step": times.ms_per_step,
        "ms_per_step_p50": times.ms_per_step_p50,
        "decode_tok_per_s": round(run.batch_size * 1e3 / times.ms_per_step, 1),
        "phases_ms": times.phases_ms,
        "gc_ms_per_step": times.gc_ms,
        "ops_per_step": None,
        "launching_ops_per_step": None,
        "ops_by_phase": None,
        "steps": times.steps,
        "runs_ms_per_step": [r.ms_per_step for r in repeats],
        "client": client,
        "model": args.model,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "commit": git_commit(),
        "cpu_model": cpu_model_name(),
        "time": utc_timestamp(),
        "command": args.command_line,
    }
    return record


TABLE_HEADER = (
    "path     B      D    sampling   ms/step   p50    gc  [schedule  launch collect  update    rest]  (ms per step)"
)


def _row(result: dict[str, Any]) -> str:
    phases = " ".join(f"{v:7.3f}" for v in result["phases_ms"].values())
    client = result["client"]
    tail = f"  clients: {client['ms_per_step']:.3f} ms/step, {client['output_tok_per_s']:.0f} tok/s" if client else ""
    return (
        f"{result['path']:<8} B={result['batch_size']:<4} D={result['device_ms']:<4g} {result['sampling']:<8}"
        f" {result['ms_per_step']:8.3f} {result['ms_per_step_p50']:7.3f} {result['gc_ms_per_step']:5.2f}"
        f"  [{phases}]{tail}"
    )


def build_parser() -> argparse.ArgumentParser:
    def numbers(kind: type) -> Any:
        return lambda text: [kind(part) for part in text.split(",") if part]

    def names(choices: Sequence[str]) -> Any:
        def parse(text: str) -> list[str]:
            items = [part for part in text.split(",") if part]
            if not items or any(item not in choices for item in items):
                raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices)}")
            return items

        return parse

    parser = argparse.ArgumentParser(
        prog="ladle bench host", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--paths", type=names(("offline", "grpc")), default=["offline", "grpc"])
    parser.add_argument("--batch-sizes", type=numbers(int), default=[1, 64, 256, 512])
    parser.add_argument("--device-ms", type=numbers(float), default=[0.0], help="device time per step (a list)")
    parser.add_argument("--sampling", type=names(SAMPLING_KINDS), default=["greedy"], help="a list")
    parser.add_argument("--async-scheduling", choices=["on", "off"], default="off")
    parser.add_argument("--count-ops", action="store_true", help="also count torch ops per decode step (offline)")
    parser.add_argument("--model", default="dummy:smollm2-135m", help="only its shape and tokenizer matter")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration; the median is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="append one JSON object per result to this .jsonl file")
    parser.add_argument("--stream-client", help=argparse.SUPPRESS)  # this module as the gRPC client process
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.stream_client:
        print(json.dumps(asyncio.run(stream_clients(json.loads(args.stream_client)))), flush=True)
        return 0
    args.command_line = "ladle bench host " + " ".join(argv if argv is not None else sys.argv[1:])
    args.vocab_limit = resolve_model(args.model).config.vocab_size
    seeds = itertools.count(args.seed)
    results: list[dict[str, Any]] = []
    for path in args.paths:
        runs = [Run(path, b, d, s) for b in args.batch_sizes for s in args.sampling for d in args.device_ms]
        if path == "offline":
            results += offline_results(args, runs, seeds)
        else:
            results += asyncio.run(grpc_results(args, runs, seeds))
    for result in results:
        append_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
