"""Models of states alone on the CPU, against transformers in the same run: RWKV-4 at its 169M shape (12 blocks 768
wide) and xLSTM at a small shape (12 blocks 512 wide, 4 heads, xLSTM 7B's q/k : v proportions), random weights.
Output tokens a second for 8 sequences of 128 prompt tokens and 64 new tokens each (prefill included): the engine on
its float path and on int8, and transformers' `generate` on the same prompts (float32, batched, greedy, no end of
sequence). How many sequences' greedy tokens the engine's float path shares with transformers' whole is recorded
(random weights leave near-ties that float rounding may flip); fewer than half fails the script.

    PYTHONPATH=. .venv/bin/python -m benchmarks.recurrent_cpu --out benchmarks/results/recurrent_cpu.jsonl
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import append_result, cpu_model_name, git_commit, utc_timestamp

SEQUENCES, PROMPT, NEW = 8, 128, 64


def build(kind: str) -> Any:
    """A random transformers model of `kind` ("rwkv" or "xlstm") at the shapes the module doc names."""
    import transformers

    torch.manual_seed(0)
    if kind == "rwkv":
        config: Any = transformers.RwkvConfig(vocab_size=49152, hidden_size=768, num_hidden_layers=12,
                                              context_length=1024)  # fmt: skip
        model: Any = transformers.RwkvForCausalLM(config).eval()
    else:
        config = transformers.xLSTMConfig(vocab_size=49152, hidden_size=512, num_blocks=12, num_heads=4,
                                          qk_dim_factor=0.5, v_dim_factor=1.0)  # fmt: skip
        model = transformers.xLSTMForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # as the engine's ignore_eos
    return model


def save(model: Any, folder: Path) -> Path:
    """`model` saved to `folder` with the embedded model's tokenizer."""
    from engine_server.loader import resolve_model

    model.save_pretrained(folder)
    tokenizer = resolve_model("default").tokenizer_path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


def prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 40000 + 10 for j in range(PROMPT)] for i in range(SEQUENCES)]


def run_engine(folder: Path, quantization: str) -> tuple[float, list[list[int]]]:
    """The engine's output tokens a second and greedy tokens, after a short warm-up."""
    from engine_server import LLM, SamplingParams
    from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig

    config = EngineConfig(model=str(folder), device="cpu", quantization=quantization,  # type: ignore[arg-type]
                          cache=CacheConfig(memory_bytes=1024**3),
                          scheduler=SchedulerConfig(max_num_seqs=SEQUENCES))  # fmt: skip
    with LLM(config=config) as llm:
        llm.generate(prompts()[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        results = llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
                               use_tqdm=False)  # fmt: skip
        elapsed = time.perf_counter() - start
    return SEQUENCES * NEW / elapsed, [result.choices[0].token_ids for result in results]


def run_transformers(model: Any) -> tuple[float, list[list[int]]]:
    """transformers' output tokens a second and greedy tokens (`generate`, the prompts as one batch)."""
    ids = torch.tensor(prompts())
    with torch.inference_mode():
        model.generate(ids[:2, :8], max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        elapsed = time.perf_counter() - start
    return SEQUENCES * NEW / elapsed, out[:, PROMPT:].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="append the result as a JSON line")
    args = parser.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    rates: dict[str, float] = {}
    identical: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as root:
        for kind in ("rwkv", "xlstm"):
            model = build(kind)
            folder = save(model, Path(root) / kind)
            rates[f"{kind}/transformers"], theirs = run_transformers(model)
            rates[f"{kind}/ladle_float"], ours = run_engine(folder, "none")
            identical[kind] = sum(a == b for a, b in zip(ours, theirs, strict=True))
            if 2 * identical[kind] < SEQUENCES:
                print(f"{kind}: {identical[kind]} of {SEQUENCES} sequences equal transformers'", file=sys.stderr)
                return 1
            rates[f"{kind}/ladle_int8"], _ = run_engine(folder, "int8")
    result = {
        "benchmark": "recurrent_cpu", "time": utc_timestamp(), "commit": git_commit(), "device": "cpu",
        "cpu": cpu_model_name(), "threads": torch.get_num_threads(),
        "command": "PYTHONPATH=. .venv/bin/python -m benchmarks.recurrent_cpu",
        "shapes": {"rwkv": "rwkv-4-169m (12 x 768), random weights",
                   "xlstm": "12 blocks x 512, 4 heads, q/k 64 and v 128 a head, random weights"},
        "sequences": SEQUENCES, "prompt_tokens": PROMPT, "new_tokens": NEW,
        "sequences_equal_to_transformers": identical,
        "output_tok_s": {name: round(rate, 1) for name, rate in rates.items()},
        "ratio_vs_transformers": {name: round(rate / rates[f"{name.split('/')[0]}/transformers"], 2)
                                  for name, rate in rates.items() if not name.endswith("transformers")},
    }  # fmt: skip
    print(result)
    append_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
