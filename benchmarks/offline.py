"""Offline throughput: ladle vs Hugging Face transformers on the same model and the same token ids, one run.

Workload: `--num-seqs` random-token prompts of `--input-len` tokens, `--output-len` tokens each, ignore_eos,
greedy. Systems: ladle's offline LLM (weights as `--quantization` says), transformers' static `generate` (the
whole batch at once) and its continuous `generate_batch`, and, for a GGUF model when llama-cpp-python is
installed (it is not a dependency), llama.cpp on the same file and token ids, one sequence after another (its
Python API decodes one sequence at a time). Each is timed after a warm-up on other prompts, and no system reuses
a prompt it has seen (ladle runs with its prefix cache off, llama.cpp's context is reset per prompt), so every
repeat prefills again; output tok/s =
generated tokens / wall seconds, prefill included. `--float-too` also runs ladle on its float weights
(`--quantization none`) in the same run, as `ladle_float`. With `--output-len 1` the run is a prompt's prefill:
each system also reports `prefill_tok_per_s` (prompt tokens / wall seconds).
Results go to stdout and, with `--out`, are appended as one JSON object per run.

    ladle bench offline --num-seqs 64 --input-len 128 --output-len 128 --out benchmarks/results/cpu.jsonl
    ladle bench offline --model q4_k_m.gguf --num-seqs 1 --input-len 7000 --output-len 1 --float-too --skip-hf
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.common import (
    add_workload_arguments,
    append_result,
    cpu_model_name,
    git_commit,
    hf_model,
    utc_timestamp,
)
from engine_server.config import QUANTIZATION_MODES

if TYPE_CHECKING:
    from engine_server import LLM

Workload = list[list[int]]


def make_workload(num_seqs: int, input_len: int, vocab_limit: int, seed: int) -> Workload:
    """Random token prompts; ids stay below `vocab_limit` so every preset's vocabulary holds them."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_limit) for _ in range(input_len)] for _ in range(num_seqs)]


def warmup_prompts(prompts: Workload) -> Workload:
    """Two prompts for a warm-up that share no prefix with the workload's: each of its prompts reversed."""
    return [prompt[::-1] for prompt in prompts[:2]]


def _timed(run: Callable[[], int], repeats: int = 1) -> dict[str, Any]:
    """`run` timed `repeats` times: the median run's seconds and rate, and with repeats every run's rate (a shared
    machine's neighbours move single runs by 10-20%)."""
    runs: list[tuple[float, int]] = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run()
        runs.append((time.perf_counter() - start, tokens))
    seconds, tokens = sorted(runs)[len(runs) // 2]
    timed: dict[str, Any] = {
        "output_tokens": tokens, "seconds": round(seconds, 3), "output_tok_per_s": round(tokens / seconds, 2),
    }  # fmt: skip
    if repeats > 1:
        timed["runs_tok_per_s"] = [round(n / t, 2) for t, n in runs]
    return timed


def bench_ladle(
    model: str,
    device: str,
    prompts: Workload,
    output_len: int,
    max_num_seqs: int,
    quantization: str = "none",
    repeats: int = 1,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """ladle's offline LLM on the workload, over a KV cache of `kv_cache_dtype` for sequences of up to
    `max_model_len` tokens (None: the model's context length). Under tensor parallelism the
    result also says how long rank 0 spent inside all-reduces (waiting for the other ranks included) and their
    share of the timed runs' wall time."""
    from engine_server import LLM, SamplingParams
    from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig

    config = EngineConfig(
        model=model,
        device=device,  # type: ignore[arg-type]
        quantization=quantization,  # type: ignore[arg-type]
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(2048, len(prompts[0]) * 4),
                                  max_model_len=max_model_len),
        # A repeat must prefill its prompts again.
        cache=CacheConfig(enable_prefix_caching=False, dtype=kv_cache_dtype),  # type: ignore[arg-type]
        tensor_parallel_size=tensor_parallel_size,
    )
    threads = torch.get_num_threads()  # tensor parallelism shares them out between the ranks; restored after
    with LLM(config=config) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        warmup = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate(warmup_prompts(prompts), warmup, use_tqdm=False)
        stats = llm.core.runner.loaded.tp.stats
        stats.reset()
        wall = 0.0

        def run() -> int:
            nonlocal wall
            started = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            wall += time.perf_counter() - started
            return sum(len(r.choices[0].token_ids) for r in results)

        timed = {**_timed(run, repeats), "quantization": llm.core.runner.quantization}
        if tensor_parallel_size > 1:
            tokens = timed["output_tokens"] * repeats
            calls, nbytes, seconds = stats.total()
            timed["tensor_parallel"] = {
                "size": tensor_parallel_size,
                "cpu_threads_per_rank": torch.get_num_threads(),
                "decode_stack": _has_decode_stack(llm),
                "all_reduce_calls": calls,
                "all_reduce_seconds": round(seconds, 3),
                "all_reduce_share_of_wall": round(seconds / wall, 3),
                "all_reduce_bytes_per_output_token": round(nbytes / tokens),
            }
    torch.set_num_threads(threads)
    return timed


def bench_llama_cpp(gguf: Path, prompts: Workload, output_len: int, threads: int, repeats: int = 1) -> dict[str, Any]:
    """llama.cpp (llama-cpp-python) on the GGUF file: greedy, `output_len` tokens per prompt, eos not checked."""
    from llama_cpp import Llama

    llama = Llama(model_path=str(gguf), n_ctx=len(prompts[0]) + output_len + 8, n_threads=threads,
                  n_threads_batch=threads, n_batch=512, verbose=False)  # fmt: skip

    def decode(prompt: list[int], count: int) -> int:
        produced = 0
        llama.reset()  # else generate keeps the context it shares with the last prompt and skips its prefill
        for _ in llama.generate(prompt, top_k=1, temp=0.0, reset=True):
            produced += 1
            if produced == count:
                break
        return produced

    decode(warmup_prompts(prompts)[0], 4)

    def run() -> int:
        return sum(decode(prompt, output_len) for prompt in prompts)

    return _timed(run, repeats)


def gguf_file(model: str) -> Path | None:
    """The GGUF file behind a model spec, if it has one."""
    from engine_server.loader import resolve_model

    return resolve_model(model).gguf_path if model == "default" or model.endswith(".gguf") else None


def bench_hf_static(hf: Any, prompts: Workload, output_len: int, repeats: int = 1) -> dict[str, Any]:
    device = next(hf.parameters()).device
    input_ids = torch.tensor(prompts, device=device)
    kwargs = {"do_sample": False, "max_new_tokens": output_len, "min_new_tokens": output_len, "pad_token_id": 0}
    with torch.inference_mode():
        hf.generate(input_ids[:2, :16], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})

    def run() -> int:
        with torch.inference_mode():
            out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        return int((out.shape[1] - input_ids.shape[1]) * out.shape[0])

    return _timed(run, repeats)


