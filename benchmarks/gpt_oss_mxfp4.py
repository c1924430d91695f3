"""gpt-oss-20b as OpenAI releases it, on a CPU: a Hugging Face folder in the released layout (each layer's experts as
MXFP4 blocks and scales, `quantization_config` mxfp4; the rest bfloat16) at gpt-oss-20b's shapes, made here with
random values (never fetched), served by ladle with `--quantization auto` (int8, its experts as stored): the seconds
from start to the timed run, the process's peak resident memory and single-stream output tok/s (prefill included).

The values: MXFP4 codes drawn uniformly under a scale of 2 ** -8, bfloat16 weights N(0, 0.02), norms 1. The
tokenizer is the embedded model's (its ids fit the 201,088-entry embedding). The folder (~13 GB, one safetensors
file per layer, written one at a time) is cached under `$LADLE_CACHE_DIR/gpt-oss-mxfp4` (else
`~/.cache/ladle/gpt-oss-mxfp4`). llama.cpp does not read this layout (its files are GGUF: `benchmarks.gpt_oss_gguf`).

    python -m benchmarks.gpt_oss_mxfp4 --out benchmarks/results/gpt_oss_mxfp4_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from benchmarks.common import cpu_model_name, git_commit, report_result, utc_timestamp
from benchmarks.gpt_oss_gguf import (
    EXPERT_WIDTH,
    EXPERTS,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    VOCAB,
    add_run_arguments,
    measure_in_child,
)
from benchmarks.offline import make_workload
from engine_server.loader import resolve_model
from engine_server.loader.source import default_cache_dir

MXFP4_SCALE_BYTE = 119  # 2 ** (119 - 127): e2m1 values up to 6 / 256
# gpt-oss-20b's config.json, as released (its MXFP4 experts declared by `quantization_config`).
CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": VOCAB, "hidden_size": HIDDEN,
    "intermediate_size": EXPERT_WIDTH, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2), "num_local_experts": EXPERTS,
    "num_experts_per_tok": 4, "swiglu_limit": 7.0, "attention_bias": True, "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "quantization_config": {"quant_method": "mxfp4"},
}  # fmt: skip


def _layer(layer: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors under their checkpoint names."""

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).bfloat16()

    def mxfp4(rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (EXPERTS, rows, columns // 32, 16), dtype=torch.uint8, generator=gen)
        return blocks, torch.full((EXPERTS, rows, columns // 32), MXFP4_SCALE_BYTE, dtype=torch.uint8)

    prefix = f"model.layers.{layer}."
    tensors = {"input_layernorm.weight": torch.ones(HIDDEN).bfloat16(),
               "post_attention_layernorm.weight": torch.ones(HIDDEN).bfloat16(), "self_attn.sinks": normal(HEADS),
               "mlp.router.weight": normal(EXPERTS, HIDDEN), "mlp.router.bias": normal(EXPERTS),
               "mlp.experts.gate_up_proj_bias": normal(EXPERTS, 2 * EXPERT_WIDTH),
               "mlp.experts.down_proj_bias": normal(EXPERTS, HIDDEN)}  # fmt: skip
    for name, rows, columns in (("q", HEADS * HEAD_DIM, HIDDEN), ("k", KV_HEADS * HEAD_DIM, HIDDEN),
                                ("v", KV_HEADS * HEAD_DIM, HIDDEN), ("o", HIDDEN, HEADS * HEAD_DIM)):  # fmt: skip
        tensors[f"self_attn.{name}_proj.weight"] = normal(rows, columns)
        tensors[f"self_attn.{name}_proj.bias"] = normal(rows)
    for proj, rows, columns in (("gate_up_proj", 2 * EXPERT_WIDTH, HIDDEN), ("down_proj", HIDDEN, EXPERT_WIDTH)):
        tensors[f"mlp.experts.{proj}_blocks"], tensors[f"mlp.experts.{proj}_scales"] = mxfp4(rows, columns)
    return {prefix + name: tensor for name, tensor in tensors.items()}


def gpt_oss_mxfp4_folder(cache: Path | None = None) -> Path:
    """The folder (module docstring), written once and cached."""
    folder = (cache or default_cache_dir()) / "gpt-oss-mxfp4"
    if (folder / "config.json").is_file():
        return folder
    partial = folder.with_name(folder.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tokenizer = resolve_model("default").tokenizer_path
    for file in tokenizer.iterdir():
        if file.name.startswith("tokenizer") or file.name == "special_tokens_map.json":
            shutil.copy(file, partial / file.name)
    gen = torch.Generator().manual_seed(0)
    outer = {"model.embed_tokens.weight": (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).bfloat16(),
             "lm_head.weight": (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).bfloat16(),
             "model.norm.weight": torch.ones(HIDDEN).bfloat16()}  # fmt: skip
    save_file(outer, partial / "model-outer.safetensors")
    for layer in range(LAYERS):
        save_file(_layer(layer, gen), partial / f"model-{layer:02d}.safetensors")
    (partial / "config.json").write_text(json.dumps(CONFIG))  # last: its presence marks the folder whole
    partial.rename(folder)
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    folder = gpt_oss_mxfp4_folder()
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1024**3
    print(f"{folder}: {size:.2f} GiB ({time.perf_counter() - started:.0f} s)", flush=True)
    prompts = make_workload(1, args.input_len, 49152, 0)
    ladle: dict[str, Any] = measure_in_child("ladle", folder, prompts, args.output_len, args.repeats)
    result = {
        "benchmark": "gpt_oss_mxfp4", "time": utc_timestamp(), "commit": git_commit(),
        "command": "python -m benchmarks.gpt_oss_mxfp4 " + " ".join(argv or []),
        "machine": {"cpu_model": cpu_model_name(), "cpu_count": multiprocessing.cpu_count()},
        "folder": {"gib": round(size, 2), "layout": "gpt-oss-20b shapes as released: MXFP4 experts, bfloat16 rest"},
        "workload": {"num_seqs": 1, "input_len": args.input_len, "output_len": args.output_len, "greedy": True,
                     "ignore_eos": True, "repeats": args.repeats},
        "systems": {"ladle": ladle},
    }  # fmt: skip
    report_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
