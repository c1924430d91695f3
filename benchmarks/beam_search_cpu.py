"""Beam search on the CPU: the embedded model (SmolLM2-135M-Instruct) answering chat prompts with 4 beams (the 4 best
answered, up to 64 new tokens), by the engine (`SamplingParams.beam_width`) on the float path and on its default, and
by transformers' `generate(num_beams=4, num_return_sequences=4, do_sample=False)` on the same weights in the same run:
each prompt alone, one after another, and (the engine) all prompts at once. The float path's beams must equal
transformers' token for token (the script fails otherwise).

    PYTHONPATH=. .venv/bin/python -m benchmarks.beam_search_cpu --out benchmarks/results/beam_search_cpu.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import append_result, cpu_model_name, git_commit, hf_model, utc_timestamp
from benchmarks.quality import QUALITY_PROMPTS

BEAMS = 4
NEW = 64
PROMPTS = 4


def _timed(run: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    found = run()
    return found, time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    from engine_server import LLM
    from engine_server.config import CacheConfig, EngineConfig
    from engine_server.frontend import ChatPrompt
    from engine_server.sampling_params import SamplingParams
    from engine_server.tokenizer.chat import ChatMessage

    torch.manual_seed(0)
    chats = [ChatPrompt((ChatMessage("user", text),)) for text in QUALITY_PROMPTS[:PROMPTS]]
    params = SamplingParams(max_tokens=NEW, beam_width=BEAMS, n=BEAMS)
    record: dict[str, Any] = {"benchmark": "beam_search_cpu", "commit": git_commit(), "time": utc_timestamp(),
                              "cpu": cpu_model_name(), "threads": torch.get_num_threads(), "model": "default",
                              "beams": BEAMS, "new_tokens": NEW, "prompts": PROMPTS,
                              "command": "python -m benchmarks.beam_search_cpu"}  # fmt: skip
    beams: dict[str, list[list[list[int]]]] = {}
    for quantization in ("none", "auto"):
        config = EngineConfig(device="cpu", quantization=quantization, cache=CacheConfig(memory_bytes=512 * 1024**2))
        with LLM(config=config) as llm:
            prompts = [llm.inputs.prepare(chat, params).token_ids for chat in chats]
            stops = sorted(llm.inputs.eos_token_ids)
            llm.generate([prompts[0]], params, use_tqdm=False)  # warm up
            alone, alone_s = _timed(lambda: [llm.generate([p], params, use_tqdm=False)[0] for p in prompts])  # noqa: B023
            _, together_s = _timed(lambda: llm.generate(prompts, params, use_tqdm=False))  # noqa: B023
        beams[quantization] = [[choice.token_ids for choice in result.choices] for result in alone]
        record[f"ladle_{quantization}_alone_s"] = round(alone_s, 3)
        record[f"ladle_{quantization}_together_s"] = round(together_s, 3)
    reference = hf_model("default", "cpu", torch.float32)

    def transformers_beams() -> list[list[list[int]]]:
        found = []
        for prompt in prompts:
            out = reference.generate(torch.tensor([prompt]), num_beams=BEAMS, num_return_sequences=BEAMS,
                                     do_sample=False, max_new_tokens=NEW, eos_token_id=stops, pad_token_id=stops[0])
            rows = []
            for row in out[:, len(prompt):].tolist():
                end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
                rows.append(row[:end])
            found.append(rows)
        return found

    with torch.inference_mode():
        reference_beams, hf_s = _timed(transformers_beams)
    record["transformers_alone_s"] = round(hf_s, 3)
    for quantization in ("none", "auto"):
        record[f"speedup_{quantization}_alone"] = round(hf_s / record[f"ladle_{quantization}_alone_s"], 2)
        record[f"speedup_{quantization}_together"] = round(hf_s / record[f"ladle_{quantization}_together_s"], 2)
    record["float_beams_equal_transformers"] = beams["none"] == reference_beams
    record["default_first_beams_equal_float"] = sum(
        ours[0] == theirs[0] for ours, theirs in zip(beams["auto"], beams["none"], strict=True))
    print(record)
    append_result(args.out, record)
    return 0 if record["float_beams_equal_transformers"] else 1


if __name__ == "__main__":
    sys.exit(main())