def bench_hf_continuous(hf: Any, prompts: Workload, output_len: int, repeats: int = 1) -> dict[str, Any]:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0
    )

    def run() -> int:
        outputs = hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        return sum(len(o.generated_tokens) for o in outputs.values())

    return _timed(run, repeats)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    torch.manual_seed(args.seed)
    prompts = make_workload(args.num_seqs, args.input_len, 49152, args.seed)
    systems: dict[str, dict[str, Any]] = {
        "ladle": bench_ladle(
            args.model,
            args.device,
            prompts,
            args.output_len,
            max(args.num_seqs, 1),
            args.quantization,
            args.repeats,
            args.tensor_parallel_size,
            args.kv_cache_dtype,
        )
    }
    print(f"ladle: {systems['ladle']}", flush=True)
    if args.float_too:
        systems["ladle_float"] = bench_ladle(
            args.model, args.device, prompts, args.output_len, max(args.num_seqs, 1), "none", args.repeats,
            args.tensor_parallel_size, args.kv_cache_dtype,
        )  # fmt: skip
        print(f"ladle_float: {systems['ladle_float']}", flush=True)
    gguf = gguf_file(args.model)
    llama_cpp_installed = importlib.util.find_spec("llama_cpp") is not None
    if gguf is not None and args.device == "cpu" and llama_cpp_installed and not args.skip_llama_cpp:
        systems["llama_cpp"] = bench_llama_cpp(gguf, prompts, args.output_len, torch.get_num_threads(), args.repeats)
        print(f"llama_cpp: {systems['llama_cpp']}", flush=True)
    if not args.skip_hf:
        # The dtype ladle runs in on that device (its "auto"): bfloat16 on CUDA, float32 on the CPU.
        hf = hf_model(args.model, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
        for name, bench in (("hf_static", bench_hf_static), ("hf_continuous", bench_hf_continuous)):
            try:
                systems[name] = bench(hf, prompts, args.output_len, args.repeats)
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                systems[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: {systems[name]}", flush=True)
    if args.output_len == 1:  # a prefill: the prompt tokens' rate is the figure
        for system in systems.values():
            if "seconds" in system:
                system["prefill_tok_per_s"] = round(args.num_seqs * args.input_len / system["seconds"], 1)
    hf_rates = [s["output_tok_per_s"] for n, s in systems.items() if n.startswith("hf") and "output_tok_per_s" in s]
    llama_rate = systems.get("llama_cpp", {}).get("output_tok_per_s")
    result = {
        "benchmark": "offline",
        "time": utc_timestamp(),
        "commit": git_commit(),
        "command": args.command_line,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_model": cpu_model_name(),
            "cpu_count": threads,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__,
        },
        "workload": {
            "model": args.model,
            "num_seqs": args.num_seqs,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "ignore_eos": True,
            "greedy": True,
            "seed": args.seed,
            "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype,
            "repeats": args.repeats,
            "float_too": args.float_too,
            "tensor_parallel_size": args.tensor_parallel_size,
            "threads": threads,
        },
        "systems": systems,
        "ratio_vs_best_hf": round(systems["ladle"]["output_tok_per_s"] / max(hf_rates), 3) if hf_rates else None,
        "ratio_vs_llama_cpp": round(systems["ladle"]["output_tok_per_s"] / llama_rate, 3) if llama_rate else None,
    }
    print(json.dumps(result, indent=2))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ladle bench offline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_arguments(parser)
    parser.add_argument("--skip-hf", action="store_true", help="measure ladle only")
    parser.add_argument("--skip-llama-cpp", action="store_true", help="leave llama.cpp out even when installed")
    parser.add_argument("--float-too", action="store_true", help="also run ladle on float weights (ladle_float)")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATION_MODES,
        help="ladle's weights (see `ladle engine --help`)",
    )
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="what ladle's KV cache stores (see `ladle engine --help`)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="time each system this many times and report the median run (default 1)"
    )
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ladle's model split over this many processes"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads of this process (0: torch's default)")
    parser.add_argument("--out", type=Path, help="append the JSON result to this .jsonl file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = "ladle bench offline " + " ".join(argv or [])
    result = run_benchmark(args)
    append_result(args.out, result)
    return 0


def _has_decode_stack(llm: LLM) -> bool:
    """Whether `llm`'s quantized model runs its steps in the C++ decode stack."""
    from engine_server.models import CausalLM

    model = llm.core.runner.model
    return isinstance(model, CausalLM) and model.model.decode_stack is not None
