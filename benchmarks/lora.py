"""Multi-LoRA throughput: many streams spread over several adapters against the same streams on the base model
alone, one engine, one run.

The adapters are random, written in PEFT's format for the model's shapes: rank `--rank`, on q and v (PEFT's
default for Llama-style models) or with `--targets all` on every q/k/v/o/gate/up/down module. The engine serves
them from `--adapters` slots, so each step runs every adapter's rows at once. Workload: `--num-seqs` random-token
prompts of `--input-len` tokens, `--output-len` tokens each, greedy, ignore_eos, prefix cache off; each system is
timed after a warm-up, `--repeats` times (the median is reported). `ratio` is the adapters' output tok/s over the
base model's (the issue's goal: >= 0.8).

    ladle bench lora --num-seqs 64 --adapters 8 --out benchmarks/results/lora_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import add_workload_arguments, append_result, cpu_model_name, git_commit, utc_timestamp
from benchmarks.offline import _timed, make_workload, warmup_prompts
from engine_server.config import QUANTIZATION_MODES, ModelConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# --targets: PEFT's default for Llama-style models (q and v), or every attention and MLP projection.
TARGETS = {"qv": ("q_proj", "v_proj"), "all": MODULES}


def write_random_adapter(
    folder: Path, config: ModelConfig, rank: int, seed: int, std: float = 0.01, modules: Sequence[str] = MODULES
) -> Path:
    """A PEFT-format adapter of `rank` on `modules` (every attention and MLP one by default) of a model of
    `config`, random weights."""
    from safetensors.torch import save_file

    from engine_server.lora.targets import module_targets

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for path, target in module_targets(config, layer).items():
            if path.rsplit(".", 1)[-1] not in modules:
                continue
            prefix = f"base_model.model.model.layers.{layer}.{path}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, target.in_features, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(target.out_features, rank, generator=generator) * std
    folder.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules)}
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from engine_server import LLM, SamplingParams
    from engine_server.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
    from engine_server.loader import resolve_model

    torch.manual_seed(args.seed)
    prompts = make_workload(args.num_seqs, args.input_len, 49152, args.seed)
    model_config = resolve_model(args.model).config
    with tempfile.TemporaryDirectory(prefix="ladle-lora-bench-") as scratch:
        names = [f"adapter-{i}" for i in range(args.adapters)]
        folders = [
            write_random_adapter(Path(scratch) / name, model_config, args.rank, i, modules=TARGETS[args.targets])
            for i, name in enumerate(names)
        ]
        modules = tuple((name, str(folder)) for name, folder in zip(names, folders, strict=True))
        config = EngineConfig(
            model=args.model, device=args.device, quantization=args.quantization,
            scheduler=SchedulerConfig(max_num_seqs=args.num_seqs, max_num_batched_tokens=max(2048, args.input_len * 4)),
            cache=CacheConfig(enable_prefix_caching=False),
            lora=LoraConfig(modules, max_loras=args.adapters, max_lora_rank=args.rank),
        )  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        warmup = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        spread = [names[i % len(names)] for i in range(len(prompts))]
        systems: dict[str, dict[str, Any]] = {}
        with LLM(config=config) as llm:
            llm.generate(warmup_prompts(prompts), warmup, adapters=names[:2], use_tqdm=False)
            for system, adapters in (("base", None), ("adapters", spread)):

                def run(adapters: list[str] | None = adapters) -> int:
                    results = llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
                    return sum(len(r.choices[0].token_ids) for r in results)

                systems[system] = _timed(run, args.repeats)
            quantization = llm.core.runner.quantization
    ratio = systems["adapters"]["output_tok_per_s"] / systems["base"]["output_tok_per_s"]
    return {
        "benchmark": "lora", "time": utc_timestamp(), "commit": args.commit, "command": args.command_line,
        "model": args.model, "device": args.device, "quantization": quantization, "cpu": cpu_model_name(),
        "machine": platform.machine(), "threads": torch.get_num_threads(), "num_seqs": args.num_seqs,
        "input_len": args.input_len, "output_len": args.output_len, "adapters": args.adapters, "rank": args.rank,
        "targets": list(TARGETS[args.targets]),
        "systems": systems, "ratio": round(ratio, 3),
    }  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ladle bench lora", description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument("--adapters", type=int, default=8, help="adapters the streams are spread over (= slots)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="qv", choices=sorted(TARGETS),
                        help="the adapters' modules: qv (q_proj and v_proj, PEFT's default for Llama) or all")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATION_MODES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="append the result as one JSON line")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.commit = git_commit()
    args.command_line = shlex.join(["ladle", "bench", "lora", *(argv if argv is not None else sys.argv[1:])])
    result = run_benchmark(args)
    append_result(args.out, result)
    systems = result["systems"]
    print(f"base {systems['base']['output_tok_per_s']} tok/s, {args.adapters} adapters "
          f"{systems['adapters']['output_tok_per_s']} tok/s: ratio {result['ratio']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
