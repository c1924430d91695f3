"""Models of states alone on the CPU, against transformers in the same run: RWKV-4 at its 169M shape (12 blocks 768
wide) and xLSTM at a small shape (12 blocks 512 wide, 4 heads, xLSTM 7B's q/k : v proportions), random weights.
Output tokens a second for 8 sequences of 128 prompt tokens and 64 new tokens each (prefill included): the engine on
its float path and on int8, and transformers' own model on the same prompts (float32, greedy: its prefill, then a step
a token over its state; xLSTM's batched, RWKV-4's one sequence at a time, as its batched step is wrong). How many
sequences' greedy tokens the engine's float path shares with transformers' whole is recorded (random weights leave
near-ties that float rounding may flip); fewer than half fails the script.

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
    # A trained model's head rows differ in norm (a clear next token); random equal-norm rows leave the top logits
    # within float rounding of each other (tests/families.save_family's head_spread).
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head.mul_(torch.exp(torch.randn(head.shape[0], 1) * 2.0))
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


def run_transformers(model: Any, batched: bool) -> tuple[float, list[list[int]]]:
    """transformers' output tokens a second and greedy tokens: its model's own prefill, then one token a step over the
    state it returns (RWKV's `state`, xLSTM's `cache`), argmax each time; the prompts as one batch, or one at a time
    where its batched step is wrong (RWKV-4's: a batch of 8 steps to other logits than each sequence alone and than
    its own whole forward, which agree with each other and with the engine)."""
    ids = torch.tensor(prompts())
    key = "state" if model.config.model_type == "rwkv" else "cache"

    def greedy(inputs: torch.Tensor, steps: int) -> list[list[int]]:
        out = model(inputs, use_cache=True)
        tokens = [out.logits[:, -1].argmax(-1)]
        for _ in range(steps - 1):
            out = model(tokens[-1][:, None], use_cache=True, **{key: getattr(out, key)})
            tokens.append(out.logits[:, -1].argmax(-1))
        return torch.stack(tokens, dim=1).tolist()

    with torch.inference_mode():
        greedy(ids[:1, :8], 4)
        start = time.perf_counter()
        generated = greedy(ids, NEW) if batched else [greedy(ids[i : i + 1], NEW)[0] for i in range(SEQUENCES)]
        elapsed = time.perf_counter() - start
    return SEQUENCES * NEW / elapsed, generated


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
            rates[f"{kind}/transformers"], theirs = run_transformers(model, batched=kind != "rwkv")
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
        "transformers_batched": {"rwkv": False, "xlstm": True},
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
