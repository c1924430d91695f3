"""The harness the image, audio and transcription benchmarks share (`image_input_cpu`, `audio_input_cpu`,
`transcription_cpu`): one request to its
first token and whole, then several at once, timed on the engine (float and int8) and on transformers' own model, and
the result record with each path's ratio over transformers."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import cpu_model_name, git_commit, utc_timestamp

Prompt = Any  # an engine prompt: a ChatPrompt or a TranscriptionPrompt (imported with the engine, in `ladle_run`)


def ladle_run(
    folder: Path, quantization: str, prompts: Sequence[Prompt], warm: Prompt, new: int, max_model_len: int = 1024
) -> dict[str, Any]:
    """The engine's seconds for the first prompt alone (to its first token and whole) and for all `prompts` at once
    (`new` tokens each, greedy), after `warm` ran once; each request's tokens and the first's prompt length."""
    from engine_server import LLM, SamplingParams
    from engine_server.config import EngineConfig, SchedulerConfig

    config = EngineConfig(model=str(folder), device="cpu", quantization=quantization,  # type: ignore[arg-type]
                          scheduler=SchedulerConfig(max_model_len=max_model_len))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    with LLM(config=config) as llm:
        llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        start = time.perf_counter()
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        first = time.perf_counter() - start
        llm.core.scheduler.kv_cache.reset_prefix_cache()
        start = time.perf_counter()
        (one,) = llm.generate([prompts[0]], params, use_tqdm=False)
        single = time.perf_counter() - start
        llm.core.scheduler.kv_cache.reset_prefix_cache()
        start = time.perf_counter()
        results = llm.generate(list(prompts), params, use_tqdm=False)
        batched = time.perf_counter() - start
    tokens = [result.choices[0].token_ids for result in results]
    assert one.choices[0].token_ids == tokens[0], "a request's tokens alone differ from its tokens batched"
    return {"first_token_s": first, "single_s": single, "batch_s": batched, "tokens": tokens,
            "prompt_tokens": len(one.prompt_token_ids)}  # fmt: skip


def transformers_run(
    generate: Callable[[Any, int], list[int]], items: Sequence[Any], warm: Any, new: int,
    generate_all: Callable[[Sequence[Any], int], list[list[int]]] | None = None,
) -> dict[str, Any]:
    """transformers' seconds for the first item alone (to its first token and whole) and for all `items`
    (`generate(item, new tokens)` -> its greedy tokens), after `warm` ran once; each item's tokens. The items run one
    after another, or together through `generate_all(items, new tokens)` where the model's `generate` batches them."""
    generate(warm, 2)
    start = time.perf_counter()
    generate(items[0], 1)
    first = time.perf_counter() - start
    start = time.perf_counter()
    generate(items[0], new)
    single = time.perf_counter() - start
    start = time.perf_counter()
    tokens = [generate(item, new) for item in items] if generate_all is None else generate_all(items, new)
    return {"first_token_s": first, "single_s": single, "batch_s": time.perf_counter() - start, "tokens": tokens}


def compared_runs(
    folder: Path, transformers: dict[str, Any], prompts: Sequence[Prompt], warm: Prompt, new: int,
    max_model_len: int = 1024,
) -> dict[str, dict[str, Any]] | None:
    """transformers' run (`transformers_run`'s) beside the engine's float and int8 runs of `prompts` on `folder`; None,
    said on stderr, where the float path's tokens differ from transformers' (the benchmark then fails)."""
    runs = {"transformers_float": transformers}
    runs["ladle_float"] = ladle_run(folder, "none", prompts, warm, new, max_model_len)
    runs["ladle_int8"] = ladle_run(folder, "int8", prompts, warm, new, max_model_len)
    if runs["ladle_float"]["tokens"] != transformers["tokens"]:
        print("the float path's tokens differ from transformers'", file=sys.stderr)
        return None
    return runs


def result_record(benchmark: str, command: str, runs: dict[str, dict[str, Any]], requests: int, new: int,
                  **described: Any) -> dict[str, Any]:  # fmt: skip
    """The JSONL record of a run: `runs` by path ("transformers_float", "ladle_float", "ladle_int8"), their seconds,
    output tokens a second, and each engine path's ratio over transformers; `described` says what was run."""
    peer = runs["transformers_float"]
    return {
        "benchmark": benchmark, "commit": git_commit(), "timestamp": utc_timestamp(), "cpu": cpu_model_name(),
        "command": command, **described, "prompt_tokens": runs["ladle_float"]["prompt_tokens"], "new_tokens": new,
        "requests": requests,
        "seconds": {name: {key: round(run[key], 3) for key in ("first_token_s", "single_s", "batch_s")}
                    for name, run in runs.items()},
        "output_tokens_per_s": {name: {"single": round(new / run["single_s"], 1),
                                       "batch": round(requests * new / run["batch_s"], 1)}
                                for name, run in runs.items()},
        "over_transformers": {name: {"first_token": round(peer["first_token_s"] / run["first_token_s"], 2),
                                     "single": round(peer["single_s"] / run["single_s"], 2),
                                     "batch": round(peer["batch_s"] / run["batch_s"], 2)}
                              for name, run in runs.items() if name != "transformers_float"},
    }  # fmt: skip
