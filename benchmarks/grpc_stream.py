"""Serving overhead: output tok/s through gRPC (concurrent Streams to a `ladle engine` process) vs offline.

Workload (the same token ids for both): `--num-seqs` random-token prompts of `--input-len` tokens,
`--output-len` tokens each, ignore_eos, greedy. The gRPC side starts `ladle engine` with the same scheduler
and KV settings as the offline engine, warms both up the same way, then opens every Stream at once and times
until the last one ends. The ratio grpc / offline shows what the RPC layer costs the step loop (target >= 0.9);
the offline engine is timed both on the main thread and on a worker thread, and the faster one is the baseline.

    python -m benchmarks.grpc_stream --num-seqs 64 --input-len 128 --output-len 128 --out benchmarks/results/grpc.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import add_workload_arguments, append_result
from benchmarks.offline import Workload, make_workload

WARMUP_TOKENS = 4


def _start_engine(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    command = [
        sys.executable, "-m", "ladle_cli", "engine", "--model", args.model, "--device", args.device,
        "--port", "0", "--max-num-seqs", str(args.num_seqs), "--kv-cache-mib", str(args.kv_cache_mib),
    ]
    env = {**os.environ, "LADLE_LOG_LEVEL": "WARNING"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    line = process.stdout.readline()
    if " on " not in line:
        process.kill()
        raise RuntimeError(f"ladle engine did not start: {line!r}")
    return process, line.rsplit(" on ", 1)[1].strip()


def _timing(tokens: int, seconds: float) -> dict[str, Any]:
    return {"output_tokens": tokens, "seconds": round(seconds, 3), "output_tok_per_s": round(tokens / seconds, 2)}


async def _stream_all(address: str, prompts: Workload, output_len: int) -> dict[str, Any]:
    """Warm up as the offline run does, then open one Stream per prompt at once and time them all."""
    from ladle.client import AsyncEngineClient
    from ladle.v1 import engine_pb2, types_pb2

    def request(ids: list[int], max_tokens: int) -> engine_pb2.StreamRequest:
        sampling = types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return engine_pb2.StreamRequest(input=types_pb2.Input(token_ids=types_pb2.TokenIds(ids=ids)), sampling=sampling)

    async with AsyncEngineClient(address, timeout=3600) as client:
        await client.wait_until_serving(600)

        async def one(ids: list[int], max_tokens: int) -> int:
            return sum([len(c.token_ids) async for r in client.stream(request(ids, max_tokens)) for c in r.choices])

        await asyncio.gather(*(one(ids, WARMUP_TOKENS) for ids in prompts[:2]))
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(ids, output_len) for ids in prompts))
        return _timing(sum(counts), time.perf_counter() - start)


def _offline_run(llm: Any, prompts: Workload, output_len: int, on_worker_thread: bool) -> dict[str, Any]:
    """Warm up (the two first prompts, as over gRPC), then time one `generate` of the whole workload."""
    from engine_server import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], dataclasses.replace(params, max_tokens=WARMUP_TOKENS), use_tqdm=False)
    # Both offline runs of a repeat share its prompts: without this the second one would find every prompt
    # in the prefix cache and skip its prefill.
    llm.core.scheduler.kv_cache.reset_prefix_cache()
    timing: dict[str, Any] = {}

    def run() -> None:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        timing.update(_timing(sum(len(r.choices[0].token_ids) for r in outputs), time.perf_counter() - start))

    if on_worker_thread:
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    else:
        run()
    return timing


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Interleave the systems, each repeat on fresh prompts (so no run hits another's prefix cache), so that a
    CPU shared with other work slows them alike. The offline engine runs on the main thread (as `LLM` users call
    it) and on a worker thread (where the engine runs its core): on a busy CPU the two differ a lot (OpenMP's
    spin-waiting), and the faster one is the baseline.
    """
    from engine_server import LLM
    from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig

    process, address = _start_engine(args)
    try:
        llm = LLM(config=EngineConfig(
            model=args.model, device=args.device,
            cache=CacheConfig(memory_bytes=args.kv_cache_mib * 1024**2),
            scheduler=SchedulerConfig(max_num_seqs=args.num_seqs),
        ))
        runs: list[dict[str, Any]] = []
        for repeat in range(args.repeats):
            prompts = make_workload(args.num_seqs, args.input_len, 49152, args.seed + repeat)
            run: dict[str, Any] = {
                "load_avg_1m": os.getloadavg()[0],
                "grpc_stream": asyncio.run(_stream_all(address, prompts, args.output_len)),
                "offline_worker_thread": _offline_run(llm, prompts, args.output_len, on_worker_thread=True),
                "offline_main_thread": _offline_run(llm, prompts, args.output_len, on_worker_thread=False),
            }
            best = max(run[k]["output_tok_per_s"] for k in ("offline_worker_thread", "offline_main_thread"))
            run["ratio"] = round(run["grpc_stream"]["output_tok_per_s"] / best, 3)
            print(f"repeat {repeat}: {json.dumps(run)}", flush=True)
            runs.append(run)
    finally:
        process.terminate()  # SIGTERM: the engine drains (nothing is in flight) and exits
        process.wait(120)
    result = {
        "benchmark": "grpc_stream",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": args.command_line,
        "workload": {"model": args.model, "device": args.device, "num_seqs": args.num_seqs,
                     "input_len": args.input_len, "output_len": args.output_len, "ignore_eos": True,
                     "greedy": True, "seed": args.seed},
        "machine": {"cpu_count": os.cpu_count(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")},
        "runs": runs,
        "ratio_grpc_vs_offline": statistics.median(r["ratio"] for r in runs),  # median over repeats
    }
    print(json.dumps(result, indent=2))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpc_stream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--kv-cache-mib", type=int, default=2048, help="as the offline engine's default")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats, each on fresh prompts")
    parser.add_argument("--out", type=Path, help="append the JSON result to this .jsonl file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = "python -m benchmarks.grpc_stream " + " ".join(argv if argv is not None else sys.argv[1:])
    result = run_benchmark(args)
    append_result(args.out, result)
    return 0 if result["ratio_grpc_vs_offline"] >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
