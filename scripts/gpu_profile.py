"""Where a `ladle bench gpu` run's time goes: the engine step's host phases, decode vs mixed steps, and kernels.

Run on the GPU machine in `scripts/gpu_run.sh`'s environment (PYTHONPATH with /tmp/site), e.g.
    python3 scripts/gpu_profile.py --model dummy:qwen2.5-0.5b --max-num-batched-tokens 2048 8192 --kernels
For each token budget: one warm-up, then the nano-vllm workload with every phase timed (`time.perf_counter`
around the scheduler's and runner's calls), then optionally once more under torch.profiler for the kernel table.
With `--tensor-parallel-size N` (a host with N GPUs) the profile is rank 0's, and the kernel run also gives the
NCCL kernels' share of rank 0's GPU time: the all-reduces' cost, inside the decode graphs too.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu import LadleRunner, Workload, build_parser, nano_vllm_workload


def _timed(totals: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def profile(model: str, budget: int, kernels: bool, eager: bool, tensor_parallel_size: int) -> None:
    argv = ["--models", model, "--kv-cache-mib", "16384", "--max-num-batched-tokens", str(budget)]
    argv += ["--enforce-eager"] if eager else []
    argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    ladle = LadleRunner(model, "none", build_parser().parse_args(argv))
    workload = nano_vllm_workload(256, 100, 1024, 0)
    ladle.run(Workload(workload.prompts[:4], [8] * 4))
    core = ladle.llm.core
    totals: dict[str, float] = collections.defaultdict(float)
    kinds: collections.Counter[str] = collections.Counter()
    kind_seconds: dict[str, float] = collections.defaultdict(float)
    schedule = core.scheduler.schedule

    def schedule_and_classify() -> Any:
        out = schedule()
        kind = "empty" if not out.scheduled else "decode" if all(
            s.num_new_tokens == 1 for s in out.scheduled) else "mixed"
        kinds[kind] += 1
        core._profile_kind = kind  # type: ignore[attr-defined]
        return out

    core.scheduler.schedule = _timed(totals, "schedule", schedule_and_classify)  # type: ignore[method-assign]
    core.runner.launch = _timed(totals, "launch", core.runner.launch)  # type: ignore[method-assign]
    core.runner.collect = _timed(totals, "collect (waits on the device)", core.runner.collect)  # type: ignore
    core.scheduler.update_from_output = _timed(  # type: ignore[method-assign]
        totals, "update_from_output", core.scheduler.update_from_output)
    step = core.step

    def step_by_kind() -> Any:
        start = time.perf_counter()
        out = step()
        kind_seconds[core._profile_kind] += time.perf_counter() - start  # type: ignore[attr-defined]
        return out

    core.step = _timed(totals, "core.step", step_by_kind)  # type: ignore[method-assign]
    seconds = ladle.run(workload)
    print(f"\n== {model} max_num_batched_tokens={budget} eager={eager} tp={tensor_parallel_size}: {seconds:.2f} s, "
          f"{workload.output_tokens / seconds:,.0f} output tok/s; steps {dict(kinds)}")
    for name, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:34s} {total:7.2f} s")
    print(f"  outside core.step (detokenize, outputs) {seconds - totals['core.step']:7.2f} s")
    for kind, total in kind_seconds.items():
        print(f"  {kind} steps: {kinds[kind]} in {total:.2f} s, {total / max(kinds[kind], 1) * 1000:.2f} ms each")
    if kernels:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            ladle.run(workload)
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
        total = sum(event.self_device_time_total for event in averages)
        nccl = sum(event.self_device_time_total for event in averages if "nccl" in event.key.lower())
        share = nccl / max(total, 1)
        print(f"  NCCL kernels: {nccl / 1e6:.3f} s of rank 0's {total / 1e6:.3f} s of GPU time ({share:.1%})")
    ladle.llm.close()
    del ladle
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="dummy:qwen2.5-0.5b")
    parser.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[8192],
                        help="token budgets, one profile each (default: ladle bench gpu's)")
    parser.add_argument("--kernels", action="store_true", help="also a torch.profiler run (CUDA kernels table)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="split over this many GPUs")
    args = parser.parse_args()
    for budget in args.max_num_batched_tokens:
        profile(args.model, budget, args.kernels, args.enforce_eager, args.tensor_parallel_size)


if __name__ == "__main__":
    main()
