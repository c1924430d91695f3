"""ALiBi on the CPU: a BLOOM-560M-shaped random model (24 layers, 1,024 wide, 16 heads) served with its attention in
the C++ decode kernel (`ladle_kernels.cpu_ops.alibi_attention`) and in the torch path (`reference.alibi_attention`,
sequence by sequence), beside a GPT-NeoX model of the same shape (rope, the same kernel), in the same run: output
tokens a second for 32 sequences of 256 prompt tokens and 64 new tokens each (prefill included), float32 and int8.
Greedy tokens must be the same through the kernel and the torch path on the float path (the script fails otherwise).

    PYTHONPATH=. .venv/bin/python -m benchmarks.alibi_cpu --out benchmarks/results/alibi_cpu.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import append_result, cpu_model_name, git_commit, utc_timestamp

SEQUENCES, PROMPT, NEW = 32, 256, 64


def save_model(kind: str, root: Path) -> Path:
    """A random `kind` ("bloom" or "gpt_neox") model of BLOOM-560M's shape saved with the embedded tokenizer."""
    import transformers

    from engine_server.loader import resolve_model

    folder = root / kind
    if kind == "bloom":
        model: Any = transformers.BloomForCausalLM(transformers.BloomConfig(hidden_size=1024, n_layer=24, n_head=16,
                                                                            vocab_size=49152))  # fmt: skip
    else:
        config = transformers.GPTNeoXConfig(vocab_size=49152, hidden_size=1024, num_hidden_layers=24,
                                            num_attention_heads=16, intermediate_size=4096,
                                            max_position_embeddings=2048, use_parallel_residual=False)  # fmt: skip
        model = transformers.GPTNeoXForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer = resolve_model("default").tokenizer_path  # the embedded model's
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


@contextlib.contextmanager
def torch_alibi() -> Iterator[None]:
    """The CPU kernel sets (the float path's and the quantized models' batch-invariant one) with `alibi_attention`
    the torch reference's, while the block runs."""
    from ladle_kernels import cpu_ops, reference

    originals = {name: getattr(cpu_ops, name) for name in ("cpu_ops", "batch_invariant_cpu_ops")}

    def patched(original: Any) -> Any:
        def ops() -> Any:
            kernels = original()
            return None if kernels is None else dataclasses.replace(kernels, alibi_attention=reference.alibi_attention)

        return ops

    for name, original in originals.items():
        setattr(cpu_ops, name, patched(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(cpu_ops, name, original)


def run(folder: Path, quantization: str) -> tuple[float, list[list[int]]]:
    """Output tokens a second and the greedy tokens, after a short warm-up."""
    from engine_server import LLM, SamplingParams
    from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig

    prompts = [[(7 * i + 13 * j) % 40000 + 10 for j in range(PROMPT)] for i in range(SEQUENCES)]
    config = EngineConfig(model=str(folder), device="cpu", quantization=quantization,  # type: ignore[arg-type]
                          cache=CacheConfig(memory_bytes=4 * 1024**3),
                          scheduler=SchedulerConfig(max_num_seqs=SEQUENCES))  # fmt: skip
    with LLM(config=config) as llm:
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
                               use_tqdm=False)  # fmt: skip
        elapsed = time.perf_counter() - start
    return SEQUENCES * NEW / elapsed, [result.choices[0].token_ids for result in results]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="append the result as a JSON line")
    args = parser.parse_args(argv)
    rates: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as root:
        bloom, neox = save_model("bloom", Path(root)), save_model("gpt_neox", Path(root))
        for quantization in ("none", "int8"):
            rates[f"bloom_kernel/{quantization}"], kernel_tokens = run(bloom, quantization)
            with torch_alibi():
                rates[f"bloom_torch/{quantization}"], torch_tokens = run(bloom, quantization)
            if quantization == "none" and kernel_tokens != torch_tokens:
                print("the kernel's and the torch path's greedy tokens differ", file=sys.stderr)
                return 1
            rates[f"gpt_neox/{quantization}"], _ = run(neox, quantization)
    result = {
        "benchmark": "alibi_cpu", "time": utc_timestamp(), "commit": git_commit(), "device": "cpu",
        "cpu": cpu_model_name(), "command": "PYTHONPATH=. .venv/bin/python -m benchmarks.alibi_cpu",
        "shape": "bloom-560m (24 x 1024, 16 heads), random weights", "sequences": SEQUENCES,
        "prompt_tokens": PROMPT, "new_tokens": NEW,
        "output_tok_s": {name: round(rate, 1) for name, rate in rates.items()},
    }  # fmt: skip
    print(result)
    append_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
