"""Resident memory of an engine on a GGUF file, beside llama.cpp's on the same file (`ladle bench memory`).

Each system runs in a fresh process of its own and reads its resident set (`VmRSS`) at each stage:
- ladle: `runtime` once the interpreter, torch and the C++ kernels are loaded (what any model costs); then the
  offline `LLM` of `--model` with a `--kv-cache-mib` KV cache, split into its tokenizer, its core (the weights,
  the KV cache, the runner's warm-up) and what comes after (the structured-output compiler's tokenizer tables);
  then `--requests` short greedy requests (the steps' working buffers).
- llama.cpp (llama-cpp-python, when installed; it is not a dependency): `runtime` once the library is loaded, then
  the `Llama` of the same file with a context of `--llama-ctx` tokens, and the same requests.
Reported per system: those stages in MiB, the KV cache's bytes (ladle's allocated float32 tensors; llama.cpp's
f16 cache, computed from its context and the model's shape), the weights' bytes (ladle: every tensor of the model,
each storage once), and `model_mib` = resident growth from `runtime` to after the requests, less the KV cache:
what the model itself holds (weights, tokenizer, buffers), against the file's size (`model_over_file`); for ladle
also the parts of that (`parts_mib`: tokenizer, the core's growth less its KV cache, what follows the core, the
requests) and the core's and the weights' ratios to the file (`core_less_kv_over_file`, `weights_over_file`).

    ladle bench memory --model ~/.cache/ladle/kquant/<...>/q4_k_m.gguf --out benchmarks/results/memory_cpu.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import append_result, cpu_model_name, git_commit, utc_timestamp

MIB = 1024**2
PROMPT = "Write one sentence about the sea."


def resident_mib() -> float:
    """This process's resident set (VmRSS) in MiB; Linux only."""
    with open("/proc/self/status", encoding="utf-8") as status:
        line = next(line for line in status if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def measure_ladle(model: str, kv_cache_mib: int, requests: int) -> dict[str, Any]:
    """ladle's stages in this process (call it in a fresh one)."""
    import torch

    import engine_server.llm as llm_module
    from engine_server import SamplingParams
    from engine_server.config import CacheConfig, EngineConfig
    from ladle_kernels.cpu_ops import cpu_ops

    cpu_ops()  # the kernels' library: part of the runtime, as torch is
    stages = {"runtime": resident_mib()}
    real_core = llm_module.EngineCore

    class MeasuredCore(real_core):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            stages["tokenizer"] = resident_mib()
            super().__init__(*args, **kwargs)
            stages["core"] = resident_mib()

    llm_module.EngineCore = MeasuredCore  # type: ignore[misc]
    config = EngineConfig(model=model, device="cpu", cache=CacheConfig(memory_bytes=kv_cache_mib * MIB))
    llm = llm_module.LLM(config=config)
    stages["loaded"] = resident_mib()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for _ in range(requests):
        llm.generate([PROMPT], params, use_tqdm=False)
    stages["after_requests"] = resident_mib()
    runner = llm.core.runner
    storages: dict[int, int] = {}
    for module in runner.model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        tensors += [t for v in vars(module).values() if isinstance(v, tuple | list) for t in _tensors(v)]
        for tensor in tensors:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    kv_bytes = sum(cache.untyped_storage().nbytes() for cache in runner.kv_caches)
    llm.close()
    return {"stages_mib": stages, "kv_mib": kv_bytes / MIB, "weights_mib": sum(storages.values()) / MIB,
            "quantization": runner.quantization}  # fmt: skip


def _tensors(items: Sequence[Any]) -> list[Any]:
    """The tensors in a tuple or list, one level of nesting deep (a layer's packed parts)."""
    import torch

    found = []
    for item in items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, tuple | list):
            found += [t for t in item if isinstance(t, torch.Tensor)]
    return found


