"""GPU benchmark: ladle vs transformers on the same GPU and the same random-weight models, in one run.

Per model (default `dummy:qwen2.5-0.5b` and `dummy:smollm2-135m`):
- the nano-vllm workload: `--num-seqs` prompts (256) of random token ids, input and output lengths uniform in
  [`--min-len`, `--max-len`] ([100, 1024]), ignore_eos, seed 0 — ladle's output tok/s on it is the headline;
- the ratio to transformers' continuous batching (`generate_batch`), which takes one output length for the
  whole batch: both systems run the same prompts with every output length set to the workload's mean, and
  `ratio_vs_hf` is ladle / transformers on that variant;
- single-stream decode TPOT (one request, `--tpot-tokens` tokens; prefill cancelled out by a 1-token run);
- `roofline_fraction`: the time the workload would take if every decode step only streamed the weights and the
  KV cache it reads at the GPU's measured copy bandwidth, over the measured time.

`--quantization none,int8` runs each model twice, its weights as they are (bf16 on CUDA) and as int8 weight-only
groups (`ladle_kernels.int8_linear`); transformers runs once, with the first.

One JSON object per run (`--out`): device, torch / triton versions, commit, command, and per model and scheme
`model`, `quantization`, `output_tok_per_s` {ladle, transformers}, `ratio_vs_hf`, `roofline_fraction`,
`tpot_ms_single_stream`.

    ladle bench gpu --out benchmarks/results/gpu_h100.jsonl
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from benchmarks.common import append_result, git_commit, hf_model, utc_timestamp
from engine_server.config import QUANTIZATION_MODES, QuantizationMode

DEFAULT_MODELS = "dummy:qwen2.5-0.5b,dummy:smollm2-135m"


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids) and each one's output length."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def with_fixed_output(self) -> Workload:
        """The same prompts, every output length set to the mean (what transformers' batch API can express)."""
        mean = round(self.output_tokens / len(self.output_lens))
        return Workload(self.prompts, [mean] * len(self.prompts))


def nano_vllm_workload(num_seqs: int, min_len: int, max_len: int, seed: int, vocab: int = 10_000) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    return Workload(prompts, [rng.randint(min_len, max_len) for _ in range(num_seqs)])


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, mib: int = 1024, repeats: int = 10) -> float:
    """Measured device memory bandwidth in bytes/s: a large copy reads and writes every byte once."""
    src = torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * src.numel() * repeats / (time.perf_counter() - start)


def roofline_seconds(workload: Workload, weight_bytes: int, kv_bytes_per_token: int, bandwidth: float) -> float:
    """Lower bound on the decode time: all sequences start together (as with enough seats and KV), and step t
    reads the weights once plus the KV cache of every sequence still generating."""
    steps = max(workload.output_lens)
    kv_tokens_read = sum(
        sum(len(p) + t for t in range(out)) for p, out in zip(workload.prompts, workload.output_lens, strict=True)
    )
    return (steps * weight_bytes + kv_tokens_read * kv_bytes_per_token) / bandwidth


