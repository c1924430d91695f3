"""Quantized weights against the float reference: greedy agreement and logit distance (`ladle bench quality`).

For each chat prompt of the exactness tests, the float model (`--quantization none`, token-exact with
transformers) decodes `--num-tokens` greedy tokens; every format then reads the same prompt + continuation
(teacher forcing: the prompt in one prefill, then the continuation one decode step per token, the kernels a
served request runs) and is compared with the float model's logits at each continuation position:
- `top1_agreement`: the share of positions where both pick the same next token;
- `mean_kl` / `max_kl`: KL(float || quantized) of the next-token distributions, in nats;
- `greedy_identical`: the share of prompts whose free-running greedy continuation equals the float one, and
  `mean_common_prefix`: how many leading tokens they share on average (one near-tie flips all that follows).
The models run through the engine's own `ModelRunner`, so what is measured is what is served.

`--reference` names another model as the float reference: for a GGUF file quantized from float weights (a Q4_K_M
file of `benchmarks.kquant_files`), the F32 file it was made from, so that the weights' quantization is measured
and not only the activations'. `--llama-cpp` measures llama.cpp on the same file the same way (llama-cpp-python,
every position's logits of each whole sequence read from an empty context, the same token ids).

`--kv-cache-dtype fp8` runs the formats over an FP8 KV cache (`--formats none` then measures the cache alone); the
reference keeps its float one.

With `--tensor-parallel-size N` the formats run split over N processes (their workers run every forward) and are
compared with the same float reference at TP=1: quantized weights under tensor parallelism must hold the same
thresholds as at TP=1 (tests/unit/test_quantization.py).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks.common import cpu_model_name, git_commit
from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import CacheConfig, EngineConfig
from engine_server.llm import LLM
from engine_server.model_runner import ModelRunner
from engine_server.sampling_params import SamplingParams
from engine_server.tokenizer.chat import ChatMessage

# The greedy exactness tests' prompts (tests/unit/test_engine_exact.py).
QUALITY_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a ten-year-old.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Give me a recipe for pancakes.",
    "Who wrote Pride and Prejudice?",
    "Describe the water cycle in two sentences.",
    "Write a Python function that reverses a string.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet.",
    "How do airplanes stay in the air?",
    "Name the planets of the solar system in order.",
    "What is the difference between weather and climate?",
    "Tell me a short joke about computers.",
)
CACHE_BYTES = 512 * 1024**2  # one full-context sequence of the embedded model needs ~361 MiB


@dataclass(frozen=True)
class QualityResult:
    """One quantization format against the float reference (see the module docstring)."""

    quantization: str
    positions: int
    top1_agreement: float
    mean_kl: float
    max_kl: float
    greedy_identical: float | None  # None: not measured (`compare(..., free_running=False)`)
    mean_common_prefix: float | None


def make_llm(
    model: str, quantization: str, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
    cache_bytes: int = CACHE_BYTES,
) -> LLM:
    """`model` with `quantization` and a KV cache of `kv_cache_dtype` in `cache_bytes`, split over
    `tensor_parallel_size` processes (close it: it owns its workers)."""
    cache = CacheConfig(memory_bytes=cache_bytes, dtype=kv_cache_dtype)  # type: ignore[arg-type]
    config = EngineConfig(model=model, device="cpu", quantization=quantization,  # type: ignore[arg-type]
                          cache=cache, tensor_parallel_size=tensor_parallel_size)  # fmt: skip
    return LLM(config=config)


def greedy_sequences(llm: LLM, prompts: Sequence[str], num_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt token ids, greedy continuation) per chat prompt."""
    from engine_server import ChatPrompt

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    chats = [ChatPrompt([ChatMessage(role="user", content=p)]) for p in prompts]
    results = llm.generate(chats, params, use_tqdm=False)
    return [r.prompt_token_ids for r in results], [r.choices[0].token_ids for r in results]


def sequence_logits(llm: LLM, token_ids: list[int], prefill: int | None = None) -> torch.Tensor:
    """Float32 logits `[T, vocab]` of one sequence read by `llm`'s model: the first `prefill` tokens (all when
    None) in one prefill step, then one decode step per token, as a served request reads its prompt and then its
    own tokens (a quantized model's decode steps take other kernels than its prefills)."""
    return batch_sequence_logits(llm, [token_ids], [len(token_ids) if prefill is None else prefill])[0]


def _hold_states(runner: ModelRunner, meta: AttentionMetadata, sequences: list[int]) -> None:
    """On a model with linear attention (Qwen3.5), give each row of `meta` its sequence's state slot: sequence i's
    is slot i (no request runs meanwhile: `LLM` is offline). ValueError when there are more sequences than slots."""
    if not runner.state_slots:
        return
    if max(sequences, default=0) >= runner.state_slots:
        raise ValueError(f"{max(sequences) + 1} sequences read at once, but the engine holds {runner.state_slots} "
                         "linear-attention states (--max-num-seqs)")  # fmt: skip
    meta.state_slots_cpu = sequences
    meta.state_slots = torch.tensor(sequences, dtype=torch.int64, device=runner.device)