def measure_llama_cpp(model: str, n_ctx: int, requests: int, threads: int) -> dict[str, Any]:
    """llama.cpp's stages in this process (call it in a fresh one)."""
    import llama_cpp

    stages = {"runtime": resident_mib()}
    llama = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, verbose=False)
    stages["loaded"] = resident_mib()
    for _ in range(requests):
        llama.reset()
        llama(PROMPT, max_tokens=32, temperature=0.0)
    stages["after_requests"] = resident_mib()
    meta = llama.metadata  # GGUF keys as strings, under the architecture's prefix
    arch = meta["general.architecture"]
    layers, kv_heads = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.attention.head_count_kv"])
    head_dim = llama.n_embd() // int(meta[f"{arch}.attention.head_count"])
    kv_bytes = llama.n_ctx() * layers * 2 * kv_heads * head_dim * 2  # keys and values, f16 (its default)
    return {"stages_mib": stages, "kv_mib": kv_bytes / MIB, "n_ctx": llama.n_ctx()}


def _child(argv: list[str]) -> dict[str, Any]:
    """Run this module in a fresh process for one system; its result is the JSON of its last line."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory", *argv], capture_output=True, text=True,
                          check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the {argv[1]} measurement failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def summarize(result: dict[str, Any], file_mib: float) -> dict[str, Any]:
    """`result` with `model_mib` (growth from the runtime to after the requests, less the KV cache) and its ratio
    to the file's size."""
    stages = result["stages_mib"]
    model_mib = stages["after_requests"] - stages["runtime"] - result["kv_mib"]
    rounded = {k: round(v, 1) if isinstance(v, float) else v for k, v in result.items() if k != "stages_mib"}
    summary = {**rounded, "stages_mib": {k: round(v, 1) for k, v in stages.items()}, "model_mib": round(model_mib, 1),
               "model_over_file": round(model_mib / file_mib, 3)}  # fmt: skip
    if "core" in stages:  # ladle: the core's growth less its KV cache is its weights and their buffers
        core = stages["core"] - stages["tokenizer"] - result["kv_mib"]
        summary["parts_mib"] = {
            "tokenizer": round(stages["tokenizer"] - stages["runtime"], 1), "core_less_kv": round(core, 1),
            "after_core": round(stages["loaded"] - stages["core"], 1),
            "requests": round(stages["after_requests"] - stages["loaded"], 1),
        }  # fmt: skip
        summary["core_less_kv_over_file"] = round(core / file_mib, 3)
        summary["weights_over_file"] = round(result["weights_mib"] / file_mib, 3)
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ladle bench memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--kv-cache-mib", type=int, default=400, help="ladle's KV cache (float32)")
    parser.add_argument("--llama-ctx", type=int, default=8192, help="llama.cpp's context in tokens (f16 cache)")
    parser.add_argument("--requests", type=int, default=2, help="short greedy requests after loading")
    parser.add_argument("--threads", type=int, default=2, help="threads of each system")
    parser.add_argument("--skip-llama-cpp", action="store_true", help="measure ladle only")
    parser.add_argument("--child", choices=["ladle", "llama_cpp"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="append the JSON result to this .jsonl file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child == "ladle":
        print(json.dumps(measure_ladle(args.model, args.kv_cache_mib, args.requests)))
        return 0
    if args.child == "llama_cpp":
        print(json.dumps(measure_llama_cpp(args.model, args.llama_ctx, args.requests, args.threads)))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    file_mib = Path(args.model).stat().st_size / MIB
    common = ["--model", args.model, "--requests", str(args.requests), "--threads", str(args.threads)]
    systems = {"ladle": summarize(_child(["--child", "ladle", *common, "--kv-cache-mib", str(args.kv_cache_mib)]),
                                  file_mib)}  # fmt: skip
    print(f"ladle: {systems['ladle']}", flush=True)
    if importlib.util.find_spec("llama_cpp") is not None and not args.skip_llama_cpp:
        llama = _child(["--child", "llama_cpp", *common, "--llama-ctx", str(args.llama_ctx)])
        systems["llama_cpp"] = summarize(llama, file_mib)
        print(f"llama_cpp: {systems['llama_cpp']}", flush=True)
    command = "ladle bench memory " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {
        "benchmark": "memory", "time": utc_timestamp(), "commit": git_commit(), "command": command,
        "machine": {"cpu_model": cpu_model_name(), "cpu_count": os.cpu_count(), "device": "cpu"},
        "workload": {"model": args.model, "file_mib": round(file_mib, 1), "kv_cache_mib": args.kv_cache_mib,
                     "llama_ctx": args.llama_ctx, "requests": args.requests, "threads": args.threads},
        "systems": systems,
    }  # fmt: skip
    append_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
