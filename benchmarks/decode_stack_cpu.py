"""The CPU's C++ decode stack on the families it took last (Gemma 3, Phi-3 / Phi-4-mini, SmolLM3, Ministral 3,
Command R7B): a random model of each family's small shape (the embedded tokenizer's 49,152-token vocabulary but for
Gemma 3's 262,144) served on int8 weights with its steps in the stack (`layers.decode_stack`) and on the layers (the
stack switched off), beside the float path and, for one sequence, transformers' own model, in the same run: output
tokens a second of one sequence (single stream: 128 prompt tokens, then 128 new ones) and of 8 at once. The stack's
and the layers' greedy tokens must be equal (the script fails otherwise): the stack runs the same kernels in the same
order. (Its first runs, Gemma 3 alone, were `benchmarks.gemma_stack_cpu`: benchmarks/results/gemma_stack_cpu.jsonl.)

    PYTHONPATH=. .venv/bin/python -m benchmarks.decode_stack_cpu --out benchmarks/results/decode_stack_cpu.jsonl
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from benchmarks.common import append_result, cpu_model_name, git_commit, utc_timestamp

PROMPT, NEW = 128, 128
_SMALL = {"vocab_size": 49152, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 16,
          "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096,
          "pad_token_id": 0}
# Each family's transformers config class and its shape: Gemma 3 270M's text model (google/gemma-3-270m's
# config.json); the others one small shape with each family's own parts (Phi-4-mini's partial rotary and LongRoPE,
# SmolLM3's NoPE every fourth layer, Ministral 3's YaRN and query temperature, Command R7B's windows beside NoPE
# layers and parallel blocks).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": ("Gemma3TextConfig", {
        "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
        "sliding_window": 512, "max_position_embeddings": 32768}),
    "phi3": ("Phi3Config", {**_SMALL, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
                            "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 24,
                                             "long_factor": [4.0] * 24}}),
    "smollm3": ("SmolLM3Config", {**_SMALL, "no_rope_layers": [0 if i % 4 == 3 else 1 for i in range(16)]}),
    "ministral3": ("Ministral3Config", {**_SMALL, "rope_parameters": {
        "type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}}),
    "cohere2": ("Cohere2Config", {**_SMALL, "sliding_window": 64, "logit_scale": 0.25,
                                  "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 4}),
}  # fmt: skip


def save_model(root: Path, family: str) -> Path:
    """The random `family` model saved with the embedded tokenizer (its ids all below 49,152)."""
    import torch
    import transformers

    from engine_server.loader import resolve_model

    class_name, shape = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, class_name)(**shape)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.05)
    folder = root / family
    model.save_pretrained(folder)
    tokenizer = resolve_model("default").tokenizer_path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, 49152) for _ in range(PROMPT)] for _ in range(count)]


def ladle_run(
    folder: Path, quantization: Literal["int8", "none"], stack: bool, batch: list[list[int]]
) -> tuple[float, list[list[int]]]:
    """(output tokens a second, the tokens) of the engine on `folder`, the decode stack on or off."""
    from engine_server import LLM, SamplingParams
    from engine_server.config import EngineConfig, SchedulerConfig

    config = EngineConfig(model=str(folder), device="cpu", quantization=quantization,
                          scheduler=SchedulerConfig(max_model_len=PROMPT + NEW))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    with LLM(config=config) as llm:
        decoder: Any = llm.core.runner.loaded.model.model
        if quantization != "none":
            assert decoder.decode_stack is not None, "the stack does not run this model"
        if not stack:
            decoder.decode_stack = None
        llm.generate([batch[0][:8]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm up
        start = time.perf_counter()
        results = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    tokens = [result.choices[0].token_ids for result in results]
    return sum(len(t) for t in tokens) / elapsed, tokens


def transformers_run(folder: Path, batch: list[list[int]]) -> float:
    """Output tokens a second of transformers' own model, greedy, with its KV cache, each sequence alone."""
    import torch
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in batch:
            model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return len(batch) * NEW / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), action="append", help="(repeatable; default: all)")
    parser.add_argument("--out", type=Path, help="append the results to this JSONL file")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.decode_stack_cpu" + (f" --out {args.out}" if args.out else "")
    with tempfile.TemporaryDirectory() as root:
        for family in args.family or list(FAMILIES):
            folder = save_model(Path(root), family)
            for sequences in (1, 8):
                batch = prompts(sequences)
                rates: dict[str, float] = {}
                rates["int8_stack"], stacked = ladle_run(folder, "int8", True, batch)
                rates["int8_layers"], layered = ladle_run(folder, "int8", False, batch)
                if stacked != layered:
                    print(f"{family}: the stack's tokens differ from the layers'", file=sys.stderr)
                    return 1
                rates["float"], _ = ladle_run(folder, "none", False, batch)
                if sequences == 1:
                    rates["transformers_float"] = transformers_run(folder, batch)
                result = {
                    "benchmark": "decode_stack_cpu", "commit": git_commit(), "timestamp": utc_timestamp(),
                    "cpu": cpu_model_name(), "command": command, "family": family,
                    "shape": FAMILIES[family][1], "weights": "random", "sequences": sequences,
                    "prompt_tokens": PROMPT, "new_tokens": NEW,
                    "output_tokens_per_s": {name: round(rate, 1) for name, rate in rates.items()},
                    "stack_over_layers": round(rates["int8_stack"] / rates["int8_layers"], 2),
                }  # fmt: skip
                print(result)
                if args.out is not None:
                    append_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