def batch_sequence_logits(llm: LLM, sequences: Sequence[list[int]], prefills: Sequence[int]) -> list[torch.Tensor]:
    """`sequence_logits` of many sequences read together, as the engine batches requests: every sequence's first
    `prefills[i]` tokens in one prefill step, then one decode step per position with a row for each sequence that
    still has a token to read. The engine's kernels give a row the same result whatever its batch (the quantized
    ones bit for bit: tests/unit/kernels/test_cpu_ops.py), so this is what reading each alone gives, in far fewer
    forwards. The KV blocks are taken from the engine's pool and given back unpublished, so its prefix cache is
    left as it was (blocks it holds are never written). The inputs go to the engine's device; the logits come back
    on the host."""
    runner = llm.core.runner
    device = runner.device
    pool = llm.core.scheduler.kv_cache.pool
    tables: list[list[int]] = []
    try:
        for ids in sequences:
            tables.append(pool.allocate(-(-len(ids) // runner.block_size)))
        prefill_ids = [torch.tensor(ids[:count]) for ids, count in zip(sequences, prefills, strict=True)]
        meta = AttentionMetadata.build(list(prefills), list(prefills), tables, runner.block_size, device)
        _hold_states(runner, meta, list(range(len(sequences))))
        positions = torch.cat([torch.arange(count) for count in prefills])
        logits = runner.forward_logits(torch.cat(prefill_ids).to(device), positions.to(device), meta)
        rows = [[part] for part in logits.split(list(prefills))]
        lengths = [len(ids) for ids in sequences]
        for step in range(max(length - count for length, count in zip(lengths, prefills, strict=True))):
            live = [i for i, count in enumerate(prefills) if count + step < lengths[i]]
            at = [prefills[i] + step for i in live]
            meta = AttentionMetadata.build([1] * len(live), [p + 1 for p in at], [tables[i] for i in live],
                                           runner.block_size, device)  # fmt: skip
            _hold_states(runner, meta, live)
            tokens = torch.tensor([sequences[i][p] for i, p in zip(live, at, strict=True)], device=device)
            step_logits = runner.forward_logits(tokens, torch.tensor(at, device=device), meta)
            for row, i in enumerate(live):
                rows[i].append(step_logits[row : row + 1])
    finally:
        for table in tables:
            pool.free(table)
    return [torch.cat(parts).cpu() for parts in rows]


def reference_log_probs(reference: LLM, sequences: tuple[list[list[int]], list[list[int]]]) -> list[torch.Tensor]:
    """The reference's next-token log-probabilities `[num_tokens, vocab]` at each continuation position of
    `sequences` (its own greedy continuations), every whole sequence read in one prefill step: computed once and
    compared with every format."""
    full = [prompt_ids + continuation for prompt_ids, continuation in zip(*sequences, strict=True)]
    logits = batch_sequence_logits(reference, full, [len(ids) for ids in full])
    starts = [len(prompt_ids) - 1 for prompt_ids in sequences[0]]  # the logits that predict each continuation token
    return [torch.log_softmax(rows[start:-1], dim=-1) for rows, start in zip(logits, starts, strict=True)]


# The float model's greedy continuations of the prompts (`greedy_sequences`) and its log-probabilities along them
# (`reference_log_probs`): what every candidate is compared with.
FloatReference = tuple[tuple[list[list[int]], list[list[int]]], list[torch.Tensor]]


def reference_of(reference: LLM, prompts: Sequence[str], num_tokens: int) -> FloatReference:
    """`reference`'s greedy continuations of `prompts` and its log-probabilities along them."""
    sequences = greedy_sequences(reference, prompts, num_tokens)
    return sequences, reference_log_probs(reference, sequences)


def compare(
    reference: list[torch.Tensor], candidate: LLM, name: str, prompts: Sequence[str], num_tokens: int,
    sequences: tuple[list[list[int]], list[list[int]]], free_running: bool = True,
) -> QualityResult:  # fmt: skip
    """`candidate` against the reference's log-probabilities (`reference_log_probs`) on `sequences` (the
    reference's greedy continuations of `prompts`). Without `free_running` the candidate's own greedy
    continuations are not decoded, and `greedy_identical` and `mean_common_prefix` are None (tests that assert
    only the thresholds skip that pass: 16 x 64 tokens of decoding)."""
    full = [prompt_ids + continuation for prompt_ids, continuation in zip(*sequences, strict=True)]
    read = batch_sequence_logits(candidate, full, [len(prompt_ids) for prompt_ids in sequences[0]])
    identical = common = None
    if free_running:
        _, continuations = greedy_sequences(candidate, prompts, num_tokens)
        prefixes = [_common_prefix(a, b) for a, b in zip(sequences[1], continuations, strict=True)]
        identical, common = sum(p == num_tokens for p in prefixes) / len(prefixes), sum(prefixes) / len(prefixes)
    return score(name, reference, read, sequences[0], identical, common)


def score(
    name: str, reference: list[torch.Tensor], read: list[torch.Tensor], prompts_ids: list[list[int]],
    identical: float | None = None, common: float | None = None,
) -> QualityResult:  # fmt: skip
    """A candidate's logits `read` (`[T, vocab]` per whole sequence) against the reference's log-probabilities at
    each continuation position (after each prompt of `prompts_ids`)."""
    agree = positions = 0
    kls: list[float] = []
    for prompt_ids, ref, candidate_logits in zip(prompts_ids, reference, read, strict=True):
        got = torch.log_softmax(candidate_logits[len(prompt_ids) - 1 : -1].float(), dim=-1)
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        positions += ref.shape[0]
        kls.extend((ref.exp() * (ref - got)).sum(-1).tolist())
    return QualityResult(
        quantization=name,
        positions=positions,
        top1_agreement=agree / positions,
        mean_kl=sum(kls) / len(kls),
        max_kl=max(kls),
        greedy_identical=identical,
        mean_common_prefix=common,
    )


def llama_cpp_logits(gguf: str, sequences: tuple[list[list[int]], list[list[int]]]) -> list[torch.Tensor]:
    """llama.cpp's (llama-cpp-python's) logits `[T, vocab]` of each whole sequence (prompt + continuation, the same
    token ids), every position's kept (`logits_all`), each sequence read from an empty context."""
    import os

    import numpy as np
    from llama_cpp import Llama

    full = [prompt_ids + continuation for prompt_ids, continuation in zip(*sequences, strict=True)]
    threads = os.cpu_count() or 1
    llama = Llama(model_path=gguf, n_ctx=max(map(len, full)) + 8, logits_all=True, n_threads=threads,
                  n_threads_batch=threads, n_batch=512, verbose=False)  # fmt: skip
    read = []
    for ids in full:
        llama.reset()
        llama.eval(ids)
        read.append(torch.from_numpy(np.array(llama.scores[: len(ids)], dtype=np.float32)))
    llama.close()
    return read


def measure(
    model: str = "default", formats: Sequence[str] = ("gguf", "int8"), num_tokens: int = 64,
    prompts: Sequence[str] = QUALITY_PROMPTS, reference: LLM | None = None, tensor_parallel_size: int = 1,
    float_reference: FloatReference | None = None, free_running: bool = True, reference_model: str | None = None,
    llama_cpp: bool = False, kv_cache_dtype: str = "auto",
) -> list[QualityResult]:  # fmt: skip
    """Every format in `formats` (at `tensor_parallel_size`, over a KV cache of `kv_cache_dtype`) against the float
    model at TP=1 (`reference`, loaded here when None: `reference_model`'s float weights, else `model`'s, over a
    float cache), or against `float_reference`, what `reference_of` gave for the same prompts and tokens. With
    `llama_cpp`, llama.cpp on `model` (a GGUF file) too, on the same positions (`quantization` "llama.cpp")."""
    if float_reference is None:
        float_reference = reference_of(reference or make_llm(reference_model or model, "none"), prompts, num_tokens)
    sequences, log_probs = float_reference
    results = []
    for name in formats:
        with make_llm(model, name, tensor_parallel_size, kv_cache_dtype) as candidate:
            results.append(compare(log_probs, candidate, name, prompts, num_tokens, sequences, free_running))
    if llama_cpp:
        from benchmarks.offline import gguf_file

        gguf = gguf_file(model)
        if gguf is None:
            raise ValueError(f"--llama-cpp: {model!r} is not a GGUF file")
        results.append(score("llama.cpp", log_probs, llama_cpp_logits(str(gguf), sequences), sequences[0]))
    return results


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ladle bench quality", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--formats", default="gguf,int8", help="comma-separated --quantization values")
    parser.add_argument("--num-tokens", type=int, default=64)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="run the formats split over N processes")
    parser.add_argument("--reference", help="the float reference model (default: --model's own float weights)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also llama.cpp (llama-cpp-python) on --model, a GGUF file, on the same positions")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the formats' KV cache (the reference's stays float)")
    parser.add_argument("--out", help="write the results as JSON lines here")
    args = parser.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    results = measure(args.model, formats, args.num_tokens, tensor_parallel_size=args.tensor_parallel_size,
                      reference_model=args.reference, llama_cpp=args.llama_cpp,
                      kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    record: dict[str, Any] = {
        "benchmark": "quality", "commit": git_commit(), "command": "ladle bench quality " + " ".join(argv or []),
        "model": args.model, "reference": args.reference or args.model, "cpu": cpu_model_name(),
        "num_tokens": args.num_tokens, "tensor_parallel_size": args.tensor_parallel_size,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    lines = [json.dumps({**record, **asdict(r)}) for r in results]
    for line in lines:
        print(line)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as out:
            out.writelines(line + "\n" for line in lines)
    return 0 if all(math.isfinite(r.mean_kl) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