class LadleRunner:
    """ladle's offline engine on one model."""

    def __init__(self, model: str, quantization: QuantizationMode, args: argparse.Namespace) -> None:
        from engine_server import LLM
        from engine_server.config import ASYNC_SCHEDULING_MODES, CacheConfig, EngineConfig, SchedulerConfig

        config = EngineConfig(
            model=model,
            device=args.device,
            enforce_eager=args.enforce_eager,
            quantization=quantization,
            async_scheduling=ASYNC_SCHEDULING_MODES[args.async_scheduling],
            cache=CacheConfig(memory_bytes=args.kv_cache_mib * 1024**2, dtype=args.kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=args.num_seqs, **(
                {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {})),
            tensor_parallel_size=args.tensor_parallel_size,
        )
        self.llm = LLM(config=config)
        self.device = args.device

    def run(self, workload: Workload) -> float:
        """Seconds to generate the whole workload (greedy, ignore_eos)."""
        from engine_server import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
        _sync(self.device)
        start = time.perf_counter()
        results = self.llm.generate(workload.prompts, params, use_tqdm=False)
        _sync(self.device)
        seconds = time.perf_counter() - start
        assert sum(len(r.choices[0].token_ids) for r in results) == workload.output_tokens
        return seconds

    def tpot_ms(self, tokens: int) -> float:
        """Single-stream decode time per output token: (time for 1 + tokens) - (time for 1), over tokens."""
        prompt = Workload([list(range(100, 228))], [1])
        self.run(prompt)
        first = self.run(prompt)
        whole = self.run(Workload(prompt.prompts, [1 + tokens]))
        return (whole - first) / tokens * 1000


def hf_seconds(hf: Any, workload: Workload) -> float:
    """transformers' continuous batching (`generate_batch`, CUDA graphs where its version has them)."""
    from transformers import GenerationConfig

    (length,) = set(workload.output_lens)
    config = GenerationConfig(max_new_tokens=length, min_new_tokens=length, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    device = str(next(hf.parameters()).device.type)
    extra: dict[str, Any] = {}
    if device == "cpu":
        # Left alone, transformers sizes its paged cache from the device's free memory, which on the CPU is the
        # machine's: a 2-sequence smoke run took 14.6 GB. Give it the blocks this workload needs.
        from transformers import ContinuousBatchingConfig

        page = ContinuousBatchingConfig().page_size
        blocks = sum(-(-(len(p) + length) // page) for p in workload.prompts) + len(workload.prompts)
        extra["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=blocks)
    hf.generate_batch(inputs=workload.prompts[:2], generation_config=config, progress_bar=False, **extra)  # warm-up
    _sync(device)
    start = time.perf_counter()
    outputs = hf.generate_batch(inputs=workload.prompts, generation_config=config, progress_bar=False, **extra)
    _sync(device)
    seconds = time.perf_counter() - start
    assert sum(len(o.generated_tokens) for o in outputs.values()) == workload.output_tokens
    return seconds


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step streams: every parameter, plus the weights held in another form (the
    8/4-bit weights and scales of quantized layers; FP8 layers' and banks' e4m3 values and scales, or on the CPU
    their dequantized banks; the CPU's MKL-packed layers, as float32). A bank of experts counts whole, as a step of
    many sequences reads nearly every expert."""
    from engine_server.layers.fp8_experts import Fp8Experts
    from engine_server.layers.fp8_linear import Fp8Linear
    from engine_server.layers.packed_linear import PackedLinear
    from engine_server.layers.quantized_linear import QuantizedLinear

    def size(*tensors: torch.Tensor | None) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    total = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied weight is listed once
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += size(module.qs, module.scales, module.mins)
        elif isinstance(module, Fp8Linear):  # on the CPU its dense layer's parameters are counted above instead
            total += size(module.qs, module.scales)
        elif isinstance(module, Fp8Experts):
            total += size(module.w13, module.w2, module.w13_scale, module.w2_scale)
        elif isinstance(module, PackedLinear):  # MKL's packed copy is opaque: count the float32 weight it holds
            total += module.in_features * module.out_features * 4 * (module.weight.stride() == (0, 0))
    return total


def bench_model(
    model: str, quantization: QuantizationMode, args: argparse.Namespace, bandwidth: float
) -> dict[str, Any]:
    """ladle's figures for `model` with weights as `quantization` says; transformers' (bf16 on CUDA) beside
    them unless `--skip-hf`, or unless an earlier scheme of the same model measured them already."""
    workload = nano_vllm_workload(args.num_seqs, args.min_len, args.max_len, args.seed)
    fixed = workload.with_fixed_output()
    ladle = LadleRunner(model, quantization, args)
    warm = workload.prompts[:4]
    ladle.run(Workload(warm, [8] * len(warm)))  # warm-up (kernels compiled, graphs captured)
    seconds = ladle.run(workload)
    fixed_seconds = ladle.run(fixed)
    tpot = ladle.tpot_ms(args.tpot_tokens)
    runner = ladle.llm.core.runner
    # What one rank streams (its shard of the weights and KV heads): under tensor parallelism the ranks read theirs
    # at the same time, each from its own GPU, so the roofline is one GPU's bandwidth over one rank's bytes.
    weights = weight_bytes(runner.model)
    kv_bytes_per_token = sum(c[:, 0, 0].numel() * c.element_size() for c in runner.kv_caches)
    result: dict[str, Any] = {
        "model": model,
        "quantization": runner.quantization,
        "workload": {"num_seqs": args.num_seqs, "len_range": [args.min_len, args.max_len], "seed": args.seed,
                     "output_tokens": workload.output_tokens, "fixed_output_len": fixed.output_lens[0]},
        "output_tok_per_s": {"ladle": round(workload.output_tokens / seconds, 1),
                             "ladle_fixed_output": round(fixed.output_tokens / fixed_seconds, 1)},
        "roofline_fraction": round(
            roofline_seconds(workload, weights, kv_bytes_per_token, bandwidth) / seconds, 4
        ),
        "tpot_ms_single_stream": round(tpot, 3),
        "engine": {
            "cuda_graphs": runner.decode_graphs is not None,
            "tensor_parallel_size": args.tensor_parallel_size,
            "async_scheduling": ladle.llm.core.async_scheduling,
            "kv_cache_mib": args.kv_cache_mib,
            "kv_cache_dtype": args.kv_cache_dtype,
            "max_num_batched_tokens": ladle.llm.config.scheduler.max_num_batched_tokens,
            "preemptions": ladle.llm.core.scheduler.total_preemptions,
        },
        "weight_bytes": weights,
        "kv_bytes_per_token": kv_bytes_per_token,
    }
    del runner
    ladle.llm.close()  # a tensor-parallel engine's workers go now: the next model may start its own
    del ladle
    # transformers takes minutes on this workload: ladle's figures are on the log first, should a time limit
    # end the run before the JSON is written.
    print(f"ladle measured: {json.dumps(result)}", file=sys.stderr, flush=True)
    if not args.skip_hf and quantization == args.quantization[0]:
        try:
            hf = hf_model(model, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
            hf_rate = fixed.output_tokens / hf_seconds(hf, fixed)
            del hf
        except Exception as exc:  # the peer failing (OOM, an API change) must not lose ladle's figures
            result["transformers_error"] = f"{type(exc).__name__}: {exc}"
        else:
            result["output_tok_per_s"]["transformers"] = round(hf_rate, 1)
            result["ratio_vs_hf"] = round(result["output_tok_per_s"]["ladle_fixed_output"] / hf_rate, 3)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def quantization_modes(text: str) -> list[QuantizationMode]:
    """`--quantization`'s comma-separated schemes, each one `EngineConfig.quantization` takes."""
    modes = text.split(",")
    for mode in modes:
        if mode not in QUANTIZATION_MODES:
            raise argparse.ArgumentTypeError(f"{mode!r} is not one of {', '.join(QUANTIZATION_MODES)}")
    return cast(list[QuantizationMode], modes)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ladle bench gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated model specs")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run only")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tpot-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-mib", type=int, help="ladle's KV cache (default: 16384 on CUDA, where the "
                        "workload's 256 x 2048 tokens fit without preemption; 1024 on the CPU)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="what ladle's KV cache stores (see `ladle engine --help`)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="ladle's token budget per step (default: 8192 "
                        "on CUDA, the engine's on the CPU)")
    parser.add_argument("--enforce-eager", action="store_true", help="ladle without CUDA graphs (to measure them)")
    parser.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                        help="ladle's async scheduling (auto: on for CUDA)")
    parser.add_argument("--quantization", type=quantization_modes, default="none",
                        help="comma-separated weight schemes ladle runs each model with, e.g. none,int8 (see `ladle "
                        "engine --help`); transformers runs with the first")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ladle's model split over this many "
                        "GPUs (transformers runs on one)")
    parser.add_argument("--skip-hf", action="store_true", help="measure ladle only")
    parser.add_argument("--out", type=Path, help="append the JSON result to this .jsonl file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kv_cache_mib is None:
        args.kv_cache_mib = 16384 if args.device == "cuda" else 1024
    if args.max_num_batched_tokens is None and args.device == "cuda":
        # Measured on an H100 (benchmarks/results/gpu_h100_profile.log, qwen2.5-0.5b): 2048 -> 19.9k tok/s,
        # 8192 -> 30.1k, 16384 -> 20.8k. Fewer mixed steps (which run eagerly) without 50 ms prefill steps.
        args.max_num_batched_tokens = 8192
    if args.device == "cuda" and not torch.cuda.is_available():
        print("ladle bench gpu: no CUDA device here", file=sys.stderr)
        return 2
    import triton  # noqa: F401  (version recorded below; the kernels need it)

    bandwidth = copy_bandwidth(args.device, mib=1024 if args.device == "cuda" else 64)
    result = {
        "benchmark": "gpu",
        "time": utc_timestamp(),
        "commit": git_commit(),
        "command": "ladle bench gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": sys.modules["triton"].__version__,
        "transformers": importlib.metadata.version("transformers"),
        "copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 1),
        "models": [
            bench_model(model, quantization, args, bandwidth)
            for model in args.models.split(",")
            for quantization in args.quantization
        ],
    }
    print(json.dumps(result, indent=2))
    append_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
